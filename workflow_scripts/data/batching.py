"""Batches for training: length-grouped global batches that depend only on the seed and the effective batch.

Step ``s`` always trains on the same ``effective_batch`` rows, whatever the number of processes: the
global batch is sorted by length and cut into ``effective_batch / micro_batch`` micro-batches, and
rank ``r`` of ``W`` takes micro-batches ``r, r+W, r+2W, ...``. So a 1-process and a 2-process run
compute the same micro-batches, a resumed run restarts exactly at its step, and similar lengths share
a micro-batch (little padding).

With a token budget (``training.micro_batch_tokens``, :meth:`GlobalBatchPlan.budget_micro_batches`) the
global batch, sorted by length, is dealt to the ranks example by example (rank ``r`` takes positions
``r, r+W, ...``), and each rank's share is cut, longest first, into micro-batches of at most the budget's
token slots (examples x their longest), as few as fit: short examples go many to a micro-batch, long
ones few. Every rank runs the count of the share that needs most, a function of the global batch alone,
so micro-steps pair up across ranks (FSDP gathers the parameters at every forward; a rank running fewer
would leave the others waiting). The loss is normalised by the step's target tokens (train.run_steps), so
how examples are grouped does not change it; what does change with the grouping, and so with the number
of processes, is what is drawn per micro-batch (LoRA dropout masks, masked LM's masks).

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
        self._epochs: dict[int, list[np.ndarray]] = {}  # the last two drawn: the loader may run an epoch ahead

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
        if epoch not in self._epochs:
            self._epochs = {e: b for e, b in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = self._batches_for_epoch(epoch)
        return self._epochs[epoch][position]

    def micro_batches(self, step: int, micro_batch: int) -> list[np.ndarray]:
        """The global batch cut into micro-batches of similar length (sorted within the batch)."""
        batch = self.global_batch(step)
        batch = batch[np.argsort(-self.lengths[batch], kind="stable")]
        return [batch[i:i + micro_batch] for i in range(0, len(batch), micro_batch)]

    def budget_micro_batches(self, step: int, world_size: int, token_budget: int) -> list[list[np.ndarray]]:
        """Per rank, its share of global batch ``step`` cut into micro-batches of at most ``token_budget``
        slots (examples x the longest of them: the padded tensor's size, which packing only shrinks);
        every rank gets the same number of micro-batches (see the module docstring)."""
        batch = self.global_batch(step)
        batch = batch[np.argsort(-self.lengths[batch], kind="stable")]
        shares = [batch[rank::world_size] for rank in range(world_size)]
        too_long = self.lengths[batch[0]]
        if too_long > token_budget:
            raise WorkflowError(f"row {int(batch[0])} of the training split has {too_long} tokens, more than "
                                f"training.micro_batch_tokens ({token_budget}); raise the budget to at least "
                                "training.max_length and re-run pretokenise with that max_length")
        cuts = [fewest_cuts(self.lengths[share], token_budget) for share in shares]
        count = max(len(c) for c in cuts)
        return [[share[start:end] for start, end in split_to(c, count)] for share, c in zip(shares, cuts)]


def fewest_cuts(lengths: np.ndarray, token_budget: int) -> list[tuple[int, int]]:
    """(start, end) of the fewest contiguous runs of ``lengths`` (sorted longest first) whose size x first
    length fits the budget: each run, from the longest, takes as many as fit."""
    cuts, start = [], 0
    while start < len(lengths):
        end = start + max(1, token_budget // max(1, int(lengths[start])))
        cuts.append((start, min(end, len(lengths))))
        start = end
    return cuts


def split_to(cuts: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``cuts`` split further until there are ``count``: the costliest run that holds 2+ examples (the
    first on ties) is halved, so the budget still holds and the micro-batches even out."""
    cuts = list(cuts)
    while len(cuts) < count:
        k = max((i for i, (a, b) in enumerate(cuts) if b - a > 1), key=lambda i: (cuts[i][1] - cuts[i][0], -i))
        a, b = cuts[k]
        middle = a + (b - a + 1) // 2
        cuts[k:k + 1] = [(a, middle), (middle, b)]
    return cuts


class RankBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches for steps ``start_step .. max_steps-1``, accumulation order.

    ``token_budget`` (``training.micro_batch_tokens``): micro-batches filled to that many token slots
    (:meth:`GlobalBatchPlan.budget_micro_batches`) in place of ``micro_batch`` examples each; how many a
    step has is :meth:`micro_steps`, the same on every rank.
    """

    def __init__(self, plan: GlobalBatchPlan, micro_batch: int, rank: int, world_size: int,
                 start_step: int, max_steps: int, token_budget: int | None = None):
        self.token_budget = token_budget
        if token_budget is not None:
            if plan.effective_batch % world_size:
                raise WorkflowError(f"training.effective_batch {plan.effective_batch} is not a multiple of the "
                                    f"{world_size} processes")
        elif plan.effective_batch % (micro_batch * world_size):
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
        self.accumulation = None if token_budget else plan.effective_batch // (micro_batch * world_size)

    def micro_steps(self, step: int) -> int:
        """Micro-batches per rank in optimizer step ``step`` (fixed without a token budget)."""
        if self.token_budget is None:
            return self.accumulation
        return len(self.plan.budget_micro_batches(step, self.world_size, self.token_budget)[self.rank])

    def __len__(self) -> int:
        return sum(self.micro_steps(step) for step in range(self.start_step, self.max_steps))

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            epoch = self.plan.epoch_of(step)
            if self.token_budget is not None:
                mine = self.plan.budget_micro_batches(step, self.world_size, self.token_budget)[self.rank]
            else:
                micro = self.plan.micro_batches(step, self.micro_batch)
                mine = micro[self.rank::self.world_size]
            for indices in mine:
                yield PlannedMicroBatch(indices.tolist(), epoch)


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
