"""Dataset mixtures: one training set drawn from several pre-tokenised datasets in fixed proportions.

LLaMA-Factory's ``interleave_probs`` and ``datasets.interleave_datasets`` sample each row's source at
random, so the share a run saw drifts with the seed and the stopping rule. Here the counts are decided
first (largest remainder of proportion x rows) and only which rows, and their order, are drawn, from the
mixture's own seed: every variant and experiment seed trains on the same mixed rows, and the report says
how many came from each dataset and how often a small one was repeated.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.section_settings import MixtureSettings

META_NAME = "tokenise_meta.json"
# Keys of tokenise_meta.json that describe one dataset's rows, not how they were tokenised.
PER_DATASET_KEYS = ("input_fingerprint", "cache_key", "report")
# mixtures.<name>.max_passes when absent: how often a component's rows may each be drawn (a small dataset
# given a large share is repeated; a thousand repetitions is a typo in rows or weights, not a plan).
MAX_PASSES = 10


def proportions(sizes: Mapping[str, int], weights: Mapping[str, float] | None = None,
                temperature: float | None = None) -> dict[str, float]:
    """Each component's share of the mixture: normalised weights, else sizes^(1/T) normalised (T 1: by size)."""
    if weights is not None:
        raw = {name: float(weights[name]) for name in sizes}
    else:
        power = 1.0 / (temperature or 1.0)
        raw = {name: float(size) ** power for name, size in sizes.items()}
    total = sum(raw.values())
    return {name: value / total for name, value in raw.items()}


def counts(shares: Mapping[str, float], rows: int) -> dict[str, int]:
    """Rows per component summing exactly to ``rows``: floors, then the largest remainders (ties by order)."""
    exact = {name: share * rows for name, share in shares.items()}
    floors = {name: math.floor(value) for name, value in exact.items()}
    left = rows - sum(floors.values())
    by_remainder = sorted(exact, key=lambda name: (-(exact[name] - floors[name]), list(exact).index(name)))
    for name in by_remainder[:left]:
        floors[name] += 1
    return floors


def draw(size: int, wanted: int, rng: np.random.Generator) -> np.ndarray:
    """``wanted`` row indices of a ``size``-row split: whole shuffled passes, then part of one more, so no
    row is repeated before every row has been used once."""
    passes = [rng.permutation(size) for _ in range(-(-wanted // size))]
    return np.concatenate(passes)[:wanted] if passes else np.zeros(0, dtype=np.int64)


@dataclass
class Plan:
    """Which rows of which component, in training order."""
    sources: np.ndarray  # component position of each mixed row
    rows: np.ndarray  # row index inside that component
    counts: dict[str, int]
    shares: dict[str, float]


def plan(sizes: Mapping[str, int], settings: MixtureSettings) -> Plan:
    """The mixed train split's rows for the mixture ``settings`` (weights/temperature, rows, seed)."""
    shares = proportions(sizes, settings.weights, settings.temperature)
    total = settings.rows or sum(sizes.values())
    per_component = counts(shares, total)
    rng = np.random.default_rng(settings.seed)
    sources, rows = [], []
    for position, (name, size) in enumerate(sizes.items()):
        picked = draw(size, per_component[name], rng)
        sources.append(np.full(len(picked), position, dtype=np.int64))
        rows.append(picked.astype(np.int64))
    order = rng.permutation(total)
    return Plan(np.concatenate(sources)[order], np.concatenate(rows)[order], per_component, shares)


def check_passes(order: Plan, sizes: Mapping[str, int], settings: MixtureSettings, mixture: str) -> None:
    """Refuse a mixture that repeats a component's rows more than ``max_passes`` times (default
    MAX_PASSES): most likely a ``rows`` or a weight far off, not a wish to see each row ~1000 times."""
    limit = settings.max_passes or MAX_PASSES
    for name, size in sizes.items():
        if size and order.counts[name] > limit * size:
            key = f"mixtures.{mixture}.rows" if settings.rows else f"mixtures.{mixture}.weights"
            raise ConfigError(key, f"draws {order.counts[name]} rows from '{name}', whose train split has {size}: "
                              f"each row would be repeated about {order.counts[name] / size:.0f} times, more than "
                              f"max_passes ({limit}); lower rows or '{name}''s weight, or raise "
                              f"mixtures.{mixture}.max_passes if that much repetition is meant")


def read_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory, META_NAME)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkflowError(f"{path}: not found; is {directory} pretokenise output?") from None
    except json.JSONDecodeError as error:
        raise WorkflowError(f"{path}: not valid JSON at line {error.lineno}: {error.msg}") from None


def mixed_meta(metas: Mapping[str, Mapping[str, Any]], mixture: str) -> dict[str, Any]:
    """The components' shared tokenisation (task, tokenizer, templates, length, task settings such as the
    label set), which must agree: one model trains on all of them."""
    names = list(metas)
    first = metas[names[0]]
    for name in names[1:]:
        for key in sorted(set(first) | set(metas[name])):
            if key in PER_DATASET_KEYS:
                continue
            if first.get(key) != metas[name].get(key):
                raise ConfigError(f"mixtures.{mixture}.datasets",
                                  f"'{names[0]}' and '{name}' were tokenised with different {key} "
                                  f"({_short(first.get(key))} vs {_short(metas[name].get(key))}); one model "
                                  "trains on a mixture, so its datasets must agree (e.g. the same label set)")
    return {key: value for key, value in first.items() if key not in PER_DATASET_KEYS}


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def mix_split(split: str, datasets: Sequence[Any], names: Sequence[str], order: Plan | None, work: Path):
    """One split of the mixture: rows drawn by ``order`` (train), or every row of each component in turn
    (validation, held out whole). Ids are prefixed with their dataset, so they stay unique. ``work`` takes
    the intermediate Arrow files (never the components' own directories: they are another rule's output)."""
    from datasets import concatenate_datasets

    parts = []
    for name, dataset in zip(names, datasets):
        cache = Path(work, f"{split}-{name}.arrow")  # datasets reuses an existing cache file: one name each
        parts.append(dataset.map(lambda batch, name=name: {"id": [f"{name}/{i}" for i in batch["id"]]},
                                 batched=True, cache_file_name=str(cache)))
    if order is None:
        return concatenate_datasets(parts)
    # One index into the concatenation per mixed row: component offset + row.
    offsets = np.cumsum([0] + [len(part) for part in parts[:-1]])
    return concatenate_datasets(parts).select(offsets[order.sources] + order.rows)
