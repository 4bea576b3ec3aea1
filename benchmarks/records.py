"""One result record per benchmark: what ours did, what the reference did, their ratio, and the context.

Every figure in a record is a median over repeated measurements whose samples are kept beside it,
and every ratio is computed here from those medians, never typed in.
"""
from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from workflow_scripts.core.run_manifest import PACKAGES, package_versions

EXTRA_PACKAGES = ("psutil", "numpy", "pyarrow")


@dataclass
class Series:
    """Repeated measurements of one thing, e.g. our train stage's tokens/s over three runs."""

    label: str
    samples: list[float]
    units: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples = [float(x) for x in self.samples]

    @property
    def median(self) -> float:
        if not self.samples:
            raise ValueError(f"{self.label}: no samples measured")
        return float(statistics.median(self.samples))

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "median": self.median, "samples": list(self.samples),
                "units": self.units, "details": self.details}


@dataclass
class Goal:
    """A target from issue 6, checked against a measured value."""

    description: str
    value: float
    target: float
    higher_is_better: bool
    why: str | None = None  # the measured cause, when the goal is not met

    def __post_init__(self) -> None:
        self.value, self.target = float(self.value), float(self.target)  # numpy scalars are not JSON

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    @property
    def shortfall(self) -> str | None:
        """How far from the target, as a factor, when not met."""
        if self.met:
            return None
        if self.higher_is_better:
            return f"{self.value:.3g} against {self.target:.3g}: {self.target / self.value:.2f}x short" if self.value else "zero"
        return f"{self.value:.3g} against {self.target:.3g}: {self.value / self.target:.2f}x over"

    def as_dict(self) -> dict[str, Any]:
        return {"description": self.description, "value": self.value, "target": self.target,
                "higher_is_better": self.higher_is_better, "met": self.met, "shortfall": self.shortfall,
                "why": None if self.met else self.why}


def ratio(ours: Series, reference: Series) -> float:
    """ours / reference, from the medians of the samples actually measured."""
    return ours.median / reference.median


def record(
    name: str,
    title: str,
    ours: Series | None,
    reference: Series | None,
    higher_is_better: bool,
    goals: Sequence[Goal] = (),
    others: Sequence[Series] = (),
    setup: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    status: str = "measured",
    message: str | None = None,
) -> dict[str, Any]:
    """A benchmark's record for results.json."""
    repetitions = max((len(s.samples) for s in (ours, reference, *others) if s is not None), default=0)
    return {
        "name": name,
        "title": title,
        "status": status,
        "message": message,
        "units": ours.units if ours else None,
        "higher_is_better": higher_is_better,
        "ours": ours.as_dict() if ours else None,
        "reference": reference.as_dict() if reference else None,
        "ratio": ratio(ours, reference) if ours and reference else None,
        "ratio_definition": "ours median / reference median",
        "others": [s.as_dict() for s in others],
        "goals": [g.as_dict() for g in goals],
        "repetitions": repetitions,
        "setup": setup or {},
        "notes": list(notes),
        "hardware": hardware(),
        "packages": packages(),
    }


def not_run(name: str, title: str, status: str, message: str, setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """A record for a benchmark that was skipped (e.g. no GPU) or could not be measured, with the reason."""
    result = record(name, title, None, None, True, setup=setup, status=status, message=message)
    return result


def packages() -> dict[str, str | None]:
    return package_versions(PACKAGES + EXTRA_PACKAGES)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware() -> dict[str, Any]:
    import psutil
    import torch

    info = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
        "cuda_devices": [],
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
