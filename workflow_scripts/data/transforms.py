"""Named transforms that derive extra fields (such as MTUP's auxiliary task) from a normalised row.

Each transform takes the source field's value (a string) and returns a string; a transform that
cannot handle its input raises ValueError, which normalisation reports as a rejected row.
"""
from __future__ import annotations

import re
from typing import Callable

TRANSFORMS: dict[str, Callable[[str], str]] = {}


def transform(name: str):
    """Register a function under ``name`` so configs can refer to it."""
    def register(function: Callable[[str], str]) -> Callable[[str], str]:
        TRANSFORMS[name] = function
        return function
    return register


_NUMBER = re.compile(r"^[-+]?[$]?\d[\d,]*(\.\d+)?%?$")


@transform("answer_kind")
def answer_kind(answer: str) -> str:
    """A coarse answer type ('number', 'yes/no' or 'text'): MTUP's auxiliary task for QA data."""
    text = answer.strip().lower()
    if _NUMBER.match(text):
        return "number"
    if text in {"yes", "no"}:
        return "yes/no"
    return "text"


_INSTANCE = re.compile(r"\(\s*([^\s()/:]+)\s*/\s*([^\s()]+)")
_REFERENCE = re.compile(r"(:[^\s()]+)\s+([^\s()\"]+)(?=[\s)])")


@transform("penman_skeleton")
def penman_skeleton(graph: str) -> str:
    """A PENMAN graph without variables: ``(w / want-01 :ARG0 (b / boy))`` -> ``(want-01 :ARG0 (boy))``.

    Re-entrant variable references become the concept they name, as in MTUP's Task 1.
    """
    concepts = dict(_INSTANCE.findall(graph))
    if not concepts:
        raise ValueError("no '(variable / concept)' node found: not a PENMAN graph")
    if graph.count("(") != graph.count(")"):
        raise ValueError("unbalanced parentheses")
    skeleton = _INSTANCE.sub(lambda m: f"({m.group(2)}", graph)

    def concept_for(match: re.Match) -> str:
        role, value = match.groups()
        return f"{role} ({concepts[value]})" if value in concepts else match.group(0)

    return " ".join(_REFERENCE.sub(concept_for, skeleton).split())
