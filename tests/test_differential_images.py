"""Differential test of the image reader (issue 43, "The method"): odd-but-valid images, each read by the reference
readers and by the workflow, must come out equal, or be refused by both with the row named.

The reference reading of one image's bytes is what a user of the Hugging Face stack gets: ``datasets``' Image
feature (``PIL.Image.open``, the first frame, ``ImageOps.exif_transpose`` when an orientation is set), then
transformers' ``image_transforms.convert_to_rgb`` (transparency composited on white, every other mode through
Pillow's conversion), then the family's image processor (Qwen2-VL's PIL one here: it refuses above 200:1).
The workflow's reading is normalise's check (``data.images.image_field_bytes``: kept bytes or a rejection naming
the field) and the pixels training's collator makes from the kept bytes (``VisionCollator``, from the image
processor's settings as tokenise_meta.json holds them; pretokenise and evaluation read the bytes the same way,
``vision_language.open_images``).

Two readings differ on purpose, where the reference alters the image silently:
- ``I;16`` (16-bit grayscale PNG): Pillow's conversion, hence ``convert_to_rgb``, clips every value above 255 (a
  photo of ordinary brightness turns white); the workflow scales by the mode's range, 0..65535 -> 0..255 (the PNG
  specification's depth reduction). Compared against the reference's own 16-bit samples scaled so;
- ``I`` / ``F`` holding values outside 0..255: the mode gives no range, the reference clips; the workflow refuses
  the row ("refused by the workflow, clipped by the reference"). Within 0..255 both convert alike.

``PYTHONPATH=. python tests/test_differential_images.py`` prints the summary table that docs/data-formats.md carries
("Checked against reference readers"); ``test_the_docs_carry_this_table`` keeps the two equal.
"""
from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

ORIENTATION = 0x0112  # the EXIF Orientation tag
# Qwen2-VL's image processor at a small budget (patch 4, merge 2: one token per 8 x 8 pixels), as tokenise_meta.json
# records it; its smart_resize is the reference's refusal of an image above 200:1.
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 4, "merge_size": 2,
             "temporal_patch_size": 2, "size": {"shortest_edge": 64, "longest_edge": 64 * 64},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], bytes]
    kind: str = "equal"  # equal | scaled16 (the 16-bit scaling above) | refused (both) | workflow_refuses
    mode: str | None = None  # the mode PIL opens it in, where the case is about a mode


# --- the generator of odd-but-valid inputs ---
def _marked(size=(12, 8), mode="RGB"):
    """An asymmetric picture (a gradient with a corner mark), so a rotation or flip shows in the pixels."""
    from PIL import Image

    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 7 * 30], -1).astype(np.uint8)
    rgb[:2, :3] = (250, 10, 10)
    image = Image.fromarray(rgb)
    return image if mode == "RGB" else image.convert(mode)


def _save(image, fmt="PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _with_orientation(orientation: int, fmt: str) -> Callable[[], bytes]:
    def make():
        image = _marked()
        exif = image.getexif()
        exif[ORIENTATION] = orientation
        return _save(image, fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))
    return make


