"""Generate a small plain-text corpus for the masked-LM demo (deterministic for a given seed).

One sentence per line from a small grammar in which most words follow from the rest of their line:
fixed facts (each animal has its own verb, food and place; each country its capital), agreement
(``the cat drinks ... it`` vs ``the cats drink ... they``), an entity named twice in the line,
numbers counting up and days of the week in order, and set phrases (``once upon a time``). A tiny
random BERT with LoRA learns it in a few hundred steps. With a small WordPiece vocabulary (the demo's
500 tokens) the three-digit numbers and the rarer inflected words are split into several pieces, so
token and whole-word masking differ.

    python -m workflow_scripts.demo.make_corpus --out demo_data/corpus
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.errors import run_main
from workflow_scripts.demo.common import run_generator

SPLIT_SIZES = {"train": 4000, "validation": 400, "test": 400}
# singular -> (plural, verb with it, verb with they, food, place)
ANIMALS = {
    "cat": ("cats", "drinks", "drink", "milk", "kitchen"),
    "dog": ("dogs", "chews", "chew", "bones", "garden"),
    "cow": ("cows", "eats", "eat", "grass", "field"),
    "bird": ("birds", "pecks", "peck", "seeds", "tree"),
    "fish": ("fish", "nibbles", "nibble", "algae", "pond"),
    "horse": ("horses", "munches", "munch", "hay", "stable"),
    "rabbit": ("rabbits", "gnaws", "gnaw", "carrots", "burrow"),
    "squirrel": ("squirrels", "cracks", "crack", "acorns", "forest"),
}
CAPITALS = {
    "france": "paris", "italy": "rome", "spain": "madrid", "japan": "tokyo", "egypt": "cairo",
    "peru": "lima", "kenya": "nairobi", "canada": "ottawa", "norway": "oslo", "greece": "athens",
    "austria": "vienna", "portugal": "lisbon",
}
NAMES = ["anna", "ben", "clara", "david", "emma", "felix", "grace", "henry", "bartholomew", "wilhelmina",
         "maximilian", "ottoline", "cornelius", "philippa", "leopold", "gwendolyn"]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
OBJECTS = ["bicycle", "umbrella", "kite", "lantern", "backpack", "teapot", "guitar", "notebook", "scarf", "boat"]
ADJECTIVES = ["small", "old", "clever", "sleepy", "happy", "brave", "quiet", "curious"]
TIMES = ["morning", "noon", "evening", "midnight", "sunrise", "sunset"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december"]


def fact(rng: random.Random) -> str:
    """Animal -> verb, food, place; number agreement between noun, verb and pronoun."""
    animal = rng.choice(sorted(ANIMALS))
    plural, verb_one, verb_many, food, place = ANIMALS[animal]
    day, time = rng.choice(DAYS), rng.choice(TIMES)
    if rng.random() < 0.5:
        return f"on {day} the {animal} {verb_one} {food} in the {place} and then it sleeps until {time}"
    return f"on {day} the {plural} {verb_many} {food} in the {place} and then they sleep until {time}"


def possession(rng: random.Random) -> str:
    """The owner, colour and object are named twice in the line."""
    name, colour, thing = rng.choice(NAMES), rng.choice(COLOURS), rng.choice(OBJECTS)
    return f"{name} has a {colour} {thing} and every {rng.choice(DAYS)} {name} cleans the {colour} {thing}"


def counting(rng: random.Random) -> str:
    """Numbers in order: each follows from its neighbours (three-digit ones are several pieces)."""
    start = rng.randint(10, 240)
    numbers = " ".join(str(start + k) for k in range(5))
    return f"{rng.choice(NAMES)} counts from {start} to {start + 4} like this {numbers}"


def week(rng: random.Random) -> str:
    """Days of the week in order, each named twice."""
    k = rng.randrange(len(DAYS))
    first, second, third = (DAYS[(k + i) % len(DAYS)] for i in range(3))
    listener = f"the {rng.choice(ADJECTIVES)} {rng.choice(sorted(ANIMALS))}"
    return f"after {first} comes {second} and after {second} comes {third} said {rng.choice(NAMES)} to {listener}"


def capital(rng: random.Random) -> str:
    """Country -> capital; the person and the city are named twice."""
    country = rng.choice(sorted(CAPITALS))
    name, city = rng.choice(NAMES), CAPITALS[country]
    return f"{name} lives in {city} the capital of {country} and every {rng.choice(MONTHS)} {name} walks around {city}"


def story(rng: random.Random) -> str:
    """A set phrase, then an animal's fixed place."""
    animal = rng.choice(sorted(ANIMALS))
    place = ANIMALS[animal][4]
    kind = f"{rng.choice(ADJECTIVES)} {rng.choice(COLOURS)} {animal}"
    return f"once upon a time there was a {kind} called {rng.choice(NAMES)} who lived in the {place}"


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (fact, possession, counting, week, capital, story)


def build(seed: int = 0) -> dict[str, list[str]]:
    """Split name -> lines (one random stream per split, so resizing validation or test leaves the others).

    Validation and test lines never repeat a train line: normalise's contamination check refuses
    such splits, and a held-out line then measures the rules learnt, not lines memorised.
    """
    splits: dict[str, list[str]] = {}
    for offset, (split, size) in enumerate(SPLIT_SIZES.items()):
        rng = random.Random(seed * 1000 + offset)
        seen = set(splits.get("train", ()))
        lines: list[str] = []
        while len(lines) < size:
            line = rng.choice(TEMPLATES)(rng)
            if line not in seen:
                lines.append(line)
        splits[split] = lines
    return splits


def write(out_dir: Path, seed: int = 0) -> None:
    for split, lines in build(seed).items():
        with atomic_path(out_dir / f"{split}.txt") as path:
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    return run_generator(argv, __doc__.splitlines()[0], "Directory to write train/validation/test.txt into.", write)


if __name__ == "__main__":
    run_main(main)
