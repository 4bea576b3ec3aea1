"""``smatchpp``: optimal Smatch, a thin wrapper over the ``smatchpp`` package (Opitz, "SMATCH++: Standardized
and Extended Evaluation of Semantic Graphs", Findings of EACL 2023; https://github.com/flipz357/smatchpp).

The hill-climbing ``smatch`` scorer can miss the best variable alignment (its score then depends on the
restarts); Smatch++ finds it with an integer linear program. Each pair is scored exactly as the package's
own command line does with

    python -m smatchpp -a <predictions> -b <gold> -solver ilp -graph_type amr -score_type micro

(PENMAN reader, AMR standardisation, ILP alignment, the ID triple matcher). A pair gives the package's match
statistic ``[a, b, c, d]``: triples of the prediction found in the gold, of the gold found in the
prediction, and the sizes of the prediction and of the gold. The corpus score is the package's micro F1
(``eval_statistics.ResultPrinter._aggr_wrapper``): the statistics summed over examples,
P = sum(a) / sum(c), R = sum(b) / sum(d), F1 = 2PR / (P + R), as a fraction (the package prints percent);
0 where that is undefined. One pair's score is the package's ``f1_score`` of its own statistic. A
prediction the reader cannot parse counts ``[0, 0, 0, d]`` (recall lost, as ``smatch`` does).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Sequence

import numpy as np

from workflow_scripts.core.errors import WorkflowError

COUNTS = 4  # a, b, c, d: see the module docstring


@functools.lru_cache(maxsize=1)
def _measure():
    """The pipeline the package's ``__main__`` builds for ``-solver ilp -graph_type amr``."""
    try:
        from smatchpp import align, model_factory, preprocess, score, solvers
        from smatchpp.bindings import Smatchpp
    except ModuleNotFoundError as error:
        raise WorkflowError(f"metric smatchpp needs the smatchpp package ({error.name} is missing): "
                            "pip install smatchpp, or use metric: smatch") from None
    reader = model_factory.GraphReaderFactory.get_reader("penman")
    standardizer = model_factory.StandardizerFactory.get_standardizer("amr")
    matcher = score.IDTripleMatcher()
    solver = solvers.get_solver("ilp")
    return Smatchpp(graph_reader=reader, graph_standardizer=standardizer,
                    graph_pair_preparer=preprocess.BasicGraphPairPreparer(lossless_graph_compression=False),
                    triplematcher=matcher, alignmentsolver=solver, graph_aligner=align.GraphAligner(matcher, solver),
                    graph_scorer=score.TripleScorer(triplematcher=matcher), score_dimension="main")


@contextlib.contextmanager
def _quiet():
    """The package logs each pair on the ``__main__`` logger; an evaluation job's log needs none of it."""
    logger = logging.getLogger("__main__")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def readable(graph: str) -> bool:
    """Whether the package's PENMAN reader (and the AMR standardiser) can read ``graph``."""
    measure = _measure()
    with _quiet():
        try:
            triples = measure.graph_standardizer.standardize(measure.graph_reader.string2graph(graph))
        except Exception:  # the reader raises assorted errors on malformed text
            return False
    return bool(triples)


def pair_counts(prediction: str | None, gold: str) -> tuple[int, int, int, int]:
    """The package's match statistic of one (prediction, gold) pair under optimal alignment."""
    if not readable(gold):
        raise WorkflowError(f"gold graph is not valid PENMAN for smatchpp: {gold[:80]!r}")
    if prediction is None or not prediction.strip() or not readable(prediction):
        with _quiet():  # the gold's size as the package counts it: the gold scored against itself
            match, _, _ = _measure().process_pair(gold, gold)
        return 0, 0, 0, int(round(float(match["main"][3])))
    with _quiet():
        match, _, _ = _measure().process_pair(prediction, gold)
    a, b, c, d = (int(round(float(value))) for value in match["main"])
    return a, b, c, d


def micro_f1(sums) -> np.ndarray | float:
    """The package's micro F1 from summed statistics (last axis: a, b, c, d); 0 where undefined. Works on
    the bootstrap's arrays of resampled sums and on one corpus's sums."""
    a, b, c, d = np.moveaxis(np.asarray(sums, dtype=float), -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision, recall = a / c, b / d
        f1 = 2 * precision * recall / (precision + recall)
    return np.where((c > 0) & (d > 0) & (a > 0) & (b > 0), f1, 0.0)


def pair_f1(counts: Sequence[int]) -> float:
    """The package's ``eval_statistics.f1_score`` of one pair (two empty graphs score 1, as there)."""
    if sum(counts) == 0:
        return 1.0
    return float(micro_f1(counts))
