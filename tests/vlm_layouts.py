"""Small image-QA datasets laid out as the hubs ship them, with real tiny PNG/JPEG images (for chain tests).

Each writer plants a few faults and returns a dict naming them (split, 0-based row index, path), so a
test can assert that normalisation rejects exactly those rows with the right reason:

- :func:`write_chartqa`: Parquet ``train/val/test.parquet`` (HuggingFaceM4/ChartQA's columns: ``image``
  as the datasets Image storage struct ``{bytes, path}``, ``query``, ``label`` a list of strings,
  ``human_or_machine``), with the ``huggingface`` schema metadata the hub's Parquet files carry;
- :func:`write_infographicvqa`: JSONL with ``questionId``, ``question``, ``answers`` (several accepted
  answers), ``image`` a path into ``images/`` (JPEG); the test split is unlabelled (``answers`` null);
- :func:`write_ocrvqa`: JSONL, one record per book cover with equal-length ``questions`` and ``answers``
  lists, ``image`` a path into ``images/`` (JPEG).

Images are drawn deterministically (no randomness), so every call writes the same files.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

PALETTE = [(220, 20, 20), (20, 170, 40), (30, 50, 230), (240, 220, 10), (150, 40, 200), (250, 130, 0)]


def bar_chart_png(values: list[int], *, width: int = 40, height: int = 32) -> bytes:
    """A tiny bar chart: one coloured bar per value (0..height) on white, as PNG bytes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    bar = width // max(1, len(values))
    for k, value in enumerate(values):
        pen.rectangle((k * bar + 1, height - 1 - value, (k + 1) * bar - 2, height - 1), fill=PALETTE[k % len(PALETTE)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def cover_jpeg(index: int, *, size: tuple[int, int] = (24, 36)) -> bytes:
    """A tiny 'cover': a coloured page with a dark title band, as JPEG bytes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, PALETTE[index % len(PALETTE)])
    ImageDraw.Draw(image).rectangle((2, 4 + index % 5, size[0] - 3, 10 + index % 5), fill=(20, 20, 20))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def truncated(data: bytes) -> bytes:
    """The file cut short before its end (as an interrupted download leaves it): the header still reads."""
    return data[: len(data) - 20]


# --- ChartQA (Parquet, images embedded as {bytes, path}) ---
CHARTQA_ROWS = {"train": 6, "val": 3, "test": 3}


def write_chartqa(directory: Path) -> dict[str, Any]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({
        "image": datasets.Image(),
        "query": datasets.Value("string"),
        "label": datasets.List(datasets.Value("string")),
        "human_or_machine": datasets.ClassLabel(names=["human", "machine"]),
    })
    planted = {"empty_query": {"split": "train", "row": 2, "field": "query"},
               "truncated_image": {"split": "train", "row": 4, "field": "image"}}
    for split, n in CHARTQA_ROWS.items():
        rows = []
        for k in range(n):
            values = [4 + (3 * k + 5 * j) % 26 for j in range(3)]
            image = bar_chart_png(values)
            query = f"What is the value of the {['first', 'second', 'third'][k % 3]} bar?"
            if (split, k) == ("train", planted["empty_query"]["row"]):
                query = ""
            if (split, k) == ("train", planted["truncated_image"]["row"]):
                image = truncated(image)
            rows.append({"image": {"bytes": image, "path": f"{split}_{k:04d}.png"}, "query": query,
                         "label": [str(values[k % 3])], "human_or_machine": k % 2})
        pq.write_table(pa.Table.from_pylist(rows, schema=features.arrow_schema), directory / f"{split}.parquet")
    return {"format": "parquet", "splits": dict(CHARTQA_ROWS), **planted}


# --- InfographicVQA (JSONL, image paths into images/) ---
INFOGRAPHIC_ROWS = {"train": 6, "validation": 3, "test": 3}


def write_infographicvqa(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    missing = {"split": "train", "row": 3, "field": "image", "path": "images/infographic_0103.jpg"}
    for offset, (split, n) in enumerate(INFOGRAPHIC_ROWS.items()):
        lines = []
        for k in range(n):
            # Two questions per infographic, as in the dataset: rows 2j and 2j+1 share an image.
            number = offset * 100 + k // 2 if (split, k) != (missing["split"], missing["row"]) else 103
            path = f"images/infographic_{number:04d}.jpg"
            if path != missing["path"]:
                (directory / path).write_bytes(cover_jpeg(number))
            answers = None if split == "test" else [f"{10 + k}%", f"{10 + k} percent", f"{10 + k}"]
            lines.append({"questionId": offset * 1000 + k, "question": f"What share of people chose option {k + 1}?",
                          "answers": answers, "image": path})
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"format": "jsonl", "splits": dict(INFOGRAPHIC_ROWS), "missing_image": missing, "unlabelled_split": "test"}


# --- OCR-VQA (JSONL, several question/answer pairs per cover) ---
OCRVQA_RECORDS = {"train": 5, "validation": 2, "test": 2}
GENRES = ["Cookbooks", "History", "Travel", "Science", "Romance"]


def write_ocrvqa(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    mismatch = {"split": "train", "row": 1, "field": "questions/answers"}
    pairs_by_split = {}
    for offset, (split, n) in enumerate(OCRVQA_RECORDS.items()):
        lines, pairs = [], 0
        for k in range(n):
            image_id = f"{offset}{k:05d}"
            genre = GENRES[(offset + k) % len(GENRES)]
            questions = ["What is the genre of this book?", "Is this a travel book?", "Who wrote this book?"][: 2 + k % 2]
            answers = [genre, "yes" if genre == "Travel" else "no", f"Author {k}"][: len(questions)]
            if (split, k) == (mismatch["split"], mismatch["row"]):
                answers = answers[:-1]
            else:
                pairs += len(questions)
            path = f"images/{image_id}.jpg"
            (directory / path).write_bytes(cover_jpeg(offset * 10 + k))
            lines.append({"image_id": image_id, "title": f"{genre} Book {k}", "questions": questions,
                          "answers": answers, "image": path})
        pairs_by_split[split] = pairs
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"format": "jsonl", "splits": dict(OCRVQA_RECORDS), "pairs": pairs_by_split, "length_mismatch": mismatch}
