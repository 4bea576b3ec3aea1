"""Per-step training records: a JSONL file (resumable), TensorBoard when installed, an experiment tracker
when configured (trackers.py: MLflow), and console lines.

A progress bar only on a terminal; batch logs (Snakemake, SLURM) get one plain line every
``log_every`` steps instead of carriage-return noise.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from workflow_scripts.core.atomic_output import write_jsonl


class TrainingLog:
    def __init__(self, running_path: str | Path, resume_step: int, max_steps: int, log_every: int,
                 tensorboard_dir: str | Path | None = None, enabled: bool = True, tracker=None):
        self.enabled = enabled
        self._tracker = tracker
        self.running_path = Path(running_path)
        self.log_every = log_every
        self.max_steps = max_steps
        self.records: list[dict] = []
        if not enabled:
            return
        if self.running_path.exists():
            # Keep the records of steps the resumed checkpoint covers; later ones will be redone.
            for line in self.running_path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    if record["step"] <= resume_step:
                        self.records.append(record)
        self.running_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.running_path, "w") as handle:
            for record in self.records:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._handle = open(self.running_path, "a")
        if tracker is not None:  # steps the resumed checkpoint covers that the tracker may have missed
            tracker.catch_up(self.records)
        self._writer = None
        if tensorboard_dir is not None:
            if resume_step == 0 and Path(tensorboard_dir).is_dir():
                shutil.rmtree(tensorboard_dir)  # events of an earlier, discarded run would mix in
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self._writer = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=resume_step + 1)
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, initial=resume_step, unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self._handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._handle.flush()
        step = record["step"]
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"train/{key}", value, step)
        if self._tracker is not None:
            self._tracker.log_step(record)
        line = (f"step {step}/{self.max_steps} loss {record['loss']:.4f} lr {record['learning_rate']:.3g} "
                f"grad_norm {record['grad_norm']:.3g} tokens/s {record['tokens_per_second']:.0f} "
                f"padding {record['padding_share']:.1%}"
                + (f" validation_loss {record['validation_loss']:.4f}" if "validation_loss" in record else "")
                + "".join(f" {key} {value:.4f}" for key, value in sorted(record.items())
                          if key.startswith("validation_metric")))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(line.split(" ", 2)[2])
        elif step % self.log_every == 0 or step == self.max_steps or "validation_loss" in record:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)
            sys.stdout.flush()

    def finish(self, out_path: str | Path) -> None:
        """Publish the whole log atomically at its declared output path."""
        if self.enabled:
            write_jsonl(out_path, self.records)

    def close(self) -> None:
        if not self.enabled:
            return
        self._handle.close()
        if self._writer is not None:
            self._writer.close()
        if self._bar is not None:
            self._bar.close()


def validation_metric_curves(records) -> dict[str, tuple[list[int], list[float]]]:
    """train_log field (``validation_metric``, ``validation_metric/<dataset>``) -> (steps, values): the task's
    metric at each validation point, for the loss plot's second axis."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("validation_metric") and isinstance(value, (int, float)):
                steps, values = curves.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    return curves
