"""Generate the offline image-QA demo dataset 'shapes' (deterministic for a given seed).

Each example is a 32x32 PNG of 1 to 4 filled shapes (squares, discs, diamonds) of one saturated
colour on a plain grey background, one shape per quadrant, each filling much of its quadrant, so a
tiny random frozen vision tower (patch 8: a quadrant is 2x2 patches) plus LoRA can learn it in a few
hundred steps. Questions ask the colour or the number of shapes. The answer can only be read from
the image: the question text is one of a few fixed paraphrases per question type, and within each
split, question type and paraphrase every answer occurs equally often (to within one), so a
text-only model does no better than chance: 1/4 for both question types.

Layout: ``<split>.jsonl`` rows ``{"id", "question", "answer", "image": "images/<id>.png"}`` and the
``images/`` folder; the whole directory is written at once (atomic). The same seed gives
byte-identical files with the same Pillow/zlib versions (fixed PNG settings, no metadata chunks).

    python -m workflow_scripts.demo.make_images --out demo_data/shapes
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Sequence

from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.demo.common import generator_parser

SPLIT_SIZES = {"train": 600, "validation": 64, "test": 128}  # multiples of 8: every answer equally often
IMAGE_SIZE = 32
CELL = IMAGE_SIZE // 2  # one shape per quadrant, so shapes never touch and counting is unambiguous
BACKGROUND = (128, 128, 128)  # mid grey: every shape colour differs from it strongly in some channel
COLOURS = {"red": (220, 20, 20), "green": (20, 170, 40), "blue": (30, 50, 230), "yellow": (240, 220, 10)}
COUNTS = ("1", "2", "3", "4")
SHAPES = ("square", "disc", "diamond")
SHAPE_SIZES = (12, 13, 14)  # pixels across, of a 16-pixel quadrant
QUESTIONS = {
    "colour": ("What colour are the shapes?", "Which colour do the shapes in the picture have?"),
    "count": ("How many shapes are there?", "How many shapes does the picture show?"),
}
ANSWERS = {"colour": tuple(COLOURS), "count": COUNTS}
IMAGES_FOLDER = "images"
PNG_SETTINGS = {"format": "PNG", "compress_level": 9, "optimize": False}  # fixed: the same bytes every run
OUTPUT_NAMES = {f"{split}.jsonl" for split in SPLIT_SIZES} | {IMAGES_FOLDER}


def questions_and_answers(rng: random.Random, kind: str, n: int) -> list[tuple[str, str]]:
    """``n`` (question, answer) pairs of one question type, the answers balanced per paraphrase.

    Answers come in blocks holding each answer once (shuffled); block b uses paraphrase b mod P, so
    every paraphrase sees every answer equally often and no question text predicts its answer.
    """
    paraphrases, answers = QUESTIONS[kind], ANSWERS[kind]
    pairs: list[tuple[str, str]] = []
    block = 0
    while len(pairs) < n:
        order = list(answers)
        rng.shuffle(order)
        pairs.extend((paraphrases[block % len(paraphrases)], answer) for answer in order)
        block += 1
    return pairs[:n]


def draw(colour: str, count: int, rng: random.Random):
    """A 32x32 RGB image of ``count`` shapes of ``colour``, one in each of ``count`` random quadrants."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    for quadrant in sorted(rng.sample(range(4), count)):
        size = rng.choice(SHAPE_SIZES)
        # A 1-pixel margin inside the quadrant keeps neighbouring shapes apart.
        left = (quadrant % 2) * CELL + rng.randint(1, CELL - 1 - size)
        top = (quadrant // 2) * CELL + rng.randint(1, CELL - 1 - size)
        box = (left, top, left + size - 1, top + size - 1)
        shape = rng.choice(SHAPES)
        if shape == "square":
            pen.rectangle(box, fill=fill)
        elif shape == "disc":
            pen.ellipse(box, fill=fill)
        else:
            middle_x, middle_y = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            pen.polygon([(middle_x, box[1]), (box[2], middle_y), (middle_x, box[3]), (box[0], middle_y)], fill=fill)
    return image


def build(split: str, n: int, seed: int, held_out_from: set | None = None) -> list[tuple[dict[str, Any], Any]]:
    """(record, image) pairs of one split; one random stream per split, so resizing one leaves the others.

    ``held_out_from``: (question, image pixels) pairs of the train split; an example repeating one is
    drawn again, so validation and test hold no copy of a train example (normalise checks this).
    """
    rng = random.Random(seed * 1000 + list(SPLIT_SIZES).index(split))
    kinds = list(QUESTIONS)
    examples = []
    for position, kind in enumerate(kinds):
        share = n // len(kinds) + (1 if position < n % len(kinds) else 0)
        for question, answer in questions_and_answers(rng, kind, share):
            # The attribute not asked about is drawn at random, so it carries no hint either.
            colour = answer if kind == "colour" else rng.choice(list(COLOURS))
            count = int(answer) if kind == "count" else rng.randint(1, 4)
            examples.append((question, answer, colour, count))
    rng.shuffle(examples)
    out = []
    for index, (question, answer, colour, count) in enumerate(examples):
        example_id = f"{split}-{index:04d}"
        record = {"id": example_id, "question": question, "answer": answer,
                  "image": f"{IMAGES_FOLDER}/{example_id}.png"}
        image = draw(colour, count, rng)
        while held_out_from is not None and (question, image.tobytes()) in held_out_from:
            image = draw(colour, count, rng)
        out.append((record, image))
    return out


def write(out_dir: Path, seed: int = 0, sizes: dict[str, int] | None = None, plant_faults: bool = True) -> dict[str, int]:
    """Write the dataset into ``out_dir`` (replacing a previous output there); rows per split."""
    sizes = dict(SPLIT_SIZES if sizes is None else sizes)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise WorkflowError(f"{out_dir}: is a file, not a directory; choose a new or empty --out directory")
    if out_dir.exists():
        foreign = sorted(path.name for path in out_dir.iterdir() if path.name not in OUTPUT_NAMES)
        if foreign:  # the directory is replaced whole: never take someone's other files with it
            raise WorkflowError(
                f"{out_dir}: holds {foreign[:5]} besides this generator's files, and the output replaces the whole "
                "directory; choose a new or empty --out directory"
            )
    with atomic_path(out_dir, directory=True) as temporary:
        temporary.chmod(0o755)  # a temporary directory is private (0700); the dataset is for everyone to read
        (temporary / IMAGES_FOLDER).mkdir()
        train = None
        for split, n in sizes.items():
            examples = build(split, n, seed, None if split == "train" else train)
            if split == "train":
                train = {(record["question"], image.tobytes()) for record, image in examples}
            for record, image in examples:
                image.save(temporary / record["image"], **PNG_SETTINGS)
            records = [record for record, _ in examples]
            if plant_faults and split in FAULTS:
                records += planted(split, temporary, examples[0][1])
            (temporary / f"{split}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return sizes


# A few broken records so the demo runs normalise's image rejections (each split stays under 5%).
FAULTS = {"train": ("missing_image", "unreadable_image", "empty_value"), "test": ("missing_image",)}


def planted(split: str, folder: Path, image) -> list[dict[str, Any]]:
    """One record per fault in FAULTS[split], appended after the good ones (ids ``<split>-bad-<k>``)."""
    import io

    records = []
    for k, fault in enumerate(FAULTS[split]):
        record = {"id": f"{split}-bad-{k}", "question": "How many shapes are there?", "answer": "1",
                  "image": f"{IMAGES_FOLDER}/{split}-bad-{k}.png"}
        if fault == "unreadable_image":  # a PNG cut in half, as an interrupted copy leaves it
            encoded = io.BytesIO()
            image.save(encoded, **PNG_SETTINGS)
            (folder / record["image"]).write_bytes(encoded.getvalue()[: len(encoded.getvalue()) // 2])
        elif fault == "empty_value":
            image.save(folder / record["image"], **PNG_SETTINGS)
            record["question"] = ""
        records.append(record)  # missing_image: the file is never written
    return records


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = generator_parser(__doc__.splitlines()[0], "Directory to write <split>.jsonl and images/ into.")
    for split, size in SPLIT_SIZES.items():
        parser.add_argument(f"--{split}", type=_positive, default=size, help=f"Rows in {split} (default {size}).")
    args = parser.parse_args(argv)
    sizes = write(args.out, args.seed, {split: getattr(args, split) for split in SPLIT_SIZES})
    print(f"wrote {sum(sizes.values())} examples ({sizes}) to {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
