"""Comparing float32 training runs whose sums are grouped differently: 1 vs N processes, fixed vs token-budget
micro-batches, packed vs padded rows. The tolerance is derived from the computation, not from what one CPU gave.

A float32 sum of n terms taken in another order differs by at most (n - 1) u sum_i |x_i|, u = 2^-24 the unit
roundoff (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4). A training step sums at
most ``effective_batch x max_length`` token terms (its loss, and every gradient element); Adam divides each
gradient element's first moment by its second's root, so a relative error e on the gradients moves the update by
at most about 2e; and the steps add their errors up. So after ``steps`` steps two orders may differ by

    bound = 2 x steps x n x u        (relative)

on each step's loss (a sum of non-negative token losses, so sum |x_i| is the sum itself) and on each trained
tensor *as a whole*. Element by element no such bound holds: an element whose gradient sums to nearly zero
(terms cancelling, sum |x_i| >> |sum x_i|) has a large relative error in its gradient, and Adam normalises it
up to a full step; issue 36 saw 1 of 256 adapter elements 2.8e-4 off relative on another machine of the same
kind. The tensors are therefore compared by their norms: ||ours - theirs|| <= bound x ||theirs||. A real
difference between the runs (a lost micro-batch, a rank training on other rows, a wrong loss scale) moves the
loss or the tensors by orders of magnitude more than this (a step's learning-rate-sized update is ~1e-2 of a
tensor's norm here, the bound ~1e-4).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

UNIT_ROUNDOFF = 2.0 ** -24  # float32


def reordering_bound(terms_per_step: int, steps: int) -> float:
    """The relative difference two summation orders may give after ``steps`` steps of ``terms_per_step`` terms."""
    return 2 * steps * terms_per_step * UNIT_ROUNDOFF


def terms_per_step(settings) -> int:
    """The most token terms one optimizer step sums: every row of the effective batch at ``max_length``."""
    return settings.effective_batch * settings.max_length


def assert_same_curve(ours: Sequence[float], theirs: Sequence[float], settings,
                      steps: Sequence[int] | None = None) -> None:
    """Per-step sums of non-negative terms (losses, gradient norms; ``steps``: the optimizer step each value
    follows, 1, 2, ... by default) equal up to the reordering bound at each step."""
    assert len(ours) == len(theirs), (ours, theirs)
    terms = terms_per_step(settings)
    for step, a, b in zip(steps or range(1, len(theirs) + 1), ours, theirs):
        assert abs(a - b) <= reordering_bound(terms, step) * abs(b), (step, a, b, reordering_bound(terms, step))


def assert_same_tensors(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor], settings,
                        steps: int) -> None:
    """Trained tensors (adapter or model) equal, each as a whole, up to the reordering bound after ``steps``."""
    assert ours.keys() == theirs.keys()
    bound = reordering_bound(terms_per_step(settings), steps)
    for name in theirs:
        difference = float(torch.linalg.vector_norm((ours[name] - theirs[name]).double()))
        scale = float(torch.linalg.vector_norm(theirs[name].double()))
        assert difference <= bound * scale, (name, difference / max(scale, 1e-300), bound)
