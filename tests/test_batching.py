"""Length-grouped global batches: independent of the process count, resumable, low padding, small pickles."""
import pickle

import numpy as np
import pytest

from workflow_scripts.data import batching
from workflow_scripts.core.errors import WorkflowError


def _lengths(n=512, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(16 + rng.pareto(1.2, n) * 30, 512).astype(int)  # long-tailed, 16..512


def _rank_steps(plan, micro, world, steps):
    per_rank = [list(batching.RankBatchSampler(plan, micro, r, world, 0, steps)) for r in range(world)]
    return per_rank


def test_global_batches_do_not_depend_on_process_count():
    lengths = _lengths()
    plan = batching.GlobalBatchPlan(lengths, effective_batch=16, seed=3)
    one = _rank_steps(plan, 4, 1, 5)[0]
    two = _rank_steps(batching.GlobalBatchPlan(lengths, 16, 3), 4, 2, 5)
    # 4 micro-batches per step: 1 process does them all, 2 processes take 2 each (interleaved).
    for step in range(5):
        single = one[step * 4:(step + 1) * 4]
        rank0, rank1 = two[0][step * 2:(step + 1) * 2], two[1][step * 2:(step + 1) * 2]
        assert [single[0], single[2]] == rank0 and [single[1], single[3]] == rank1
        assert sorted(sum(single, [])) == sorted(plan.global_batch(step).tolist())


def test_order_depends_on_seed_and_resumes_at_any_step():
    lengths = _lengths()
    a = batching.GlobalBatchPlan(lengths, 16, seed=1)
    b = batching.GlobalBatchPlan(lengths, 16, seed=2)
    assert a.global_batch(0).tolist() != b.global_batch(0).tolist()
    full = list(batching.RankBatchSampler(a, 8, 0, 1, 0, 40))
    resumed = list(batching.RankBatchSampler(batching.GlobalBatchPlan(lengths, 16, seed=1), 8, 0, 1, 25, 40))
    assert resumed == full[25 * 2:]
    # 40 steps of 16 cover more than one epoch of 512 rows: every row appears once per epoch.
    epoch = sorted(i for step in range(32) for i in a.global_batch(step).tolist())
    assert epoch == list(range(512))


def test_length_grouping_cuts_padding():
    lengths = _lengths(2048)

    def share(group):
        plan = batching.GlobalBatchPlan(lengths, 32, seed=0, group_by_length=group)
        padded = total = 0
        for step in range(plan.batches_per_epoch):
            for micro in plan.micro_batches(step, 8):
                width = lengths[micro].max()
                padded += width * len(micro) - lengths[micro].sum()
                total += width * len(micro)
        return padded / total

    grouped, random_order = share(True), share(False)
    assert grouped < 0.05 < random_order


def test_too_few_rows_for_one_batch():
    with pytest.raises(WorkflowError, match="fewer than training.effective_batch"):
        batching.GlobalBatchPlan(np.array([3, 4, 5]), effective_batch=16, seed=0)


def test_dataset_pickles_only_its_path(tiny_tokenised_dir):
    dataset = batching.TokenisedSplit(tiny_tokenised_dir)
    rows = dataset.__getitems__([0, 5])
    payload = pickle.dumps(dataset)
    assert len(payload) < 1000, len(payload)  # seed: 1.5 GB pickled into each worker
    clone = pickle.loads(payload)
    assert clone._table is None and len(clone) == len(dataset)
    assert clone.__getitems__([0, 5]) == rows


def test_loader_with_worker_processes(tiny_tokenised_dir):
    dataset = batching.TokenisedSplit(tiny_tokenised_dir)
    plan = batching.GlobalBatchPlan(dataset.lengths(), 8, seed=0)
    sampler = batching.RankBatchSampler(plan, 4, 0, 1, 0, 3)
    collator = batching.PaddingCollator(pad_token_id=0, vocab_size=128)
    in_process = [b["row_ids"] for b in batching.build_loader(dataset, sampler, collator, 0, False)]
    workers = [b["row_ids"] for b in batching.build_loader(dataset, sampler, collator, 2, False)]
    assert in_process == workers and len(workers) == 6


def test_collator_pads_and_indexes_targets():
    collate = batching.PaddingCollator(pad_token_id=0, vocab_size=50)
    batch = collate([
        {"id": "a", "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"id": "b", "input_ids": [9, 10], "labels": [-100, 10]},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # position t predicts t+1: row a predicts 7 at position 1 and 8 at 2; row b predicts 10 at position 0.
    assert batch["target_index"].tolist() == [1, 2, 3]
    assert batch["target_ids"].tolist() == [7, 8, 10]
    assert batch["target_tokens"] == 3 and batch["real_tokens"] == 6 and batch["padded_tokens"] == 2
    assert batching.padding_share([batch]) == pytest.approx(0.25)


@pytest.mark.parametrize("row, message", [
    ({"id": "r1", "input_ids": [5, 99], "labels": [-100, 99]}, "row 'r1': token id 99 is outside"),
    ({"id": "r2", "input_ids": [5, 6], "labels": [-100, -100]}, "every label is masked"),
    ({"id": "r3", "input_ids": [], "labels": []}, "empty batch"),
    ({"id": "r4", "input_ids": [5, 6], "labels": [6]}, "row 'r4': input_ids has 2 tokens but labels has 1"),
])
def test_collator_rejects_bad_rows(row, message):
    with pytest.raises(WorkflowError, match=message):
        batching.PaddingCollator(pad_token_id=0, vocab_size=50)([row])


def test_loader_workers_survive_stop_signals(tiny_tokenised_dir):
    """SLURM signals every process of a job; a worker must not die before the main process checkpoints."""
    import os
    import signal

    dataset = batching.TokenisedSplit(tiny_tokenised_dir)
    sampler = batching.RankBatchSampler(batching.GlobalBatchPlan(dataset.lengths(), 8, seed=0), 4, 0, 1, 0, 6)
    loader = batching.build_loader(dataset, sampler, batching.PaddingCollator(0, 128), 1, False)
    iterator = iter(loader)
    next(iterator)
    for worker in iterator._workers:
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGUSR1)
    assert len([next(iterator)] + list(iterator)) == 11


# --- training.micro_batch_tokens: micro-batches filled to a token budget -------------------------------------
def _slots(lengths, micro) -> int:
    return len(micro) * int(lengths[micro].max())  # the padded tensor's size; packing only shrinks it


@pytest.mark.parametrize("world", [1, 2, 4])
def test_budget_micro_batches_fit_cover_the_batch_once_and_run_in_lockstep(world):
    lengths = _lengths()
    budget = 1024
    plan = batching.GlobalBatchPlan(lengths, effective_batch=32, seed=5)
    seen, counts = [], set()
    for step in range(plan.batches_per_epoch):
        per_rank = plan.budget_micro_batches(step, world, budget)
        assert len(per_rank) == world and len({len(m) for m in per_rank}) == 1  # the same count on every rank
        fewest = max(len(batching.fewest_cuts(np.sort(lengths[np.concatenate(m)])[::-1], budget)) for m in per_rank)
        assert len(per_rank[0]) == fewest  # no more micro-steps than the neediest rank's share needs
        counts.add(len(per_rank[0]))
        for micro in (m for rank in per_rank for m in rank):
            assert len(micro) and _slots(lengths, micro) <= budget
        shares = [np.concatenate(m) for m in per_rank]
        assert len({len(s) for s in shares}) == 1  # the effective batch split evenly over ranks
        step_rows = np.concatenate(shares)
        assert sorted(step_rows.tolist()) == sorted(plan.global_batch(step).tolist())
        seen.extend(step_rows.tolist())
    assert len(seen) == len(set(seen)) == plan.batches_per_epoch * 32  # every example once per epoch
    assert len(counts) > 1  # long-tailed lengths: the count follows the step's lengths


def test_ranks_run_the_same_micro_steps_when_their_shares_need_different_counts():
    """Rank 0 gets the one long example, rank 1 only short ones: alone, rank 0's share needs 2 micro-batches
    of 100 slots and rank 1's one; DDP pairs micro-steps, so both run 2."""
    lengths = np.array([20, 20, 100, 20, 20, 20, 20, 20])
    plan = batching.GlobalBatchPlan(lengths, effective_batch=8, seed=0, group_by_length=False)
    per_rank = plan.budget_micro_batches(0, 2, 100)
    shares = [sorted(lengths[np.concatenate(m)].tolist()) for m in per_rank]
    assert shares == [[20, 20, 20, 100], [20, 20, 20, 20]]
    assert [len(batching.fewest_cuts(np.sort(s)[::-1], 100)) for s in shares] == [2, 1]
    assert [len(m) for m in per_rank] == [2, 2]
    assert all(_slots(lengths, micro) <= 100 for rank in per_rank for micro in rank)
    samplers = [batching.RankBatchSampler(plan, 1, r, 2, 0, 1, token_budget=100) for r in range(2)]
    assert [s.micro_steps(0) for s in samplers] == [2, 2] and [len(list(s)) for s in samplers] == [2, 2]


def test_budget_plan_is_deterministic_and_resumes_at_any_step():
    lengths = _lengths()
    full = list(batching.RankBatchSampler(batching.GlobalBatchPlan(lengths, 16, seed=1), 4, 1, 2, 0, 70,
                                          token_budget=512))
    resumed = batching.RankBatchSampler(batching.GlobalBatchPlan(lengths, 16, seed=1), 4, 1, 2, 45, 70,
                                        token_budget=512)
    skipped = sum(resumed.micro_steps(step) for step in range(0, 45))
    assert [list(m) for m in resumed] == [list(m) for m in full[skipped:]]  # epoch 2 included (31 steps an epoch)
    again = list(batching.RankBatchSampler(batching.GlobalBatchPlan(lengths, 16, seed=1), 4, 1, 2, 0, 70,
                                           token_budget=512))
    assert [list(m) for m in again] == [list(m) for m in full] and [m.epoch for m in again] == [m.epoch for m in full]
    assert len(full) == sum(resumed.micro_steps(step) for step in range(70))


def test_a_budget_fills_micro_batches_fewer_than_fixed_ones():
    """Short rows go many to a micro-batch: at micro_batch x max_length slots (the fixed shape's memory
    bound), a step of short rows runs in one micro-step where micro_batch 4 takes 4."""
    lengths = _lengths()
    plan = batching.GlobalBatchPlan(lengths, 16, seed=2)
    fixed = len(plan.micro_batches(0, 4)) * plan.batches_per_epoch
    budget = sum(len(plan.budget_micro_batches(step, 1, 4 * 512)[0]) for step in range(plan.batches_per_epoch))
    assert budget < fixed / 2


def test_an_example_longer_than_the_budget_is_refused():
    plan = batching.GlobalBatchPlan(np.array([70, 10, 10, 10]), 4, seed=0)
    with pytest.raises(WorkflowError, match=r"has 70 tokens, more than training.micro_batch_tokens \(64\)"):
        plan.budget_micro_batches(0, 1, 64)
