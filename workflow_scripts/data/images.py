"""Images of a raw record -> checked image file bytes, for the vision_language task's canonical rows.

A raw image field comes in the layouts hubs and users ship:

- a path string relative to the dataset's files (``images/0001.png``), looked up under each base
  directory in turn (the raw directory, then an ``images/`` folder beside the split files:
  :func:`default_base_dirs`). A path may not leave the base directory it is looked up in: ``..``
  that climbs out, or an absolute path elsewhere, is refused (``image_outside_dataset``), so a
  record can never make normalisation read, and copy into the dataset, a file that is not part of it;
- the ``datasets`` Image feature's storage ``{"bytes": b"...", "path": "..."}`` (the bytes win; the
  path is used only when the bytes are null);
- the encoded file's raw ``bytes``.

The file's bytes are kept exactly as shipped (PNG, JPEG, ...): the normalised Arrow data holds them
and later stages decode them, so nothing is re-encoded (lossless, and the same bytes on every run).
Each image is decoded fully once here (:func:`check_image`), so a truncated or corrupt file is
rejected with a reason at normalisation rather than failing a DataLoader worker mid-training.

Rejections are :class:`~workflow_scripts.data.rows.Rejected` with the reasons in
:data:`IMAGE_REASONS`, so the normalise report counts and describes them like every other reason.
"""
from __future__ import annotations

import io
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.data.rows import Rejected

# Reason code -> description for the normalise report (normalise.REASONS holds the other reasons).
IMAGE_REASONS = {
    "missing_image": "an image path names no file under the dataset's files (or the image struct holds neither bytes nor a path)",
    "image_outside_dataset": "an image path leads outside the dataset's files ('..' or an absolute path elsewhere)",
    "unreadable_image": "an image cannot be decoded (unknown format, corrupt or truncated data, or above the decompression-bomb pixel limit)",
    "empty_image": "an image file or its bytes are empty (zero bytes)",
    "image_aspect_ratio": "an image is more than 200:1 wide or tall (Qwen's smart_resize refuses it; a fixed-size "
                          "tower would squash it beyond recognition)",
    "image_value_range": "a 32-bit integer (I) or float (F) image holds values outside 0..255, which its mode does not "
                         "scale: converting to RGB would clip them, or a float image holds 0..1 only, which it would "
                         "turn black (re-export it as 8- or 16-bit PNG)",
}
# Above this ratio of the long side to the short one Qwen2/2.5/3-VL's smart_resize raises a bare ValueError (the
# same limit in every dynamic-resolution family of transformers): refused here, with its row, at normalise.
MAX_ASPECT_RATIO = 200
# Modes whose samples span 0..65535: scaled to 8 bits by that range (the PNG specification's depth reduction,
# libpng's png_set_scale_16). Pillow's own convert, which transformers' convert_to_rgb calls, clips them at 255
# instead, so a 16-bit grayscale PNG of ordinary brightness became all white.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
# How a 16-bit grey image is brought to 8 bits (ImageFacts.scaling), each a reading that differs from the reference's
# (datasets' Image decoding keeps mode I;16, and transformers' convert_to_rgb, Pillow's conversion, clips it at 255):
# the normalise report counts them per split and names their rows.
SIXTEEN_BIT_NOTES = {
    "full_range": "16-bit greyscale, scaled to 8 bits by its 16-bit range 0..65535; datasets + transformers' "
                  "convert_to_rgb would clip it at 255 instead",
    "significant_bits": "16-bit greyscale whose PNG sBIT chunk declares fewer significant bits, its values within them "
                        "(a 12-bit camera's 0..4095): scaled by that range; datasets + transformers' convert_to_rgb "
                        "would clip it at 255 instead",
    # libpng ignores an sBIT after IDAT, or one whose value is not 1..16 in one byte, as png_significant_bits does
    "dark_without_significant_bits": "16-bit greyscale whose values all lie within 0..4095 and which declares no "
                                     "significant bits (no PNG sBIT chunk before its image data (IDAT), one after "
                                     "it or not one byte of 1..16 being ignored, as libpng ignores it; a 12-bit "
                                     "camera's?): scaled by the 16-bit range, it is dark (at most 16 of 255), and "
                                     "datasets + transformers' convert_to_rgb would clip it at 255 instead; add an "
                                     "sBIT chunk of its bit depth before IDAT, or rescale it to 0..65535",
    # 16-bit colour PNGs (RGB, RGBA, grey + alpha) are read as the reference reads them, by Pillow keeping the high
    # byte of each sample (libpng's png_set_strip_16 alike); these notes name the ones that come out dark by it.
    "colour_significant_bits_dark": "16-bit colour PNG whose sBIT chunk declares fewer significant bits (a 12-bit "
                                    "camera's?) and whose colour values all lie within 0..4095: read as Pillow reads "
                                    "it (datasets + transformers' convert_to_rgb alike), by the high 8 of its 16 "
                                    "bits, it is dark (at most 15 of 255), and the model sees it so; store the "
                                    "samples shifted up to 16 bits (value << (16 - significant bits), as the PNG "
                                    "specification has it), or save the image as 8-bit",
    "colour_dark_without_significant_bits": "16-bit colour PNG whose colour values all lie within 0..4095 and which "
                                            "declares no fewer significant bits (no sBIT chunk before its image data "
                                            "saying so; a 12-bit camera's?): read as Pillow reads it (datasets + "
                                            "transformers' convert_to_rgb alike), by the high 8 of its 16 bits, it is "
                                            "dark (at most 15 of 255), and the model sees it so; rescale its samples "
                                            "to 0..65535, or save the image as 8-bit",
}
# A 16-bit colour PNG is dark where the high byte Pillow keeps is at most this in every colour channel (samples
# within 0..4095, the 12-bit bound the grey notes use).
DARK_HIGH_BYTE = 4095 >> 8
NAMED_ROWS = 20  # rows named per note in the report (the count is of all)
# Modes whose range the mode does not say (a 32-bit integer or float plane): converted as Pillow converts them
# when every value lies in 0..255 (then that conversion is exact), refused otherwise (it would clip).
UNSCALED_MODES = ("I", "F")
IMAGES_FOLDER = "images"


