"""download: local copies, URLs checked against a real HTTP server on loopback, hub via a fake client."""
import hashlib
import http.server
import io
import json
import tarfile
import threading
import zipfile

import pytest

from data_helpers import leftovers, local_dataset, run_download
from workflow_scripts import download
from workflow_scripts.core.errors import ConfigError, WorkflowError

TRAIN = [{"q": "a?", "a": "1"}, {"q": "b?", "a": "2"}, "not json at all"]
TEST = [{"q": "c?", "a": "3"}]


class Server:
    """A loopback HTTP server: path -> (body, how), how = 'ok' | 'drop' (close half-way through)."""

    def __init__(self):
        self.routes = {}
        routes = self.routes

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path not in routes:
                    self.send_error(404)
                    return
                body, how = routes[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if how == "drop":  # promise the whole body, send half, hang up
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, path, body, how="ok"):
        self.routes[path] = (body, how)
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = Server()
    yield running
    running.close()


def jsonl_bytes(rows):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def tar_gz(members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as bundle:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zipped(members):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
    return buffer.getvalue()


def url_settings(url, body, **extra):
    return {"source": {"type": "url", "url": url, "sha256": hashlib.sha256(body).hexdigest()},
            "splits": {"train": "train", "test": "test"}, "fields": {"question": "q", "answers": "a"},
            "metric": "exact_match", **extra}


def main_args(settings, tmp_path):
    return ["--name", "d", "--dataset", json.dumps(settings), "--out", str(tmp_path / "out" / "raw"),
            "--manifest", str(tmp_path / "out" / "download_manifest.json")]


def test_local_source_is_copied_byte_for_byte_with_a_manifest(tmp_path):
    settings = local_dataset(tmp_path / "src", {"train": TRAIN, "test": TEST})
    raw = run_download("d", settings, tmp_path)
    assert (raw / "train.jsonl").read_bytes() == (tmp_path / "src" / "train.jsonl").read_bytes()
    manifest = json.loads((raw.parent / "download_manifest.json").read_text())
    assert manifest["rows"] == {"train": 3, "test": 1}  # malformed rows are kept; normalise judges them
    assert manifest["source_type"] == "local"
    assert manifest["files"]["train.jsonl"] == hashlib.sha256((raw / "train.jsonl").read_bytes()).hexdigest()


def test_local_source_missing_a_split_file_names_it(tmp_path):
    settings = local_dataset(tmp_path / "src", {"train": TRAIN})
    with pytest.raises(WorkflowError, match=r"split 'test': .*test\.jsonl is missing \(the directory holds \['train\.jsonl'\]\); add test\.jsonl$"):
        download.main(main_args(settings, tmp_path))
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("suffix, pack", [(".tar.gz", tar_gz), (".zip", zipped)])
def test_url_archive_with_the_right_checksum(tmp_path, server, suffix, pack):
    body = pack({"data/train.jsonl": jsonl_bytes(TRAIN), "data/test.jsonl": jsonl_bytes(TEST), "README": b"x"})
    settings = url_settings(server.serve(f"/d{suffix}", body), body)
    raw = run_download("d", settings, tmp_path)
    assert sorted(p.name for p in raw.iterdir()) == ["test.jsonl", "train.jsonl"]
    assert (raw / "train.jsonl").read_bytes() == jsonl_bytes(TRAIN)
    manifest = json.loads((raw.parent / "download_manifest.json").read_text())
    assert manifest["sha256"] == settings["source"]["sha256"] and manifest["rows"] == {"train": 3, "test": 1}
    assert leftovers(tmp_path / "results" / "d") == ["download_manifest.json", "raw"]  # no temp files left


def test_url_single_json_file_maps_splits_to_records(tmp_path, server):
    body = json.dumps({"train": TRAIN[:2], "test": TEST}).encode()
    raw = run_download("d", url_settings(server.serve("/d.json", body), body, format="json"), tmp_path)
    assert json.loads((raw / "train.json").read_text()) == TRAIN[:2]


def test_url_checksum_mismatch_leaves_nothing(tmp_path, server):
    body = tar_gz({"train.jsonl": jsonl_bytes(TRAIN), "test.jsonl": jsonl_bytes(TEST)})
    settings = url_settings(server.serve("/d.tar.gz", body), b"other bytes")
    with pytest.raises(WorkflowError, match=r"sha256 mismatch \(config says [0-9a-f]{64}, received [0-9a-f]{64}\)"):
        download.main(main_args(settings, tmp_path))
    assert leftovers(tmp_path / "out") == []


def test_connection_dropped_mid_body_leaves_nothing(tmp_path, server):
    body = tar_gz({"train.jsonl": jsonl_bytes(TRAIN * 500), "test.jsonl": jsonl_bytes(TEST)})
    settings = url_settings(server.serve("/d.tar.gz", body, how="drop"), body)
    with pytest.raises(WorkflowError, match=rf"interrupted after {len(body) // 2} of {len(body)} bytes"):
        download.main(main_args(settings, tmp_path))
    assert leftovers(tmp_path / "out") == []


def test_http_error_and_archive_without_a_split(tmp_path, server):
    settings = url_settings(server.serve("/d.tar.gz", b"x"), b"x")
    settings["source"]["url"] += ".missing"
    with pytest.raises(WorkflowError, match="failed: Not Found"):
        download.main(main_args(settings, tmp_path))
    body = tar_gz({"train.jsonl": jsonl_bytes(TRAIN)})
    with pytest.raises(WorkflowError, match=r"no file \['test\.jsonl'\]"):
        download.main(main_args(url_settings(server.serve("/t.tar.gz", body), body), tmp_path))
    assert leftovers(tmp_path / "out") == []


def test_url_without_sha256_is_a_config_error(tmp_path):
    settings = {"source": {"type": "url", "url": "http://127.0.0.1:9/x.zip"}, "fields": {"question": "q", "answers": "a"},
                "metric": "exact_match"}
    with pytest.raises(ConfigError, match=r"datasets\.d\.source\.sha256"):
        download.main(main_args(settings, tmp_path))


def test_malformed_settings_json_is_one_clear_error(tmp_path):
    with pytest.raises(WorkflowError, match="argument --dataset: not valid JSON"):
        download.main(["--name", "d", "--dataset", "{oops", "--out", str(tmp_path / "r"), "--manifest", str(tmp_path / "m.json")])


def test_hub_source_loads_the_pinned_revision_and_saves_it(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, revision=None):
        calls.append((path, name, revision))
        return datasets.DatasetDict({
            "train": datasets.Dataset.from_list([{"query": "q?", "label": ["1"]}] * 3),
            "val": datasets.Dataset.from_list([{"query": "q?", "label": ["1"]}]),
            "test": datasets.Dataset.from_list([{"query": "q?", "label": ["2"]}] * 2),
        })

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    settings = {"source": {"type": "hub", "id": "HuggingFaceM4/ChartQA", "revision": "abc123"},
                "splits": {"train": "train", "validation": "val", "test": "test"},
                "fields": {"question": "query", "answers": "label"}, "metric": "relaxed_accuracy"}
    raw = run_download("chartqa", settings, tmp_path)
    assert calls == [("HuggingFaceM4/ChartQA", None, "abc123")]
    assert datasets.load_from_disk(str(raw))["test"].num_rows == 2
    manifest = json.loads((raw.parent / "download_manifest.json").read_text())
    assert manifest["revision"] == "abc123" and manifest["rows"] == {"train": 3, "val": 1, "test": 2}


def test_hub_source_lacking_a_configured_split_fails_cleanly(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"q": "x", "a": "y"}])}))
    settings = {"source": {"type": "hub", "id": "org/set", "revision": "v1"}, "splits": {"train": "train", "test": "test"},
                "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"}
    with pytest.raises(WorkflowError, match=r"org/set: no split \['test'\]"):
        download.main(main_args(settings, tmp_path))
    assert leftovers(tmp_path / "out") == []


