"""Batches for training: length-grouped global batches that depend only on the seed and the effective batch.

Step ``s`` always trains on the same ``effective_batch`` rows, whatever the number of processes: the
global batch is sorted by length and cut into ``effective_batch / micro_batch`` micro-batches, and
rank ``r`` of ``W`` takes micro-batches ``r, r+W, r+2W, ...``. So a 1-process and a 2-process run
compute the same micro-batches, a resumed run restarts exactly at its step, and similar lengths share
a micro-batch (little padding).

The data set object handed to DataLoader workers holds only the path of the memory-mapped Arrow data
(seed: 1.5 GB of text pickled into every worker); each worker reopens it from disk.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from workflow_scripts.core.errors import WorkflowError

IGNORE_INDEX = -100
# Rows sorted together before cutting global batches: large enough to group lengths well, small
# enough that the order of examples stays well mixed (HF's LengthGroupedSampler uses 50 batches).
GROUPING_WINDOW_BATCHES = 64


def read_meta(data_dir: str | Path) -> dict:
    """``tokenise_meta.json``; it names the task the data was tokenised for, which training follows."""
    path = Path(data_dir, "tokenise_meta.json")
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkflowError(f"{path}: missing; run the pretokenise rule first") from None
    except json.JSONDecodeError as error:
        raise WorkflowError(f"{path}: not valid JSON ({error})") from None
    if "task" not in meta:
        raise WorkflowError(f"{path}: no 'task' recorded (tokenised by an older version); re-run the pretokenise rule")
    return meta


class TokenisedSplit(torch.utils.data.Dataset):
    """One split of the pre-tokenised data, opened lazily from disk (memory-mapped) in each process."""

    def __init__(self, data_dir: str | Path, split: str = "train", columns: Sequence[str] = ("labels",)):
        self.data_dir = str(data_dir)
        self.split = split
        self.columns = tuple(columns)  # the task's own columns (``tasks.stored_columns``), checked on opening
        self._table = None
        self._length = len(self.table)

    @property
    def table(self):
        if self._table is None:
            from datasets import load_from_disk

            split_dir = Path(self.data_dir, self.split)
            if not split_dir.is_dir():
                raise WorkflowError(f"{self.data_dir}: no '{self.split}' split; run the pretokenise rule first")
            dataset = load_from_disk(str(split_dir))
            missing = ({"id", "input_ids", "length"} | set(self.columns)) - set(dataset.column_names)
            if missing:
                raise WorkflowError(f"{split_dir}: missing columns {sorted(missing)}")
            self._table = dataset
        return self._table

    def __getstate__(self):
        # Only the location travels to workers; never the rows.
        return {"data_dir": self.data_dir, "split": self.split, "columns": self.columns, "_length": self._length}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._table = None

    def __len__(self) -> int:
        return self._length

    def lengths(self) -> np.ndarray:
        # Straight from the Arrow column: milliseconds for millions of rows, and one numpy buffer
        # (no per-row Python objects for forked workers to copy when refcounts change).
        return self.table.with_format("arrow")["length"].to_numpy().astype(np.int64)

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        rows = self.table[list(indices)]
        columns = [column for column in rows if column != "length"]  # the task's collator reads its own
        # A planned micro-batch tells its rows their epoch (masked LM draws a new mask each epoch with it);
        # rows fetched by plain indices (the held-out loss) carry none.
        epoch = {"epoch": indices.epoch} if isinstance(indices, PlannedMicroBatch) else {}
        return [{"index": int(i), **epoch, **{column: rows[column][k] for column in columns}}
                for k, i in enumerate(indices)]


class PlannedMicroBatch(list):
    """The row indices of one micro-batch of the plan, and the epoch they are drawn in.

    A list, so the DataLoader hands it (pickled, to workers too) to ``TokenisedSplit.__getitems__``
    unchanged; the epoch is a function of the step only, so it is the same in any process and on resume.
    """

    def __init__(self, indices: Sequence[int], epoch: int):
        super().__init__(indices)
        self.epoch = epoch


class GlobalBatchPlan:
    """Which rows form global batch ``step``: a function of (seed, effective batch, lengths) only."""

    def __init__(self, lengths: np.ndarray, effective_batch: int, seed: int, group_by_length: bool = True):
        self.lengths = np.asarray(lengths)
        self.effective_batch = effective_batch
        self.seed = seed
        self.group_by_length = group_by_length
        self.batches_per_epoch = len(self.lengths) // effective_batch
        if self.batches_per_epoch == 0:
            raise WorkflowError(
                f"the training split has {len(self.lengths)} rows, fewer than training.effective_batch "
                f"({effective_batch}); lower the effective batch or add data"
            )
        self._epoch = None
        self._epoch_batches: list[np.ndarray] = []

    def _batches_for_epoch(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        usable = self.batches_per_epoch * self.effective_batch
        order = order[:usable]  # the remainder is dropped this epoch; another epoch reshuffles
        if self.group_by_length:
            window = GROUPING_WINDOW_BATCHES * self.effective_batch
            chunks = []
            for start in range(0, usable, window):
                chunk = order[start:start + window]
                # stable sort by length (longest first) keeps the result independent of sort algorithm
                chunks.append(chunk[np.argsort(-self.lengths[chunk], kind="stable")])
            order = np.concatenate(chunks)
        batches = [order[i:i + self.effective_batch] for i in range(0, usable, self.effective_batch)]
        if self.group_by_length:
            # Groups come out longest first; shuffle their order so a step's length is not tied to time.
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def epoch_of(self, step: int) -> int:
        return step // self.batches_per_epoch

    def global_batch(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._epoch_batches = epoch, self._batches_for_epoch(epoch)
        return self._epoch_batches[position]

    def micro_batches(self, step: int, micro_batch: int) -> list[np.ndarray]:
        """The global batch cut into micro-batches of similar length (sorted within the batch)."""
        batch = self.global_batch(step)
        batch = batch[np.argsort(-self.lengths[batch], kind="stable")]
        return [batch[i:i + micro_batch] for i in range(0, len(batch), micro_batch)]


class RankBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches for steps ``start_step .. max_steps-1``, accumulation order."""

    def __init__(self, plan: GlobalBatchPlan, micro_batch: int, rank: int, world_size: int,
                 start_step: int, max_steps: int):
        if plan.effective_batch % (micro_batch * world_size):
            raise WorkflowError(
                f"training.effective_batch {plan.effective_batch} is not a multiple of micro_batch "
                f"{micro_batch} x processes {world_size}"
            )
        self.plan = plan
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.start_step = start_step
        self.max_steps = max_steps
        self.accumulation = plan.effective_batch // (micro_batch * world_size)

    def __len__(self) -> int:
        return max(0, self.max_steps - self.start_step) * self.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            micro = self.plan.micro_batches(step, self.micro_batch)
            epoch = self.plan.epoch_of(step)
            for k in range(self.rank, len(micro), self.world_size):
                yield PlannedMicroBatch(micro[k].tolist(), epoch)


