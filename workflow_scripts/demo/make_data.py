"""Generate the offline demo's three small datasets (deterministic; the output is committed).

Each task is learnable by a tiny random-init model in a few hundred steps: short sentences over a
small vocabulary, and answers that follow from one keyword of the question through a fixed rule.
A few malformed records (missing field, empty string, wrong type, mismatched question/answer
lists, an unparseable graph) make the demo exercise normalisation's rejection path while staying
below the 5% rejection threshold of config/config.yaml.

    python -m workflow_scripts.demo.make_data --out demo_data
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Sequence

from workflow_scripts.core.errors import run_main
from workflow_scripts.demo import make_classification, make_corpus
from workflow_scripts.demo.common import run_generator, write_jsonl

SPLIT_SIZES = {"train": 520, "validation": 60, "test": 72}

# --- ChartQA-like: query, label (a list of strings), image path; validation split named "val" ---
FRUIT_VALUES = {
    "apples": "12", "pears": "30", "plums": "7.5", "grapes": "45", "lemons": "18",
    "melons": "64", "cherries": "3", "peaches": "25.5", "figs": "90", "limes": "51",
}
FRUIT_COLOURS = {
    "apples": "red", "pears": "green", "plums": "purple", "grapes": "blue", "lemons": "yellow",
    "melons": "orange", "cherries": "red", "peaches": "orange", "figs": "purple", "limes": "green",
}
CHARTS = ["sales", "harvest", "market", "export", "price", "stock"]


def chartqa_record(rng: random.Random, index: int) -> dict[str, Any]:
    fruit, chart = rng.choice(sorted(FRUIT_VALUES)), rng.choice(CHARTS)
    kind = rng.choice(["value", "value", "colour", "threshold"])
    if kind == "value":
        query, label = f"What is the value of {fruit} in the {chart} chart?", [FRUIT_VALUES[fruit]]
    elif kind == "colour":
        query, label = f"Which colour is the {fruit} bar in the {chart} chart?", [FRUIT_COLOURS[fruit]]
    else:
        higher = "yes" if float(FRUIT_VALUES[fruit]) > 20 else "no"
        query, label = f"Is the {fruit} bar above 20 in the {chart} chart?", [higher]
    return {"query": query, "label": label, "image": f"charts/{chart}_{index:04d}.png"}


# --- OCR-VQA-like: several questions and answers per book cover ---
GENRE_KEYWORDS = {
    "cooking": ["Cooking", "Recipes"], "history": ["History", "Empires"], "travel": ["Travel", "Journeys"],
    "science": ["Physics", "Chemistry"], "romance": ["Love", "Hearts"], "sports": ["Football", "Tennis"],
}
TITLE_WORDS = ["Easy", "Modern", "Ancient", "Little", "Complete", "Simple", "Great", "Hidden"]


def ocrvqa_record(rng: random.Random, index: int) -> dict[str, Any]:
    genre = rng.choice(sorted(GENRE_KEYWORDS))
    first = rng.choice(TITLE_WORDS)
    title = f"{first} {rng.choice(GENRE_KEYWORDS[genre])}"
    asked = genre if rng.random() < 0.5 else rng.choice(sorted(set(GENRE_KEYWORDS) - {genre}))
    pairs = [
        (f"What is the genre of the book {title}?", genre),
        (f"Is the book {title} about {asked}?", "yes" if asked == genre else "no"),
        (f"What is the first word of the title {title}?", first),
    ]
    chosen = rng.sample(pairs, rng.choice([1, 2, 2, 3]))
    image_id = f"cover{index:05d}"
    return {
        "image_id": image_id,
        "questions": [question for question, _ in chosen],
        "answers": [answer for _, answer in chosen],
        "title": title,
        "image": f"covers/{image_id}.jpg",
    }


# --- AMR-like: a sentence and its PENMAN graph (with variables) from a small grammar ---
NOUNS = ["boy", "girl", "dog", "cat", "teacher", "bird", "doctor", "child"]
ADJECTIVES = ["big", "small", "happy", "old"]
TRANSITIVE = {"see-01": ("sees", "see"), "like-01": ("likes", "like"), "chase-01": ("chases", "chase"),
              "help-01": ("helps", "help"), "call-01": ("calls", "call")}
INTRANSITIVE = {"sleep-01": ("sleeps", "sleep"), "run-02": ("runs", "run"), "sing-01": ("sings", "sing"),
                "dance-01": ("dances", "dance")}


class _Variables:
    """AMR-style variable names: the concept's first letter, numbered on collision (b, b2, ...)."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}

    def __call__(self, concept: str) -> str:
        letter = concept[0]
        self.used[letter] = self.used.get(letter, 0) + 1
        return letter if self.used[letter] == 1 else f"{letter}{self.used[letter]}"


def _noun_phrase(rng: random.Random, noun: str, var: _Variables) -> tuple[str, str, str]:
    """(words, variable, PENMAN node) for 'the [adjective] noun'."""
    variable = var(noun)
    if rng.random() < 0.2:
        adjective = rng.choice(ADJECTIVES)
        return f"the {adjective} {noun}", variable, f"({variable} / {noun} :mod ({var(adjective)} / {adjective}))"
    return f"the {noun}", variable, f"({variable} / {noun})"