def test_source_names_map_the_raw_copy_back_to_the_users_files():
    from workflow_scripts.core.entry_settings import DatasetSettings
    from workflow_scripts.data.source_paths import SourceNames

    def dataset(source):
        return DatasetSettings.parse({"source": source, "fields": {"question": "q", "answers": "a"},
                                      "metric": "exact_match"}, "d")

    local = SourceNames("results/data/d/raw", dataset({"type": "local", "path": "data/mine"}))
    assert local.translate("results/data/d/raw/train.jsonl line 3: bad; see results/data/d/raw") == (
        "data/mine/train.jsonl line 3: bad; see data/mine")
    assert local.translate("results/data/d/raw_other/x and xresults/data/d/raw/y") == (
        "results/data/d/raw_other/x and xresults/data/d/raw/y")  # only the copy itself
    url = SourceNames("/r/raw", dataset({"type": "url", "url": "https://x.org/d.zip", "sha256": "0" * 64}))
    assert url.translate("/r/raw/train.csv: not valid CSV") == "train.csv in https://x.org/d.zip: not valid CSV"
    hub = SourceNames("/r/raw", dataset({"type": "hub", "id": "org/ds", "revision": "abc"}))
    assert hub.shown("/r/raw/train") == "hub dataset org/ds@abc split train"


def test_a_damaged_corpus_shard_is_named_by_the_users_path_not_the_staging_copy(tmp_path):
    import gzip
    import random

    from workflow_scripts import download
    from workflow_scripts.core.errors import WorkflowError

    rng = random.Random(0)
    data = gzip.compress("".join(f"{rng.getrandbits(64):x} line {i}\n" for i in range(5000)).encode())
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "train.txt.gz").write_bytes(data[: len(data) // 2])
    (src / "test.txt").write_text("held out\n")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(src)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy"}
    with pytest.raises(WorkflowError) as caught:
        download.main(["--name", "m", "--dataset", json.dumps(settings), "--out", str(tmp_path / "raw"),
                       "--manifest", str(tmp_path / "download_manifest.json")])
    assert str(caught.value).startswith(f"{src / 'train.txt.gz'}: the gzip stream is damaged or cut short after line ")
    assert ".partial" not in str(caught.value) and not (tmp_path / "raw").exists()