class PaddingCollator:
    """Right-pads a micro-batch and precomputes, on the CPU, what the loss needs.

    ``target_index`` lists the flattened (row, position) of every predicted token, so the model
    computes logits for target tokens only and no host sync is needed to find them. Bad rows fail here,
    naming the row id, before they reach the model.
    """

    def __init__(self, pad_token_id: int, vocab_size: int):
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size

    def __call__(self, rows: list[dict]) -> dict:
        if not rows:
            raise WorkflowError("empty batch: the sampler produced a micro-batch without rows")
        width = max(len(r["input_ids"]) for r in rows)
        if width == 0:
            raise WorkflowError(f"empty batch: rows {[r['id'] for r in rows]} have no tokens")
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            n = len(row["input_ids"])
            if len(row["labels"]) != n:
                raise WorkflowError(f"row '{row['id']}': input_ids has {n} tokens but labels has {len(row['labels'])}")
            input_ids[k, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[k, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            attention_mask[k, :n] = 1
        bad = (input_ids >= self.vocab_size) | (input_ids < 0)
        if bad.any():
            k = int(bad.any(dim=1).nonzero()[0])
            raise WorkflowError(
                f"row '{rows[k]['id']}': token id {int(input_ids[k][bad[k]][0])} is outside the model's "
                f"vocabulary (size {self.vocab_size}); re-tokenise with this model's tokenizer"
            )
        # Causal LM: position t predicts token t+1.
        shifted = labels[:, 1:]
        target_mask = shifted != IGNORE_INDEX
        target_tokens = int(target_mask.sum())
        if target_tokens == 0:
            raise WorkflowError(
                f"rows {[r['id'] for r in rows]}: every label is masked (-100), so the batch teaches nothing; "
                "check the variant's target template and max_length truncation"
            )
        real_tokens = int(attention_mask.sum())
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "target_index": target_mask.reshape(-1).nonzero().squeeze(1),
            "target_ids": shifted[target_mask],
            "target_tokens": target_tokens,
            "real_tokens": real_tokens,
            "padded_tokens": input_ids.numel() - real_tokens,
            "row_ids": [r["id"] for r in rows],
        }


def padding_share(batches: Sequence[dict]) -> float:
    padded = sum(b["padded_tokens"] for b in batches)
    total = padded + sum(b["real_tokens"] for b in batches)
    return padded / total if total else 0.0


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM/SIGUSR1: SLURM signals every process of the job, and a worker
    killed by it would crash the main process before it can write its checkpoint."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def build_loader(dataset: TokenisedSplit, sampler: RankBatchSampler, collator: PaddingCollator,
                 workers: int, pin_memory: bool, seed: int = 0) -> torch.utils.data.DataLoader:
    # An own generator: creating the iterator must not draw from the global RNG, or a resumed run's
    # dropout masks would differ from an uninterrupted run's.
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=4 if workers else None,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_stop_signals if workers else None,
    )