def amr_record(rng: random.Random, index: int, split: str) -> dict[str, Any]:
    var = _Variables()
    kind = rng.choice(["transitive", "intransitive", "want", "want_transitive"])
    subject_noun, object_noun = rng.sample(NOUNS, 2)
    if kind in ("want", "want_transitive"):
        want = var("want-01")
        subject, s_var, s_node = _noun_phrase(rng, subject_noun, var)
        verbs = TRANSITIVE if kind == "want_transitive" else INTRANSITIVE
        concept = rng.choice(sorted(verbs))
        v_var = var(concept)
        if kind == "want_transitive":
            obj, _, o_node = _noun_phrase(rng, object_noun, var)
            words = f"{subject} wants to {verbs[concept][1]} {obj}"
            inner = f"({v_var} / {concept} :ARG0 {s_var} :ARG1 {o_node})"
        else:
            words = f"{subject} wants to {verbs[concept][1]}"
            inner = f"({v_var} / {concept} :ARG0 {s_var})"
        graph = f"({want} / want-01 :ARG0 {s_node} :ARG1 {inner})"
    else:
        verbs = TRANSITIVE if kind == "transitive" else INTRANSITIVE
        concept = rng.choice(sorted(verbs))
        v_var = var(concept)
        subject, _, s_node = _noun_phrase(rng, subject_noun, var)
        if kind == "transitive":
            obj, _, o_node = _noun_phrase(rng, object_noun, var)
            words = f"{subject} {verbs[concept][0]} {obj}"
            graph = f"({v_var} / {concept} :ARG0 {s_node} :ARG1 {o_node})"
        else:
            words = f"{subject} {verbs[concept][0]}"
            graph = f"({v_var} / {concept} :ARG0 {s_node})"
    sentence = words[0].upper() + words[1:] + "."
    return {"id": f"amr-{split}-{index:04d}", "sentence": sentence, "graph": graph}


# --- malformed records planted in the demo: (split, row index, how to break the record) ---
def _drop(field: str) -> Callable[[dict], dict]:
    return lambda record: {k: v for k, v in record.items() if k != field}


def _set(field: str, value: Any) -> Callable[[dict], dict]:
    return lambda record: {**record, field: value}


def _mismatch(record: dict) -> dict:
    return {**record, "questions": record["questions"] + ["What is the colour of the cover?"]}


MALFORMED = {
    "chartqa": [("train", 40, _drop("label")), ("train", 200, _set("query", "")),
                ("train", 333, _set("label", [17])), ("val", 12, _set("label", []))],
    "ocrvqa": [("train", 25, _mismatch), ("train", 120, _set("questions", [42])),
               ("train", 180, lambda record: {**record, "answers": [""] + record["answers"][1:]})],
    "amr": [("train", 30, _drop("graph")), ("train", 250, _set("sentence", "   ")),
            ("train", 400, _set("graph", "(s / sleep-01 :ARG0 (b / boy)")), ("validation", 7, _set("sentence", ["The boy runs."]))],
}


def _records(make: Callable[[random.Random, int, str], dict], rng: random.Random, splits: dict[str, str],
             sizes: dict[str, int], broken: Sequence[tuple[str, int, Callable]],
             keys: Callable[[dict], set]) -> dict[str, list[dict]]:
    """Records per split; a validation or test record sharing one of its ``keys`` (its inputs: one per
    question of a flattened record) with train is drawn again, so the held-out splits are held out
    (normalise's contamination check would stop them)."""
    out, seen = {}, set()
    for canonical, name in splits.items():
        rows = []
        for index in range(sizes[canonical]):
            row = make(rng, index, name)
            while canonical != "train" and keys(row) & seen:
                row = make(rng, index, name)
            rows.append(row)
        if canonical == "train":
            seen = set().union(*(keys(row) for row in rows))
        for split, index, breaker in broken:
            if split == name:
                rows[index] = breaker(rows[index])
        out[name] = rows
    return out


def build(seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    """All demo datasets: name -> source split name -> records."""
    ocr_sizes = {split: size // 2 for split, size in SPLIT_SIZES.items()}  # about two pairs per record
    return {
        "chartqa": _records(lambda r, i, s: chartqa_record(r, i), random.Random(seed),
                            {"train": "train", "validation": "val", "test": "test"}, SPLIT_SIZES, MALFORMED["chartqa"],
                            keys=lambda row: {(row["query"].lower(), row["image"])}),
        "ocrvqa": _records(lambda r, i, s: ocrvqa_record(r, i), random.Random(seed + 1),
                           {"train": "train", "validation": "validation", "test": "test"}, ocr_sizes, MALFORMED["ocrvqa"],
                           keys=lambda row: {(row["image_id"], row["title"], q.lower()) for q in row["questions"]}),
        "amr": _records(amr_record, random.Random(seed + 2),
                        {"train": "train", "validation": "validation", "test": "test"}, SPLIT_SIZES, MALFORMED["amr"],
                        keys=lambda row: {row["sentence"].lower()}),
    }


def write(out_dir: Path, seed: int = 0) -> None:
    for name, splits in build(seed).items():
        for split, rows in splits.items():
            write_jsonl(out_dir / name / f"{split}.jsonl", rows)


def main(argv: Sequence[str] | None = None) -> int:
    return run_generator(argv, __doc__.splitlines()[0], "Directory to write <dataset>/<split>.jsonl into.", write_all)


def write_all(out_dir: Path, seed: int = 0) -> None:
    """The text sets, the topics (classification) and the plain-text corpus (masked LM)."""
    write(out_dir, seed)
    make_classification.write(out_dir / "topics", seed)
    make_corpus.write(out_dir / "corpus", seed)


if __name__ == "__main__":
    run_main(main)
