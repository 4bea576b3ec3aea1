"""Content fingerprints of local sources (data/source_files.py): what download's parameters follow."""
import os

from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.data import source_files


def test_image_folder_fingerprint_follows_bytes_not_times_and_covers_image_folder_splits(tmp_path):
    for split in ("train", "test"):
        (tmp_path / split / "charts").mkdir(parents=True)
        (tmp_path / split / "metadata.jsonl").write_text('{"file_name": "charts/0.png"}\n')
        (tmp_path / split / "charts" / "0.png").write_bytes(f"{split} image".encode())
    settings = {"source": {"type": "local", "path": str(tmp_path), "layout": "imagefolder"}, "task": "vision_language",
                "splits": {"train": "train", "test": "test"}, "metric": "exact_match",
                "fields": {"question": "q", "answers": "a", "image": "file_name"}}
    dirs = source_files.image_dirs(DatasetSettings.parse(settings, "charts"))
    assert dirs == [tmp_path / "train", tmp_path / "test"]
    cache = tmp_path / "cache.json"
    first = source_files.tree_fingerprint(dirs, cache)
    assert first.startswith("4 files, sha256 ")
    image = tmp_path / "test" / "charts" / "0.png"
    os.utime(image, ns=(1, 1))  # touched: other times, same bytes
    assert source_files.tree_fingerprint(dirs, cache) == first
    image.write_bytes(b"other bytes")
    os.utime(image, ns=(1, 1))
    assert source_files.tree_fingerprint(dirs, cache) != first
    # a dataset without an image field, and one with no images/ folder, have nothing to fingerprint
    assert source_files.image_dirs(DatasetSettings.parse(
        {**settings, "source": {"type": "local", "path": str(tmp_path)}, "fields": {"question": "q", "answers": "a"},
         "task": "generation"}, "qa")) == []
    assert source_files.tree_fingerprint([tmp_path / "images"], cache) == ""


def test_cached_hashes_are_reused_while_a_file_is_unchanged(tmp_path, monkeypatch):
    files = [tmp_path / f"{n}.png" for n in range(3)]
    for n, path in enumerate(files):
        path.write_bytes(bytes([n]) * 10)
    cache = tmp_path / "cache.json"
    digests = source_files.sha256_of_many(files, cache)
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    assert source_files.sha256_of_many(files, cache) == digests and opened == []
    files[1].write_bytes(b"changed")
    assert source_files.sha256_of_many(files, cache)[1] != digests[1] and opened == [files[1]]