def _rgba() -> bytes:
    from PIL import Image

    rgba = np.zeros((6, 10, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, np.linspace(0, 255, 10).astype(np.uint8)  # transparent to opaque red
    return _save(Image.fromarray(rgba, "RGBA"))


def _la() -> bytes:
    from PIL import Image

    la = np.stack([np.full((6, 10), 40, np.uint8), np.tile(np.linspace(0, 255, 10).astype(np.uint8), (6, 1))], -1)
    return _save(Image.fromarray(la, "LA"))


def _palette(transparent: bool, fmt="PNG") -> Callable[[], bytes]:
    def make():
        image = _marked().convert("P", palette=1, colors=16)  # Image.Palette.ADAPTIVE
        return _save(image, fmt, **({"transparency": 0} if transparent else {}))
    return make


def _grey_transparent() -> bytes:
    grey = _marked().convert("L")
    return _save(grey, "PNG", transparency=grey.getpixel((0, 0)))  # the corner mark's grey: present, so it shows


def _sixteen_bit() -> bytes:
    from PIL import Image

    return _save(Image.fromarray((np.arange(60, dtype=np.uint16).reshape(6, 10) * 1100)))  # 0..64900: I;16


def _twelve_bit_rgb() -> bytes:
    """A 16-bit RGB PNG of a 12-bit camera's values (0..4095) with sBIT 12: both readings keep the high byte (dark
    alike); the normalise report names such an image by row (tests/test_images.py)."""
    from test_images import TWELVE_BIT_RGB, sixteen_bit_colour_png

    return sixteen_bit_colour_png(TWELVE_BIT_RGB, [12, 12, 12])


def _wide(mode: str, values) -> Callable[[], bytes]:
    def make():
        from PIL import Image

        return _save(Image.fromarray(np.asarray(values).reshape(4, 5), mode), "TIFF")
    return make


def _cmyk(fmt: str) -> Callable[[], bytes]:
    return lambda: _save(_marked().convert("CMYK"), fmt)


def _animated() -> bytes:
    from PIL import Image

    frames = [_marked().convert("P"), Image.new("P", (12, 8), 3)]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def _strip(width: int, height: int) -> Callable[[], bytes]:
    return lambda: _save(_marked((width, height)))


CASES = [
    *[Case(f"EXIF orientation {k} (JPEG)", _with_orientation(k, "JPEG")) for k in range(1, 9)],
    *[Case(f"EXIF orientation {k} (PNG eXIf)", _with_orientation(k, "PNG")) for k in (3, 6, 8)],
    Case("RGB", lambda: _save(_marked())),
    Case("RGBA, alpha 0..255", _rgba, mode="RGBA"),
    Case("LA, alpha 0..255", _la, mode="LA"),
    Case("P without transparency", _palette(False), mode="P"),
    Case("P with transparency (PNG tRNS)", _palette(True), mode="P"),
    Case("P with transparency (GIF)", _palette(True, "GIF"), mode="P"),
    Case("L with a transparent grey (tRNS)", _grey_transparent, mode="L"),
    Case("L", lambda: _save(_marked().convert("L")), mode="L"),
    Case("1-bit", lambda: _save(_marked().convert("1")), mode="1"),
    Case("CMYK (JPEG)", _cmyk("JPEG"), mode="CMYK"),
    Case("CMYK (TIFF)", _cmyk("TIFF"), mode="CMYK"),
    Case("I;16 (16-bit grayscale PNG)", _sixteen_bit, "scaled16", "I;16"),
    Case("16-bit RGB PNG with sBIT 12 (dark alike)", _twelve_bit_rgb, mode="RGB"),
    Case("I within 0..255 (TIFF)", _wide("I", np.arange(20, dtype=np.int32) * 13), mode="I"),
    Case("F within 0..255 (TIFF)", _wide("F", np.arange(20, dtype=np.float32) * 12.5), mode="F"),
    Case("I above 255 (TIFF)", _wide("I", np.arange(20, dtype=np.int32) * 3000), "workflow_refuses", "I"),
    Case("F below 0 (TIFF)", _wide("F", np.arange(20, dtype=np.float32) - 5), "workflow_refuses", "F"),
    Case("animated GIF (first frame)", _animated),
    Case("strip 200:1", _strip(400, 2)),
    Case("strip 201:1", _strip(402, 2), "refused"),
    Case("strip 1:250", _strip(2, 500), "refused"),
]


# --- the two readings ---
def reference_rgb(data: bytes) -> np.ndarray:
    """datasets' Image feature, then transformers' convert_to_rgb (channels last, uint8)."""
    from datasets import Image as ImageFeature
    from transformers.image_transforms import convert_to_rgb

    image = ImageFeature().decode_example({"bytes": data, "path": None})
    return convert_to_rgb(image, return_numpy=True)


def reference_scaled16(data: bytes) -> np.ndarray:
    """The 16-bit samples as the reference decodes them, scaled by their range (65535 -> 255), as grey RGB."""
    from datasets import Image as ImageFeature

    samples = np.asarray(ImageFeature().decode_example({"bytes": data, "path": None}), dtype=np.float64)
    grey = np.floor(samples * 255 / 65535 + 0.5).astype(np.uint8)  # round half up: exact in float64 for 16 bits
    return np.repeat(grey[..., None], 3, axis=-1)


def reference_pixels(rgb: np.ndarray):
    """The family's image processor on the reference's RGB image (raises where it refuses the image)."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})(
        [Image.fromarray(rgb)], return_tensors="pt")["pixel_values"]


def workflow_reading(data: bytes, tmp: Path):
    """(kept bytes or the Rejected, the RGB pixels pretokenise/evaluation read, the collator's pixel values)."""
    from workflow_scripts.data.images import image_field_bytes
    from workflow_scripts.data.rows import Rejected
    from workflow_scripts.tasks.vision_language import VisionCollator, open_images

    kept = image_field_bytes(data, field="image", base_dirs=[tmp])
    if isinstance(kept, Rejected):
        return kept, None, None
    rgb = np.asarray(open_images(kept)[0])
    collator = VisionCollator({"pad_token_id": 0, "image_processor": PROCESSOR}, vocab_size=8)
    batch = collator([{"id": "row-0", "input_ids": [1, 2], "labels": [-100, 2], "images": kept}])
    return kept, rgb, batch["pixel_values"]


@dataclass
class Outcome:
    case: Case
    agree: bool
    refused_by_both: bool
    detail: str


def compare(case: Case, tmp: Path) -> Outcome:
    from workflow_scripts.data.rows import Rejected

    data = case.make()
    kept, rgb, pixels = workflow_reading(data, tmp)
    if case.kind == "refused":
        try:
            reference_pixels(reference_rgb(data))
            reference_refuses = False
        except ValueError:
            reference_refuses = True
        both = reference_refuses and isinstance(kept, Rejected) and kept.field == "image"
        return Outcome(case, False, both, kept.detail if isinstance(kept, Rejected) else "accepted")
    if case.kind == "workflow_refuses":
        refused = isinstance(kept, Rejected) and kept.field == "image" and kept.reason == "image_value_range"
        return Outcome(case, False, False, kept.detail if refused else "accepted")
    if isinstance(kept, Rejected):
        return Outcome(case, False, False, f"refused by the workflow only: {kept.detail}")
    expected = reference_scaled16(data) if case.kind == "scaled16" else reference_rgb(data)
    same_bytes = kept == [data]  # normalise keeps the shipped bytes, re-encodes nothing
    same_rgb = rgb.shape == expected.shape and np.array_equal(rgb, expected)
    # The same uint8 image through the same processor: pixel values equal exactly (no tolerance is needed).
    import torch

    same_pixels = torch.equal(pixels, reference_pixels(expected))
    return Outcome(case, same_bytes and same_rgb and same_pixels, False,
                   f"bytes kept {same_bytes}, RGB equal {same_rgb}, pixel values equal {same_pixels}")


def outcomes(tmp: Path) -> list[Outcome]:
    found = []
    for case in CASES:
        try:
            found.append(compare(case, tmp))
        except Exception as error:  # a reader that crashes on an input fails that input's test, naming the error
            found.append(Outcome(case, False, False, f"raised {type(error).__name__}: {error}"))
    return found


def summary_rows(results: list[Outcome]) -> list[str]:
    """The docs' table rows for this reader (reader | inputs | agreeing | refused by both | refused by the workflow
    alone, where the reference clips)."""
    agreeing = sum(outcome.agree for outcome in results)
    both = sum(outcome.refused_by_both for outcome in results)
    alone = sum(outcome.case.kind == "workflow_refuses" and outcome.detail != "accepted" for outcome in results)
    return [f"| images (`datasets` Image + `convert_to_rgb` + Qwen2-VL's processor) | {len(results)} | {agreeing} "
            f"| {both} | {alone} |"]


# --- the tests ---
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[Outcome]:
    return outcomes(tmp_path_factory.mktemp("differential"))


def test_the_generator_covers_the_odd_layouts_issue_43_names():
    names = " ".join(case.name for case in CASES)
    for k in range(1, 9):
        assert f"EXIF orientation {k} " in names
    for layout in ("RGBA", "LA", "P without transparency", "P with transparency", "I;16", "I within", "F within",
                   "CMYK", "1-bit", "L", "animated GIF", "200:1"):
        assert layout in names, layout


def test_each_generated_image_is_what_its_name_says():
    """The generator's own check: each mode case opens in that mode, transparency and frames where named."""
    from PIL import Image

    for case in CASES:
        with Image.open(io.BytesIO(case.make())) as image:
            assert case.mode is None or image.mode == case.mode, (case.name, image.mode)
            assert ("with transparency" not in case.name and "transparent" not in case.name
                    or "transparency" in image.info), case.name
            assert ("animated" not in case.name) or image.n_frames == 2, case.name
            orientation = re.search(r"EXIF orientation (\d)", case.name)
            assert orientation is None or image.getexif().get(ORIENTATION) == int(orientation.group(1)), case.name


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case.name for case in CASES])
def test_each_image_is_read_as_the_reference_reads_it_or_refused_by_both(results, index):
    outcome = results[index]
    if outcome.case.kind == "refused":
        assert outcome.refused_by_both, outcome.detail
        assert re.search(r"\d+x\d+ pixels, \d+:1, above 200:1", outcome.detail), outcome.detail
    elif outcome.case.kind == "workflow_refuses":
        assert "outside 0..255" in outcome.detail, outcome.detail
    else:
        assert outcome.agree, outcome.detail


def test_the_readings_differ_from_the_old_convert_where_the_old_one_altered_the_image(results):
    """Not a tautology: for the planted layouts Pillow's plain convert("RGB") (the old reading) is NOT what the
    model now sees."""
    from PIL import Image

    from workflow_scripts.tasks.vision_language import open_images

    altered = {"EXIF orientation 6 (JPEG)", "RGBA, alpha 0..255", "LA, alpha 0..255", "P with transparency (PNG tRNS)",
               "I;16 (16-bit grayscale PNG)"}
    for case in CASES:
        if case.name in altered:
            data = case.make()
            old = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            new = np.asarray(open_images([data])[0])
            assert old.shape != new.shape or not np.array_equal(old, new), case.name


def test_the_docs_carry_this_table(results):
    docs = (ROOT / "docs" / "data-formats.md").read_text()
    section = docs.split("## Checked against reference readers", 1)
    assert len(section) == 2, "docs/data-formats.md has no 'Checked against reference readers' section"
    for row in summary_rows(results):
        assert row in section[1], f"docs/data-formats.md: expected the row\n{row}\n(python {__file__} prints it)"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        found = outcomes(Path(directory))
    print("| reader | inputs | agreeing | refused by both | refused by the workflow alone |")
    print("|---|---|---|---|---|")
    print("\n".join(summary_rows(found)))
    for outcome in found:
        print(f"- {outcome.case.name}: {outcome.detail}", file=sys.stderr)
