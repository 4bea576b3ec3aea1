"""Image fields -> checked bytes (workflow_scripts/data/images.py), the shapes demo and the hub-layout writers."""
from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from PIL import Image, ImageFile

import vlm_layouts
from workflow_scripts.demo import make_images
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data.images import (
    IMAGE_REASONS, ImageFacts, ImageStats, check_image, default_base_dirs, image_field_bytes, resolve_image,
)
from workflow_scripts.data.rows import Rejected

ROOT = Path(__file__).resolve().parent.parent


def encoded(size=(8, 6), mode="RGB", fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, {"RGB": (10, 200, 30), "RGBA": (10, 200, 30, 128), "L": 90}[mode]).save(buffer, format=fmt)
    return buffer.getvalue()


def noisy(fmt="PNG", size=32) -> bytes:
    """Pixels that do not compress, so cutting the file short cuts into the image data, not the header."""
    image = Image.frombytes("RGB", (size, size), bytes((k * 97 + 31) % 251 for k in range(size * size * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def zero_width_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", 0, 8, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def rejection(call, *args, **kwargs) -> Rejected:
    with pytest.raises(Rejected) as caught:
        call(*args, **kwargs)
    return caught.value


@pytest.fixture
def raw(tmp_path) -> Path:
    """A raw dataset directory: one image beside the split files, one in images/."""
    (tmp_path / "raw" / "images" / "sub").mkdir(parents=True)
    (tmp_path / "raw" / "top.png").write_bytes(encoded((5, 4)))
    (tmp_path / "raw" / "images" / "sub" / "a.png").write_bytes(encoded((7, 3)))
    (tmp_path / "outside.png").write_bytes(encoded())
    return tmp_path / "raw"


# --- resolve_image: every layout ---
def test_resolve_path_relative_to_raw_dir_then_images_folder(raw):
    bases = default_base_dirs(raw)
    assert resolve_image("top.png", base_dirs=bases) == (raw / "top.png").read_bytes()
    assert resolve_image("images/sub/a.png", base_dirs=bases) == (raw / "images/sub/a.png").read_bytes()
    assert resolve_image("sub/a.png", base_dirs=bases) == (raw / "images/sub/a.png").read_bytes()  # found under images/
    assert resolve_image("images/../top.png", base_dirs=bases) == (raw / "top.png").read_bytes()  # stays inside
    assert resolve_image(str(raw / "top.png"), base_dirs=bases) == (raw / "top.png").read_bytes()  # absolute, inside


def test_resolve_refuses_paths_leaving_the_dataset(raw):
    for path in ("../outside.png", "images/../../outside.png", str(raw.parent / "outside.png")):
        error = rejection(resolve_image, path, base_dirs=default_base_dirs(raw))
        assert error.reason == "image_outside_dataset", path
        assert repr(path) in error.detail and str(raw) in error.detail and "without '..'" in error.detail


def test_resolve_missing_path_names_the_path_and_every_dir_tried(raw):
    error = rejection(resolve_image, "images/nope.png", base_dirs=default_base_dirs(raw))
    assert error.reason == "missing_image"
    assert error.detail == (f"image file 'images/nope.png' not found under {raw}, {raw / 'images'}; "
                            "add the file or fix the path in the record")
    assert "\n" not in error.detail
    assert rejection(resolve_image, "images/sub", base_dirs=[raw]).reason == "missing_image"  # a directory


def test_resolve_image_struct_bytes_win_and_null_bytes_use_the_path(raw):
    bases = default_base_dirs(raw)
    data = encoded((3, 3))
    assert resolve_image({"bytes": data, "path": "does/not/exist.png"}, base_dirs=bases) == data
    assert resolve_image({"bytes": None, "path": "top.png"}, base_dirs=bases) == (raw / "top.png").read_bytes()
    assert resolve_image({"path": "top.png"}, base_dirs=bases) == (raw / "top.png").read_bytes()
    assert rejection(resolve_image, {"bytes": None, "path": "gone.png"}, base_dirs=bases).reason == "missing_image"
    both_null = rejection(resolve_image, {"bytes": None, "path": None}, base_dirs=bases)
    assert both_null.reason == "missing_image" and "neither bytes nor a path" in both_null.detail


def test_resolve_raw_bytes(raw):
    data = encoded()
    assert resolve_image(data, base_dirs=[raw]) == data
    assert resolve_image(bytearray(data), base_dirs=[raw]) == data
    assert resolve_image(memoryview(data), base_dirs=[raw]) == data


@pytest.mark.parametrize("value, reason, words", [
    (42, "wrong_type", "got int 42"),
    (["x.png"], "wrong_type", "got list"),  # lists are image_field_bytes' business, not one image's
    ({"url": "x"}, "wrong_type", "keys ['url']"),
    ({"bytes": "text", "path": None}, "wrong_type", "'bytes' is a str"),
    ({"bytes": None, "path": 7}, "wrong_type", "'path' is a int"),
    ("", "empty_value", "path is empty"),
    ("   ", "empty_value", "path is empty"),
    ("https://example.org/a.png", "missing_image", "is a URL"),
])
def test_resolve_rejects_other_values(raw, value, reason, words):
    error = rejection(resolve_image, value, base_dirs=[raw])
    assert (error.reason, error.field) == (reason, None)
    assert words in error.detail


def test_resolve_rejects_a_decoded_pil_image(raw):
    error = rejection(resolve_image, Image.new("RGB", (2, 2)), base_dirs=[raw])
    assert error.reason == "wrong_type" and "Image(decode=False)" in error.detail


# --- check_image: a full decode and every rejection ---
@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("RGB", "JPEG"), ("RGB", "GIF")])
def test_check_image_facts(mode, fmt):
    facts = check_image(encoded((9, 5), mode=mode, fmt=fmt))
    assert (facts.width, facts.height, facts.format) == (9, 5, fmt)
    assert facts.mode == ("P" if fmt == "GIF" else mode)


def test_check_image_gives_the_upright_size_of_a_rotated_photo():
    """EXIF orientations 5-8 turn the picture a quarter: the report's width and height are the upright image's, as
    every later stage reads it (data.images.decode_rgb)."""
    from PIL import Image

    for orientation, size in ((1, (8, 6)), (3, (8, 6)), (6, (6, 8)), (8, (6, 8))):
        image = Image.new("RGB", (8, 6), (1, 2, 3))
        exif = image.getexif()
        exif[0x0112] = orientation
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", exif=exif)
        facts = check_image(buffer.getvalue())
        assert (facts.width, facts.height) == size, orientation


def test_check_image_rejects_zero_bytes():
    error = rejection(check_image, b"", source="image file x.png")
    assert error.reason == "empty_image" and error.detail.startswith("image file x.png is empty (0 bytes)")


@pytest.mark.parametrize("data, words", [
    (b"this is not an image", "not an image PIL can identify"),
    (zero_width_png(), "zero width/height"),
    (noisy()[:-100], "truncated"),  # caught by verify(): a PNG chunk cut short
])
def test_check_image_rejects_unreadable_data(data, words):
    error = rejection(check_image, data, source="image file c.png")
    assert error.reason == "unreadable_image"
    assert "image file c.png" in error.detail and words.lower() in error.detail.lower()
    assert "BytesIO" not in error.detail and "\n" not in error.detail


def test_check_image_rejects_a_truncated_jpeg_on_the_full_decode():
    data = noisy("JPEG")[:-200]
    Image.open(io.BytesIO(data)).verify()  # the header alone looks fine: only decoding every pixel shows the cut
    error = rejection(check_image, data)
    assert error.reason == "unreadable_image" and "truncated" in error.detail.lower()


def test_check_image_rejects_truncated_data_even_when_pil_is_told_to_pad(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert rejection(check_image, noisy("JPEG")[:-200]).reason == "unreadable_image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting is restored


@pytest.mark.parametrize("limit", [50, 30])  # 64 pixels: PIL warns above the limit, raises above twice it
def test_check_image_rejects_decompression_bombs(monkeypatch, limit):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    error = rejection(check_image, encoded((8, 8)))
    assert error.reason == "unreadable_image" and "decompression bomb" in error.detail
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64)
    assert check_image(encoded((8, 8))).width == 8


# --- image_field_bytes: what the record mapper calls ---
def test_image_field_bytes_one_image_or_a_list(raw):
    bases = default_base_dirs(raw)
    data = encoded((4, 4), fmt="JPEG")
    assert image_field_bytes("top.png", field="image", base_dirs=bases) == [(raw / "top.png").read_bytes()]
    both = image_field_bytes([{"bytes": data, "path": None}, "sub/a.png"], field="images", base_dirs=bases)
    assert both == [data, (raw / "images/sub/a.png").read_bytes()]


@pytest.mark.parametrize("value, reason, field, words", [
    (["top.png", b""], "empty_image", "images[1]", "the embedded image is empty (0 bytes)"),
    (["top.png", "images/missing.png"], "missing_image", "images[1]", "'images/missing.png' not found under"),
    ([{"bytes": None, "path": "top.png"}, "../outside.png"], "image_outside_dataset", "images[1]", "outside"),
    (["top.png", b"junk"], "unreadable_image", "images[1]", "not an image PIL can identify"),
    ("nope.png", "missing_image", "images", "not found"),
    ([], "empty_value", "images", "empty list"),
    (None, "missing_field", "images", "is null"),
    ([7], "wrong_type", "images[0]", "got int"),
])
def test_image_field_bytes_rejections_name_reason_field_and_detail(raw, value, reason, field, words):
    stats = ImageStats()
    result = image_field_bytes(value, field="images", base_dirs=default_base_dirs(raw), stats=stats)
    assert isinstance(result, Rejected)
    assert (result.reason, result.field) == (reason, field)
    assert words in result.detail and "\n" not in result.detail
    assert stats.images == 0 and stats.examples == 0  # a rejected example's good images are not counted
    assert reason in IMAGE_REASONS or reason in {"empty_value", "missing_field", "wrong_type"}


def test_every_image_reason_is_described():
    assert set(IMAGE_REASONS) == {"missing_image", "image_outside_dataset", "unreadable_image", "empty_image",
                                  "image_aspect_ratio", "image_value_range"}
    assert all(description and "\n" not in description for description in IMAGE_REASONS.values())


# --- ImageStats ---
def test_image_stats_counts_sizes_and_formats(raw):
    stats = ImageStats()
    bases = default_base_dirs(raw)
    png, jpeg = encoded((10, 2)), encoded((30, 6), fmt="JPEG")
    assert image_field_bytes([png, jpeg, png], field="images", base_dirs=bases, stats=stats) == [png, jpeg, png]
    assert image_field_bytes(encoded((20, 4), mode="L"), field="images", base_dirs=bases, stats=stats)
    report = stats.summary()
    assert report == {
        "examples": 2, "images": 4, "max_images_per_example": 3,
        "total_bytes": 2 * len(png) + len(jpeg) + len(encoded((20, 4), mode="L")),
        "width": {"min": 10, "median": 15, "max": 30}, "height": {"min": 2, "median": 3, "max": 6},
        "formats": {"JPEG": 1, "PNG": 3}, "modes": {"L": 1, "RGB": 3},
    }
    json.dumps(report)  # goes straight into normalise_report.json


def test_image_stats_empty_odd_median_and_merge():
    assert ImageStats().summary()["width"] == {"min": None, "median": None, "max": None}
    first, second = ImageStats(), ImageStats()
    first.add_example([ImageFacts(4, 4, "PNG", "RGB")], [100])
    second.add_example([ImageFacts(8, 2, "PNG", "RGB"), ImageFacts(100, 2, "JPEG", "RGB")], [10, 20])
    first.merge(second)
    report = first.summary()
    assert (report["examples"], report["images"], report["total_bytes"], report["max_images_per_example"]) == (2, 3, 130, 2)
    assert report["width"] == {"min": 4, "median": 8, "max": 100}


# --- the shapes demo ---
def read_split(directory: Path, split: str, planted: bool = False) -> list[dict]:
    """A split's records: the good ones, or (``planted``) only the deliberately broken ones."""
    rows = [json.loads(line) for line in (directory / f"{split}.jsonl").read_text().splitlines()]
    return [row for row in rows if ("-bad-" in str(row.get("id"))) == planted]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "shapes"
    assert make_images.main(["--out", str(out), "--seed", "0"]) == 0
    return out


def test_demo_is_byte_identical_for_the_same_seed(shapes, tmp_path):
    again = tmp_path / "shapes"
    make_images.main(["--out", str(again), "--seed", "0"])
    files = sorted(path.relative_to(shapes) for path in shapes.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(again) for path in again.rglob("*") if path.is_file())
    assert all((shapes / name).read_bytes() == (again / name).read_bytes() for name in files)
    other = tmp_path / "other"
    make_images.main(["--out", str(other), "--seed", "1"])
    assert (other / "train.jsonl").read_bytes() != (shapes / "train.jsonl").read_bytes()


def test_demo_layout_and_images(shapes):
    assert sorted(path.name for path in shapes.iterdir()) == ["images", "test.jsonl", "train.jsonl", "validation.jsonl"]
    ids = set()
    for split, size in make_images.SPLIT_SIZES.items():
        rows = read_split(shapes, split)
        assert len(rows) == size
        for row in rows:
            assert set(row) == {"id", "question", "answer", "image"} and row["image"] == f"images/{row['id']}.png"
            facts = check_image(resolve_image(row["image"], base_dirs=default_base_dirs(shapes)))
            assert (facts.width, facts.height, facts.format, facts.mode) == (32, 32, "PNG", "RGB")
            ids.add(row["id"])
    assert len(ids) == sum(make_images.SPLIT_SIZES.values())
    # the planted records: a missing file (no image written), a truncated PNG, an empty question
    planted = [row for split in make_images.FAULTS for row in read_split(shapes, split, planted=True)]
    assert len(planted) == sum(len(faults) for faults in make_images.FAULTS.values())
    written = sum((shapes / row["image"]).exists() for row in planted)
    assert len(list((shapes / "images").iterdir())) == len(ids) + written


def question_kind(question: str) -> str:
    return next(kind for kind, texts in make_images.QUESTIONS.items() if question in texts)


def test_demo_answers_are_balanced_per_question_type_and_text(shapes):
    for split in make_images.SPLIT_SIZES:
        rows = read_split(shapes, split)
        by_kind, by_text = defaultdict(Counter), defaultdict(Counter)
        for row in rows:
            by_kind[question_kind(row["question"])][row["answer"]] += 1
            by_text[row["question"]][row["answer"]] += 1
        for kind, counts in by_kind.items():
            assert set(counts) == set(make_images.ANSWERS[kind]), (split, kind)
            assert max(counts.values()) - min(counts.values()) <= 1, (split, kind, counts)
        for text, counts in by_text.items():  # no question text predicts its answer
            assert max(counts.values()) - min(counts.values()) <= 1, (split, text, counts)
            assert all(answer.lower() not in text.lower().split() for answer in counts)


def test_a_text_only_baseline_scores_chance(shapes):
    """The best a model that never looks at the image can do: the train split's majority answer per question."""
    majority = {text: counts.most_common(1)[0][0] for text, counts in _answers_by_text(read_split(shapes, "train")).items()}
    test = read_split(shapes, "test")
    accuracy = sum(majority[row["question"]] == row["answer"] for row in test) / len(test)
    assert accuracy == pytest.approx(0.25)


def _answers_by_text(rows):
    counts = defaultdict(Counter)
    for row in rows:
        counts[row["question"]][row["answer"]] += 1
    return counts


def test_demo_images_show_their_answer(shapes):
    """The answer is in the pixels: the shape colour is the only non-background colour; shapes = occupied quadrants."""
    colours = {rgb: name for name, rgb in make_images.COLOURS.items()}
    for row in read_split(shapes, "validation"):
        image = Image.open(shapes / row["image"]).convert("RGB")
        present = {colour for _, colour in image.getcolors()} - {make_images.BACKGROUND}
        assert len(present) == 1
        half = make_images.CELL
        quadrants = sum(
            any(image.getpixel((x, y)) != make_images.BACKGROUND
                for x in range(qx * half, (qx + 1) * half) for y in range(qy * half, (qy + 1) * half))
            for qx in range(2) for qy in range(2))
        truth = {"colour": colours[present.pop()], "count": str(quadrants)}
        assert truth[question_kind(row["question"])] == row["answer"]


def test_demo_sizes_and_refusing_a_directory_with_other_files(tmp_path):
    out = tmp_path / "small"
    make_images.main(["--out", str(out), "--train", "10", "--validation", "3", "--test", "5"])
    assert [len(read_split(out, split)) for split in ("train", "validation", "test")] == [10, 3, 5]
    make_images.main(["--out", str(out), "--train", "4", "--validation", "1", "--test", "1"])  # replaces its own output
    assert len(list((out / "images").iterdir())) == 6 + 2  # + the planted truncated and empty-question images
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(WorkflowError, match=r"holds \['keep.txt', 'small'\] besides this generator's files"):
        make_images.main(["--out", str(tmp_path)])
    assert (tmp_path / "keep.txt").read_text() == "mine"
    with pytest.raises(WorkflowError, match="is a file, not a directory"):
        make_images.main(["--out", str(tmp_path / "keep.txt")])
    with pytest.raises(WorkflowError, match="argument --train: must be at least 1, got 0"):
        make_images.main(["--out", str(out), "--train", "0"])


def test_demo_runs_as_a_module(tmp_path):
    done = subprocess.run([sys.executable, "-m", "workflow_scripts.demo.make_images", "--out", str(tmp_path / "s"),
                           "--train", "8", "--validation", "2", "--test", "2"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 12 examples" in done.stdout


# --- the hub-layout writers ---
def test_write_chartqa_parquet_with_the_image_struct(tmp_path):
    import datasets
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    planted = vlm_layouts.write_chartqa(tmp_path / "chartqa")
    for split, n in planted["splits"].items():
        table = pq.read_table(tmp_path / "chartqa" / f"{split}.parquet")
        assert table.num_rows == n
        assert table.schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        assert table.schema.field("label").type == pa.list_(pa.string())
        frame = pd.read_parquet(tmp_path / "chartqa" / f"{split}.parquet")
        assert list(frame.columns) == ["image", "query", "label", "human_or_machine"]
    train = pq.read_table(tmp_path / "chartqa" / "train.parquet").to_pylist()
    assert train[planted["empty_query"]["row"]]["query"] == ""
    loaded = datasets.Dataset.from_parquet(str(tmp_path / "chartqa" / "train.parquet"), cache_dir=str(tmp_path / "cache"))
    assert isinstance(loaded.features["image"], datasets.Image)
    undecoded = loaded.cast_column("image", datasets.Image(decode=False))
    for k, row in enumerate(undecoded):
        assert row["image"] == train[k]["image"]  # {bytes, path} round-trips unchanged
        result = image_field_bytes(row["image"], field="image", base_dirs=[tmp_path / "chartqa"])
        if k == planted["truncated_image"]["row"]:
            assert isinstance(result, Rejected) and result.reason == "unreadable_image"
            assert f"(path 'train_{k:04d}.png') cannot be decoded" in result.detail
        else:
            assert result == [train[k]["image"]["bytes"]]


def test_write_infographicvqa_jsonl_with_a_missing_image_and_unlabelled_test(tmp_path):
    directory = tmp_path / "infographicvqa"
    planted = vlm_layouts.write_infographicvqa(directory)
    for split, n in planted["splits"].items():
        rows = read_split(directory, split)
        assert len(rows) == n
        for k, row in enumerate(rows):
            result = image_field_bytes(row["image"], field="image", base_dirs=default_base_dirs(directory))
            if (split, k) == (planted["missing_image"]["split"], planted["missing_image"]["row"]):
                assert isinstance(result, Rejected) and result.reason == "missing_image"
                assert planted["missing_image"]["path"] in result.detail
            else:
                assert check_image(result[0]).format == "JPEG"
            if split == planted["unlabelled_split"]:
                assert row["answers"] is None
            else:
                assert len(row["answers"]) > 1


def test_write_ocrvqa_jsonl_with_a_length_mismatch(tmp_path):
    directory = tmp_path / "ocrvqa"
    planted = vlm_layouts.write_ocrvqa(directory)
    for split, n in planted["splits"].items():
        rows = read_split(directory, split)
        assert len(rows) == n
        matched = 0
        for k, row in enumerate(rows):
            assert not isinstance(image_field_bytes(row["image"], field="image", base_dirs=default_base_dirs(directory)), Rejected)
            if (split, k) == (planted["length_mismatch"]["split"], planted["length_mismatch"]["row"]):
                assert len(row["questions"]) != len(row["answers"])
            else:
                assert len(row["questions"]) == len(row["answers"]) >= 2
                matched += len(row["questions"])
        assert matched == planted["pairs"][split]


# --- 12-bit images in 16-bit PNGs (issue 43: readers against their references, round 2) ---
TWELVE_BIT = [[0, 1, 200, 2048], [3000, 4095, 17, 1234]]  # a 12-bit camera's raw values, stored as they are


def sixteen_bit_png(values, significant_bits: int | None = None) -> bytes:
    """A 16-bit greyscale PNG of ``values``, with an sBIT chunk declaring ``significant_bits`` when given."""
    import numpy as np
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    if significant_bits is not None:
        info.add(b"sBIT", bytes([significant_bits]))
    buffer = io.BytesIO()
    Image.fromarray(np.array(values, dtype=np.uint16)).save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()


def grey(decoded) -> list:
    import numpy as np

    pixels = np.asarray(decoded)
    assert (pixels == pixels[..., :1]).all()  # grey: the three channels alike
    return pixels[..., 0].tolist()


def test_a_12_bit_png_declaring_its_significant_bits_is_scaled_by_them_not_left_almost_black():
    """Scaled by the 16-bit range, 0..4095 became 0..16 of 255: an almost black image at exit 0. Pillow keeps no
    sBIT (its info has none), so the chunk is read from the file; with 12 significant bits the values span 0..4095."""
    import numpy as np

    from workflow_scripts.data.images import decode_rgb, png_significant_bits

    data = sixteen_bit_png(TWELVE_BIT, 12)
    with Image.open(io.BytesIO(data)) as opened:
        assert opened.mode == "I;16" and not any("sbit" in key.lower() for key in opened.info)
    assert png_significant_bits(data) == 12
    values = np.array(TWELVE_BIT, dtype=np.uint32)
    assert grey(decode_rgb(data)) == ((values * 255 + 2047) // 4095).tolist()  # 4095 -> 255, rounded as 65535 is
    assert check_image(data).scaling == "significant_bits"
    # Samples scaled up to 16 bits as the PNG specification has an encoder store them (v << 4 | v >> 8) keep the
    # 16-bit range: their sBIT says where they came from, not what they span.
    shifted = (values << 4) | (values >> 8)
    assert grey(decode_rgb(sixteen_bit_png(shifted.tolist(), 12))) == ((shifted * 255 + 32767) // 65535).tolist()
    assert check_image(sixteen_bit_png(shifted.tolist(), 12)).scaling == "full_range"


def test_a_12_bit_png_without_its_significant_bits_is_named_in_the_report_by_row(tmp_path):
    """Without sBIT the range cannot be known: scaled by 0..65535 (the PNG specification's reading) it is dark, and
    datasets + transformers' convert_to_rgb (Pillow's conversion) would clip it at 255 instead; neither is what the
    camera saw, so the normalise report counts such images and names their rows, as it does every 16-bit image
    whose reading differs from the reference's."""
    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    from workflow_scripts.data.images import decode_rgb

    data = sixteen_bit_png(TWELVE_BIT)
    with Image.open(io.BytesIO(data)) as opened:  # the reference: datasets' Image decoding, then convert_to_rgb
        opened.load()
        assert grey(convert_to_rgb(opened, return_numpy=True)) == np.minimum(TWELVE_BIT, 255).tolist()
    assert grey(decode_rgb(data)) == ((np.array(TWELVE_BIT) * 255 + 32767) // 65535).tolist()  # dark: at most 16
    assert check_image(data).scaling == "dark_without_significant_bits"
    sixteen = sixteen_bit_report(tmp_path, {"dark.png": data, "declared.png": sixteen_bit_png(TWELVE_BIT, 12)},
                                 ["plain.png", "dark.png", "plain.png", "declared.png", "dark.png"])
    assert {kind: (entry["count"], entry["rows"]) for kind, entry in sixteen.items()} == {
        "dark_without_significant_bits": (2, ["r1", "r4"]), "significant_bits": (1, ["r3"])}
    assert "convert_to_rgb would clip" in sixteen["dark_without_significant_bits"]["note"]


def sixteen_bit_report(tmp_path, files: dict, images: list) -> dict:
    """The normalise report's ``sixteen_bit`` notes of a train split whose rows r0.. show ``images`` (names of
    ``files``, plus an 8-bit ``plain.png``)."""
    from data_helpers import run_normalise, write_jsonl

    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    for name, data in {**files, "plain.png": encoded()}.items():
        (raw / "images" / name).write_bytes(data)
    write_jsonl(raw / "train.jsonl", [{"id": f"r{k}", "q": f"what is {k}?", "a": str(k), "image": f"images/{name}"}
                                      for k, name in enumerate(images)])
    write_jsonl(raw / "test.jsonl", [{"id": "t0", "q": "what?", "a": "0", "image": "images/plain.png"}])
    settings = {"task": "vision_language", "format": "jsonl", "source": {"type": "local", "path": str(raw)},
                "splits": {"train": "train", "test": "test"}, "metric": "exact_match",
                "fields": {"id": "id", "question": "q", "answers": "a", "image": "image"}}
    _, report = run_normalise("d", settings, raw, tmp_path)
    return json.loads(report.read_text())["images"]["train"]["sixteen_bit"]


def test_a_16_bit_png_whose_sbit_chunk_follows_its_image_data_is_read_as_libpng_reads_it_and_the_note_says_why():
    """The specification puts sBIT before IDAT, and libpng ignores one after it ("out of place"): so does the reader
    here, and the 12-bit image stays dark, named in the report. Its note said 'no PNG sBIT chunk', which a user
    looking at the file finds false; it names the chunk's place and what to move."""
    from workflow_scripts.data.images import SIXTEEN_BIT_NOTES

    plain = sixteen_bit_png(TWELVE_BIT)
    end = plain.rindex(b"IEND") - 4  # the IEND chunk's length field; an sBIT chunk (length, type, data, CRC) before it
    data = plain[:end] + struct.pack(">I", 1) + b"sBIT\x0c" + struct.pack(">I", zlib.crc32(b"sBIT\x0c")) + plain[end:]
    assert data.index(b"sBIT") > data.index(b"IDAT")
    assert check_image(data).scaling == "dark_without_significant_bits"
    note = SIXTEEN_BIT_NOTES["dark_without_significant_bits"]
    assert "no PNG sBIT chunk before its image data (IDAT)" in note and "one after it" in note


# --- 12-bit images in 16-bit colour PNGs (readers, round 3) ---
def sixteen_bit_colour_png(values, significant_bits: list[int] | None = None) -> bytes:
    """A 16-bit colour PNG (RGB for 3 channels, RGBA for 4, grey + alpha for 2) of ``values`` (rows x columns x
    channels), with an sBIT chunk of ``significant_bits`` (one per channel) when given. Written chunk by chunk: Pillow
    has no 16-bit colour mode to save from (it reads such a file as 8-bit RGB/RGBA)."""
    import numpy as np

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    samples = np.asarray(values, dtype=">u2")
    height, width, channels = samples.shape
    colour_type = {2: 4, 3: 2, 4: 6}[channels]
    rows = b"".join(b"\x00" + samples[y].tobytes() for y in range(height))  # filter type 0 (none) on every row
    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0))
    sbit = chunk(b"sBIT", bytes(significant_bits)) if significant_bits else b""
    return b"\x89PNG\r\n\x1a\n" + head + sbit + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


TWELVE_BIT_RGB = [[[0, 1, 200], [2048, 3000, 4095]], [[17, 1234, 4000], [255, 256, 3999]]]


def test_a_12_bit_colour_png_is_read_as_pillow_reads_it_and_named_in_the_report_as_dark(tmp_path):
    """A 16-bit RGB PNG of a 12-bit camera's values (0..4095) with sBIT 12: Pillow reads colour PNGs as 8-bit by
    keeping the high byte of each sample, so datasets + transformers' convert_to_rgb give 0..15 of 255, and so does
    the workflow (the pixels stay the reference's: neither Pillow nor libpng scales by sBIT). It came out dark
    without a word, where a 16-bit grey image read otherwise is counted by row: now counted and named by row too."""
    import numpy as np
    from datasets import Image as ImageFeature
    from transformers.image_transforms import convert_to_rgb

    from workflow_scripts.data.images import SIXTEEN_BIT_NOTES, decode_rgb

    declared = sixteen_bit_colour_png(TWELVE_BIT_RGB, [12, 12, 12])
    reference = convert_to_rgb(ImageFeature().decode_example({"bytes": declared, "path": None}), return_numpy=True)
    assert reference.tolist() == (np.array(TWELVE_BIT_RGB) >> 8).tolist()  # the high byte: at most 15, dark
    assert np.asarray(decode_rgb(declared)).tolist() == reference.tolist()  # the model sees the reference's pixels
    assert check_image(declared).scaling == "colour_significant_bits_dark"
    bare = sixteen_bit_colour_png(TWELVE_BIT_RGB)
    assert check_image(bare).scaling == "colour_dark_without_significant_bits"
    alpha = [[pixel + [65535] for pixel in row] for row in TWELVE_BIT_RGB]  # an opaque alpha is no colour: still dark
    assert check_image(sixteen_bit_colour_png(alpha, [12, 12, 12, 16])).scaling == "colour_significant_bits_dark"
    grey_alpha = [[[pixel[0], 65535] for pixel in row] for row in TWELVE_BIT_RGB]
    assert check_image(sixteen_bit_colour_png(grey_alpha, [12, 16])).scaling == "colour_significant_bits_dark"
    bright = (np.array(TWELVE_BIT_RGB) << 4 | np.array(TWELVE_BIT_RGB) >> 8).tolist()  # shifted up, as the spec has it
    assert check_image(sixteen_bit_colour_png(bright, [12, 12, 12])).scaling is None
    assert check_image(encoded()).scaling is None
    sixteen = sixteen_bit_report(tmp_path, {"declared.png": declared, "bare.png": bare},
                                 ["plain.png", "declared.png", "plain.png", "bare.png", "declared.png"])
    assert {kind: (entry["count"], entry["rows"]) for kind, entry in sixteen.items()} == {
        "colour_significant_bits_dark": (2, ["r1", "r4"]), "colour_dark_without_significant_bits": (1, ["r3"])}
    assert sixteen["colour_significant_bits_dark"]["note"] == SIXTEEN_BIT_NOTES["colour_significant_bits_dark"]
    assert "dark" in SIXTEEN_BIT_NOTES["colour_significant_bits_dark"]


def test_a_16_bit_colour_png_is_noted_dark_by_what_is_seen():
    """The note speaks of the opaque pixels the model sees (a transparent pixel becomes the background): dark
    colours under alpha 0 everywhere are no dark image, opaque dark pixels beside transparent bright ones are; an
    all-black image has nothing to tell (as the grey path). Found by a review: alpha was ignored, black was noted."""
    dark_hidden = [[pixel + [0] for pixel in row] for row in TWELVE_BIT_RGB]
    assert check_image(sixteen_bit_colour_png(dark_hidden)).scaling is None
    dark_seen = [[[65535, 65535, 65535, 0], [100, 2000, 4000, 65535]], [[3000, 50, 7, 65535], [0, 0, 0, 65535]]]
    assert check_image(sixteen_bit_colour_png(dark_seen)).scaling == "colour_dark_without_significant_bits"
    grey_alpha_hidden = [[[pixel[0], 0] for pixel in row] for row in TWELVE_BIT_RGB]
    assert check_image(sixteen_bit_colour_png(grey_alpha_hidden)).scaling is None
    black = [[[0, 0, 0]] * 2] * 2
    assert check_image(sixteen_bit_colour_png(black)).scaling is None