@dataclass(frozen=True)
class ImageFacts:
    """What a full decode of one image showed (PIL's names for format and mode)."""

    width: int
    height: int
    format: str
    mode: str
    frames: int = 1  # an animated image's frame count: the first frame is the image, as PIL, datasets and transformers read it
    scaling: str | None = None  # a 16-bit grey image's reading, or a dark 16-bit colour PNG's note (a key of
    # SIXTEEN_BIT_NOTES); None for other images


def _png_sbit(data: bytes) -> bytes | None:
    """The body of a PNG's sBIT chunk (one byte per channel), or None. Read from the chunks here: Pillow's PNG reader
    skips sBIT (``Image.info`` has no such key), and the chunk layout is the PNG specification's (length, type,
    data, CRC; sBIT before the first IDAT: libpng ignores one after it)."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    position = 8
    while position + 8 <= len(data):
        length, kind = int.from_bytes(data[position:position + 4], "big"), data[position + 4:position + 8]
        if kind == b"sBIT":
            return data[position + 8:position + 8 + length]
        if kind in (b"IDAT", b"IEND"):
            return None
        position += 12 + length
    return None


def png_significant_bits(data: bytes) -> int | None:
    """The significant bits a greyscale PNG declares in its sBIT chunk (12 for a 12-bit camera's image), or None."""
    body = _png_sbit(data)
    return body[0] if body is not None and len(body) == 1 and 0 < body[0] <= 16 else None  # greyscale: one byte


# PNG colour type -> (channels in its sBIT chunk, of which colour): RGB, grey + alpha, RGBA.
_COLOUR_TYPES = {2: (3, 3), 4: (2, 1), 6: (4, 3)}


def sixteen_bit_colour(data: bytes) -> tuple[int, int | None] | None:
    """(colour channels, the most significant bits its sBIT declares for them or None) of a 16-bit colour PNG
    (RGB, RGBA, grey + alpha: read by Pillow as 8-bit RGB/RGBA); None for any other file."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR" or len(data) < 26 or data[24] != 16:
        return None
    layout = _COLOUR_TYPES.get(data[25])
    if layout is None:
        return None
    channels, colour = layout
    body = _png_sbit(data)
    valid = body is not None and len(body) == channels and all(0 < bits <= 16 for bits in body)
    return colour, (max(body[:colour]) if valid else None)


def colour_note(image, data: bytes) -> str | None:
    """The SIXTEEN_BIT_NOTES key of a 16-bit colour PNG that comes out dark as Pillow reads it (``image``, loaded),
    or None. Its pixels are not changed: Pillow keeps each sample's high byte (the reference's reading), and neither
    Pillow nor libpng scales a colour image by its sBIT (libpng's png_set_shift undoes the specification's shift of
    b-bit samples up to 16 bits, which a 12-bit camera's raw 0..4095 never had), so the note is all there is."""
    found = sixteen_bit_colour(data)
    if found is None or image.mode not in ("RGB", "RGBA", "LA"):
        return None
    import numpy as np

    _, bits = found
    pixels = np.asarray(image)
    values = pixels[..., :3] if image.mode != "LA" else pixels[..., :1]
    if image.mode in ("RGBA", "LA"):  # what is seen: the opaque pixels (a transparent one becomes background)
        values = values[pixels[..., -1] == 255]
    top = int(values.max()) if values.size else 0
    if not 0 < top <= DARK_HIGH_BYTE:  # bright, all black, or nothing opaque: nothing dark to tell
        return None
    return "colour_significant_bits_dark" if bits is not None and bits < 16 else "colour_dark_without_significant_bits"


def sixteen_bit_scaling(samples, significant_bits: int | None) -> tuple[str, int]:
    """(the SIXTEEN_BIT_NOTES key, the value that becomes 255) of 16-bit grey ``samples`` (a numpy array).
    Declared significant bits b < 16 with every value within 0..2**b - 1 (not all multiples of 2**(16 - b), which
    is how the specification's shifted samples of a dark image look) are the raw values of a b-bit sensor: scaled
    by 2**b - 1. Otherwise the 16-bit range (the specification's reading: an encoder stores b-bit samples shifted
    up to 16 bits), named as dark where every value is within 0..4095 and no sBIT says why."""
    top = int(samples.max()) if samples.size else 0
    if significant_bits is not None and significant_bits < 16 and top <= 2**significant_bits - 1 \
            and bool((samples % 2**(16 - significant_bits)).any()):
        return "significant_bits", 2**significant_bits - 1
    if significant_bits is None and 0 < top <= 4095:
        return "dark_without_significant_bits", 65535
    return "full_range", 65535


def default_base_dirs(raw_dir: Path) -> tuple[Path, Path]:
    """Where relative image paths are looked up: the raw directory, then its ``images/`` folder."""
    return Path(raw_dir), Path(raw_dir) / IMAGES_FOLDER


# --- one raw value -> the file's bytes ---
def resolve_image(value: Any, *, base_dirs: Sequence[Path]) -> bytes:
    """The encoded image file's bytes for a raw image value; raises ``Rejected`` (field None) if there are none."""
    return _resolve(value, base_dirs)[0]


def _resolve(value: Any, base_dirs: Sequence[Path]) -> tuple[bytes, str]:
    """(bytes, where they came from: for messages)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), "the embedded image"
    if isinstance(value, str):
        return _read_path(value, base_dirs)
    if isinstance(value, Mapping):
        if not {"bytes", "path"} & set(value):
            raise Rejected("wrong_type", None, f"an object with keys {sorted(value)} is not an image; expected "
                           "{'bytes': ..., 'path': ...} (the datasets Image layout), a path string or bytes")
        data, path = value.get("bytes"), value.get("path")
        if data is not None:  # the datasets Image feature reads the bytes first, the path only without them
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise Rejected("wrong_type", None, f"the image struct's 'bytes' is a {type(data).__name__}, not bytes; "
                               "re-export the images with their encoded file bytes")
            return bytes(data), f"the image embedded in the struct (path {path!r})"
        if path is None:
            raise Rejected("missing_image", None, "the image struct holds neither bytes nor a path; the record has no image: "
                           "re-export the dataset with its images embedded")
        if not isinstance(path, str):
            raise Rejected("wrong_type", None, f"the image struct's 'path' is a {type(path).__name__}, not a string")
        return _read_path(path, base_dirs)
    if type(value).__module__.startswith("PIL."):
        raise Rejected("wrong_type", None, "is a decoded PIL image, whose original file bytes are lost; read the column "
                       "undecoded (datasets Image(decode=False)) so the shipped bytes are kept")
    raise Rejected("wrong_type", None, f"expected an image path, the image file's bytes or {{'bytes', 'path'}}, "
                   f"got {type(value).__name__} {value!r:.60}")


def _read_path(path: str, base_dirs: Sequence[Path]) -> tuple[bytes, str]:
    if not path.strip():
        raise Rejected("empty_value", None, "the image path is empty; give the image file's path relative to the dataset")
    if "://" in path:
        raise Rejected("missing_image", None, f"image path {path!r} is a URL; images must ship with the dataset: "
                       f"download them into its {IMAGES_FOLDER}/ folder and give relative paths")
    if not base_dirs:
        raise ValueError("resolve_image needs at least one base directory to look image paths up in")
    tried, escaped = [], []
    for base in base_dirs:
        # Lexical containment: a symlinked images folder the user set up is fine; what is refused is a
        # record's path text reaching out of the dataset ('..' or an absolute path elsewhere).
        root = os.path.normpath(os.path.abspath(base))
        candidate = os.path.normpath(os.path.join(root, path))
        if os.path.commonpath([root, candidate]) != root:
            escaped.append(str(base))
            continue
        tried.append(str(base))
        if os.path.isfile(candidate):
            try:
                return Path(candidate).read_bytes(), f"image file {candidate}"
            except OSError as error:
                raise Rejected("unreadable_image", None, f"image file {candidate} cannot be read ({error.strerror or error}); "
                               "check its permissions") from None
    if not tried:
        raise Rejected("image_outside_dataset", None, f"image path {path!r} leads outside the dataset's files "
                       f"({', '.join(escaped)}); give a path relative to the dataset without '..'")
    raise Rejected("missing_image", None, f"image file {path!r} not found under {', '.join(tried)}; "
                   "add the file or fix the path in the record")


# --- the bytes -> a fully decoded, checked image ---
def check_image(data: bytes, *, source: str = "the image") -> ImageFacts:
    """Decode ``data`` fully once; its facts, or ``Rejected`` (field None) saying why it is not a usable image.

    ``source`` names where the bytes came from in the rejection's detail (an image file, "the embedded image").
    """
    from PIL import Image, ImageFile, UnidentifiedImageError

    if len(data) == 0:
        raise Rejected("empty_image", None, f"{source} is empty (0 bytes); re-export or re-download the image")
    # A process-wide PIL setting could make truncated files load padded with grey; the check must not.
    truncated_allowed, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    try:
        with warnings.catch_warnings():
            # PIL warns above MAX_IMAGE_PIXELS and raises above twice that: both reject (a decompression bomb).
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.verify()  # the header and, for PNG, every chunk's checksum
            with Image.open(io.BytesIO(data)) as image:
                image.load()  # the pixels: a truncated file fails here
                # The upright size, as decode_rgb turns the image by its EXIF orientation (5-8 swap the sides).
                upright = image.getexif().get(0x0112) in (5, 6, 7, 8)
                scaling = (sixteen_bit_scaling(_samples(image), png_significant_bits(data))[0]
                           if image.mode in SIXTEEN_BIT_MODES else colour_note(image, data))
                facts = ImageFacts(image.height if upright else image.width, image.width if upright else image.height,
                                   image.format or "unknown", image.mode, getattr(image, "n_frames", 1), scaling)
                extrema = image.getextrema() if image.mode in UNSCALED_MODES else None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
        raise Rejected("unreadable_image", None, f"{source} is too large to decode safely ({error}); shrink the image "
                       "or raise PIL.Image.MAX_IMAGE_PIXELS if it is genuine") from None
    except UnidentifiedImageError:
        raise Rejected("unreadable_image", None, f"{source} is not an image PIL can identify (unknown format, corrupt "
                       "header or a zero width/height); re-export it as PNG or JPEG") from None
    except Exception as error:  # PIL's decoders raise many types (OSError, SyntaxError, ValueError, ...) on bad data
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise Rejected("unreadable_image", None, f"{source} cannot be decoded ({reason}); re-export or re-download "
                       "the image") from None
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = truncated_allowed
    if facts.width <= 0 or facts.height <= 0:  # PIL refuses these at open; a plugin that does not is caught here
        raise Rejected("unreadable_image", None, f"{source} has a zero size ({facts.width}x{facts.height})")
    ratio = max(facts.width, facts.height) / min(facts.width, facts.height)
    if ratio > MAX_ASPECT_RATIO:
        raise Rejected("image_aspect_ratio", None, f"{source} is {facts.width}x{facts.height} pixels, {ratio:.0f}:1, "
                       f"above {MAX_ASPECT_RATIO}:1 (the vision-language processors refuse it); crop or pad the image")
    if extrema is not None and (extrema[0] < 0 or extrema[1] > 255):
        raise Rejected("image_value_range", None, f"{source} is a mode {facts.mode} image with values "
                       f"{extrema[0]:g}..{extrema[1]:g}, outside 0..255, and its mode gives no range to scale them "
                       "by (RGB would clip them); re-export it as an 8- or 16-bit PNG")
    if extrema is not None and facts.mode == "F" and 0 < extrema[1] <= 1:
        # A float image normalised to 0..1: Pillow's conversion (convert_to_rgb's) truncates each value to 0 or 1,
        # a black image; an 8-bit picture held as floats has values above 1 somewhere.
        raise Rejected("image_value_range", None, f"{source} is a mode F (float) image with values "
                       f"{extrema[0]:g}..{extrema[1]:g}, all within 0..1, which RGB conversion reads as 0..255 (the "
                       "image would be black); multiply by 255 and re-export it as an 8- or 16-bit PNG")
    return facts


# --- the bytes -> the RGB image every later stage gives the processor ---
def decode_rgb(data: bytes):
    """The image the model sees, read as the reference readers read it: the first frame (PIL's, as ``datasets``
    and transformers take it), turned upright by its EXIF orientation (``ImageOps.exif_transpose``, as
    ``datasets``' Image feature does), 16-bit grayscale scaled to 8 bits by its range (Pillow would clip it:
    :data:`SIXTEEN_BIT_MODES`), then transformers' ``convert_to_rgb``: transparency (RGBA, LA, PA, a palette or
    grayscale with a transparent colour) composited on white, every other mode (CMYK, 1-bit, L, P, YCbCr)
    through Pillow's conversion. The bytes passed :func:`check_image` at normalise, so nothing is refused here."""
    import numpy as np
    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    with Image.open(io.BytesIO(data)) as opened:
        opened.load()
        image = ImageOps.exif_transpose(opened)  # a copy when rotated; the opened file itself otherwise
        if image.mode in SIXTEEN_BIT_MODES:
            wide = _samples(image)
            _, top = sixteen_bit_scaling(wide, png_significant_bits(data))  # 4095 for a 12-bit PNG that says so
            grey = Image.fromarray(((wide * 255 + top // 2) // top).astype(np.uint8))
            transparent = image.info.get("transparency")  # a 16-bit grey PNG's tRNS value: its pixels are see-through
            if isinstance(transparent, int):  # kept as an alpha plane, so convert_to_rgb puts white there
                grey.putalpha(Image.fromarray(np.where(wide == transparent, 0, 255).astype(np.uint8)))
            image = grey
        return Image.fromarray(convert_to_rgb(image, return_numpy=True))


def _samples(image):
    """A 16-bit grey image's samples as uint32 (room for x 255)."""
    import numpy as np

    return np.asarray(image, dtype=np.uint32)


# --- what the vision_language record mapper calls ---
def image_field_bytes(value: Any, *, field: str, base_dirs: Sequence[Path],
                      stats: ImageStats | None = None) -> list[bytes] | Rejected:
    """The checked bytes of one image or a list of images (several per example), or the ``Rejected`` for the first bad one.

    Returned rather than raised, so the mapper decides (``rows.py``'s checks raise: ``raise`` the result
    if it is a ``Rejected``). The rejection's field is ``field`` or ``field[k]`` for the k-th image of a
    list. ``stats``, if given, counts the images of an accepted value only, so the report describes the
    images that reach the normalised data.
    """
    if value is None:
        return Rejected("missing_field", field, "is null; every example needs an image")
    if isinstance(value, (list, tuple)):
        if not value:
            return Rejected("empty_value", field, "is an empty list; every example needs at least one image")
        items = [(f"{field}[{index}]", item) for index, item in enumerate(value)]
    else:
        items = [(field, value)]
    images, facts = [], []
    for name, item in items:
        try:
            data, source = _resolve(item, base_dirs)
            facts.append(check_image(data, source=source))
        except Rejected as error:
            return Rejected(error.reason, name, error.detail)
        images.append(data)
    if stats is not None:
        stats.add_example(facts, [len(data) for data in images])
    return images


# --- sizes and counts for the normalise report ---
@dataclass
class ImageStats:
    """Counts and sizes of the accepted images: ``summary()`` goes into the normalise report."""

    examples: int = 0
    images: int = 0
    total_bytes: int = 0
    max_per_example: int = 0
    # Sizes as counters (value -> count): datasets repeat a few sizes, so this stays small at any scale.
    widths: Counter = field(default_factory=Counter)
    heights: Counter = field(default_factory=Counter)
    formats: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)
    scalings: Counter = field(default_factory=Counter)  # 16-bit images by their note (SIXTEEN_BIT_NOTES)
    scaling_rows: dict = field(default_factory=dict)  # reading -> the first NAMED_ROWS rows holding such an image

    def add(self, facts: ImageFacts, size_bytes: int) -> None:
        """One image (not an example: see :meth:`add_example`)."""
        if facts.scaling is not None:
            self.scalings[facts.scaling] += 1
        self.images += 1
        self.total_bytes += size_bytes
        self.widths[facts.width] += 1
        self.heights[facts.height] += 1
        self.formats[facts.format] += 1
        self.modes[facts.mode] += 1

    def add_example(self, facts: Sequence[ImageFacts], sizes: Sequence[int]) -> None:
        """The images of one accepted example."""
        self.examples += 1
        self.max_per_example = max(self.max_per_example, len(facts))
        for one, size in zip(facts, sizes, strict=True):
            self.add(one, size)

    def merge(self, other: ImageStats, row: str | None = None) -> None:
        """Add another split's (or worker's, or with ``row``: one row's) counts to these."""
        for scaling in other.scalings:
            named = self.scaling_rows.setdefault(scaling, [])
            named.extend(name for name in ([row] if row is not None else other.scaling_rows.get(scaling, []))
                         if len(named) < NAMED_ROWS)
        self.scalings.update(other.scalings)
        self.examples += other.examples
        self.images += other.images
        self.total_bytes += other.total_bytes
        self.max_per_example = max(self.max_per_example, other.max_per_example)
        for mine, theirs in ((self.widths, other.widths), (self.heights, other.heights),
                             (self.formats, other.formats), (self.modes, other.modes)):
            mine.update(theirs)

    def summary(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "images": self.images,
            "max_images_per_example": self.max_per_example,
            "total_bytes": self.total_bytes,
            "width": _spread(self.widths),
            "height": _spread(self.heights),
            "formats": dict(sorted(self.formats.items())),
            "modes": dict(sorted(self.modes.items())),
            **({"sixteen_bit": {scaling: {"count": count, "rows": self.scaling_rows.get(scaling, []),
                                          "note": SIXTEEN_BIT_NOTES[scaling]}
                                for scaling, count in sorted(self.scalings.items())}} if self.scalings else {}),
        }

    def notes(self, split: str) -> list[str]:
        """The log's lines on images read otherwise than the reference reads them, with their rows."""
        return [f"note: split {split}: {count} images: {SIXTEEN_BIT_NOTES[scaling]} (rows "
                f"{self.scaling_rows.get(scaling, [])}{' ...' if count > len(self.scaling_rows.get(scaling, [])) else ''})"
                for scaling, count in sorted(self.scalings.items())]


def _spread(counts: Counter) -> dict[str, float | int | None]:
    """min / median / max of counted values (all None without values)."""
    if not counts:
        return {"min": None, "median": None, "max": None}
    values = sorted(counts)
    total = sum(counts.values())

    def at(position: int) -> int:  # the value at a 0-based position of the sorted expansion
        seen = 0
        for value in values:
            seen += counts[value]
            if position < seen:
                return value
        raise IndexError(position)

    middle = (at((total - 1) // 2) + at(total // 2)) / 2
    return {"min": values[0], "median": int(middle) if middle == int(middle) else middle, "max": values[-1]}

