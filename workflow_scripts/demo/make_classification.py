"""Generate a small, learnable topic-classification demo dataset (deterministic for a given seed).

Each sentence mentions exactly one keyword of its topic (sport, food or weather) inside filler words
shared by all topics, so the label follows from one word: a tiny random-init classifier learns it in
a few hundred steps. Four malformed rows exercise normalisation's rejection path (a missing label,
an empty text, a number as text, and a test label outside the train split's label set), each split
staying below the 5% rejection threshold.

    python -m workflow_scripts.demo.make_classification --out demo_data/topics
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

from workflow_scripts.core.errors import run_main
from workflow_scripts.demo.common import run_generator, write_jsonl

SPLIT_SIZES = {"train": 300, "validation": 60, "test": 60}
KEYWORDS = {
    "sport": ["football", "tennis", "the match", "the goalkeeper", "a marathon", "the referee"],
    "food": ["the soup", "a pizza", "fresh bread", "the recipe", "pancakes", "the dessert"],
    "weather": ["the rain", "a storm", "the forecast", "sunshine", "the wind", "heavy snow"],
}
SUBJECTS = ["My neighbour", "The teacher", "Everyone", "Our family", "A friend of mine", "The old man"]
VERBS = ["talked about", "was surprised by", "kept thinking about", "wrote a note on", "laughed at", "asked about"]
ENDINGS = ["yesterday", "this morning", "all week", "again", "after lunch", "on the radio"]
# (split, row index, how the record is broken): each is rejected by normalise with the reason named.
MALFORMED = [("train", 17, "drop_label"), ("train", 123, "empty_text"), ("train", 250, "number_text"),
             ("test", 9, "unknown_label")]


def record(rng: random.Random, split: str, index: int) -> dict:
    topic = rng.choice(sorted(KEYWORDS))
    sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(KEYWORDS[topic])} {rng.choice(ENDINGS)}."
    return {"id": f"{split}-{index:04d}", "sentence": sentence, "topic": topic}


def broken(row: dict, how: str) -> dict:
    if how == "drop_label":
        return {key: value for key, value in row.items() if key != "topic"}
    if how == "empty_text":
        return {**row, "sentence": "  "}
    if how == "number_text":
        return {**row, "sentence": 42}
    return {**row, "topic": "politics"}  # unknown_label: not among the train split's labels


def build(seed: int = 0) -> dict[str, list[dict]]:
    """Split name -> records (one random stream per split, so resizing one split leaves the others)."""
    splits, seen = {}, set()
    for offset, (split, size) in enumerate(SPLIT_SIZES.items()):
        rng = random.Random(seed * 1000 + offset)
        rows = []
        for index in range(size):
            row = record(rng, split, index)
            while split != "train" and row["sentence"].lower() in seen:  # held-out text, never train's
                row = record(rng, split, index)
            rows.append(row)
        seen |= {row["sentence"].lower() for row in rows} if split == "train" else set()
        splits[split] = rows
    for split, index, how in MALFORMED:
        splits[split][index] = broken(splits[split][index], how)
    return splits


def write(out_dir: Path, seed: int = 0) -> None:
    for split, rows in build(seed).items():
        write_jsonl(out_dir / f"{split}.jsonl", rows)


def main(argv: Sequence[str] | None = None) -> int:
    return run_generator(argv, __doc__.splitlines()[0], "Directory to write train/validation/test.jsonl into.", write)


if __name__ == "__main__":
    run_main(main)
