"""Shared test fixtures: a tiny random Llama and a tiny pre-tokenised data set (architecture.md format).

Generic on purpose; other test files may append fixtures here.
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import pytest

# Rules run `python -m workflow_scripts...`: the Snakemake runs the tests start must find this
# interpreter's environment first, whether or not the virtual environment is activated.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
# No request from the tests to huggingface.co: the Hub client's telemetry and datasets' download counter (a HEAD
# request per hub load_dataset, 3 s timeout) stay off. Set before anything imports them (they read these once),
# so the jobs' pre-loaded interpreter (tests/job_zygote.py) and the jobs agree on them.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")

TINY_VOCAB = 128
TINY_PAD, TINY_EOS = 0, 2


def build_tiny_model(directory: Path, seed: int = 0, vocab_size: int = TINY_VOCAB) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab_size, max_position_embeddings=256,
        pad_token_id=TINY_PAD, bos_token_id=1, eos_token_id=TINY_EOS, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def build_tiny_tokenised(directory: Path, rows: int = 96, seed: int = 0, vocab_size: int = TINY_VOCAB,
                         min_prompt: int = 3, max_prompt: int = 24, validation_rows: int = 0) -> Path:
    """Rows whose target is a fixed function of the prompt (learnable), lengths varying ~6..37;
    ``validation_rows`` > 0 adds a validation split drawn the same way."""
    import numpy as np
    from datasets import Dataset, DatasetDict

    rng = np.random.default_rng(seed)

    def split(name: str, count: int) -> Dataset:
        records = {"id": [], "input_ids": [], "labels": [], "length": []}
        for k in range(count):
            prompt = rng.integers(3, vocab_size, size=int(rng.integers(min_prompt, max_prompt + 1))).tolist()
            # Targets use 8 token ids that depend on the prompt: quick to learn, so the loss visibly falls.
            target = [t % 8 + 3 for t in prompt[: max(2, len(prompt) // 2)]] + [TINY_EOS]
            ids = prompt + target
            records["id"].append(f"{name}-{k}")
            records["input_ids"].append(ids)
            records["labels"].append([-100] * len(prompt) + target)
            records["length"].append(len(ids))
        return Dataset.from_dict(records)

    splits = {"train": split("train", rows)}
    if validation_rows:
        splits["validation"] = split("validation", validation_rows)
    DatasetDict(splits).save_to_disk(str(directory))
    meta = {"cache_key": f"tiny-{seed}-{rows}", "task": "generation", "tokenizer_fingerprint": "tiny", "templates": {}, "max_length": 64,
            "input_fingerprint": "tiny", "vocab_size": vocab_size, "pad_token_id": TINY_PAD, "eos_token_id": TINY_EOS}
    Path(directory, "tokenise_meta.json").write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_tokenised_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenised(tmp_path_factory.mktemp("tiny_tokenised"))


def tiny_training_settings(**overrides):
    """Typed training settings (core.settings.TrainingSettings, schema defaults filled) for fast CPU tests;
    a nested mapping override (lora, validation) is merged into the default one."""
    from workflow_scripts.core.settings import TrainingSettings

    settings = {
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "max_length": 64, "effective_batch": 8, "micro_batch": 4, "max_steps": 6, "learning_rate": 1e-2,
        "warmup_steps": 1, "precision": "fp32", "gradient_checkpointing": True, "checkpoint_every": 3,
        "log_every": 1, "gpus": 0, "cpu_processes": 1, "dataloader_workers": 0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **value}
        else:
            settings[key] = value
    return TrainingSettings.parse(settings)


def training_json(settings) -> str:
    """A stage's --training argument: typed settings as their JSON, or a raw mapping as it is (tests that
    plant a bad value pass one)."""
    return json.dumps(settings.to_dict() if hasattr(settings, "to_dict") else settings)


# --- Running under pytest-xdist (`make test` runs two workers) -------------------------------------------------
# Each worker is one process on a 2-core machine: one intra-op thread each, so two workers (and the jobs they
# start, which inherit the variable) do not oversubscribe the cores. Set before any test imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")

# Tests that drive a whole workflow run one after another in two groups, each on one worker, the two groups
# side by side from the start: the real-SLURM tests (they share one cluster per machine, /etc/slurm/slurm.conf,
# and mostly wait on its jobs) and the local Snakemake runs (each uses both cores: two of them at once only
# stretch both towards their timeouts). A test that is both stays with the cluster. Meanwhile the in-process
# tests fill in wherever a worker has room.
SLURM_GROUP, SNAKEMAKE_GROUP = "slurm_cluster", "snakemake_runs"
SERIAL_GROUPS = {"slurm": SLURM_GROUP, "slow": SNAKEMAKE_GROUP}  # marker -> group; the first marker found wins
# Where the workers write each test's group for the controller's scheduler (set by the controller).
GROUPS_FILE_VARIABLE = "LORA_WORKFLOW_XDIST_GROUPS"


def xdist_group_of(item) -> str | None:
    """The group an item must share a worker with, or None (free to run anywhere): its own
    ``xdist_group`` mark, else the SLURM or the Snakemake group for whole-workflow runs, else its module when it
    uses a module- or class-scoped fixture (built once per worker that needs it: the tests using one stay
    together, so a shared run such as test_workflow_e2e's is still built once)."""
    mark = item.get_closest_marker("xdist_group")
    if mark:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    for marker, group in SERIAL_GROUPS.items():
        if item.get_closest_marker(marker):
            return group
    fixture_defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    if any(definition.scope in ("module", "class", "package")
           for definitions in fixture_defs.values() for definition in definitions):
        return item.module.__name__ if getattr(item, "module", None) else item.nodeid.split("::")[0]
    return None


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        import tempfile

        handle, path = tempfile.mkstemp(prefix="lora-workflow-xdist-groups-", suffix=".json")
        os.close(handle)
        os.environ[GROUPS_FILE_VARIABLE] = path  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    path = os.environ.get(GROUPS_FILE_VARIABLE)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(path).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = {item.nodeid: xdist_group_of(item) for item in items}
    for item in items:
        if groups[item.nodeid] and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Longest first (the scheduler keeps the collection's order and hands each worker the next group at the
        # start): the two serial groups start at once on two workers, the grouped modules next, single tests
        # fill in at the end.
        serial_order = list(SERIAL_GROUPS.values())
        sizes = collections.Counter(groups.values())
        items.sort(key=lambda item: (serial_order.index(groups[item.nodeid]) if groups[item.nodeid] in serial_order
                                     else len(serial_order),
                                     -sizes[groups[item.nodeid]] if groups[item.nodeid] else 0))
        path = os.environ.get(GROUPS_FILE_VARIABLE)
        if path:  # every worker collects the same tests: each writes the same mapping, whole or not at all
            staging = Path(f"{path}.{os.environ['PYTEST_XDIST_WORKER']}")
            staging.write_text(json.dumps({nodeid: group for nodeid, group in groups.items() if group}))
            os.replace(staging, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by the groups above. xdist's own loadgroup marks a group by suffixing the item's
    node id, which pytest 9 no longer lets a plugin change (every test would run anywhere); this scheduler
    reads the workers' groups instead, and keeps the collection's order (longest first)."""
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(GROUPS_FILE_VARIABLE):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class WorkerGroupScheduling(LoadGroupScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (schedule() runs then)
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_VARIABLE]).read_text() or "{}")
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return WorkerGroupScheduling(config, log)


# --- Where the suite's CPU goes (LORA_WORKFLOW_TEST_CPU_LOG=path) ------------------------------------------------
# Wall time under two workers on two cores says little about one test's cost; CPU seconds (the test's process
# and the children it waited for: launchers, torchrun ranks, Snakemake and its jobs) add up to the suite's.
# Jobs run by slurmd are not our children, so a SLURM test's own jobs are not counted.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("LORA_WORKFLOW_TEST_CPU_LOG")
    if not path:
        yield
        return
    import time

    before, start = os.times(), time.monotonic()
    yield
    after = os.times()
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - start, 2),
              "cpu_self_s": round(0.0 + after.user + after.system - before.user - before.system, 2),
              "cpu_children_s": round(0.0 + after.children_user + after.children_system
                                      - before.children_user - before.children_system, 2),
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")
