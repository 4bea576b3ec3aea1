"""Each workflow job is a fresh interpreter: what a stage imports before its first useful line is paid once
per job (issue 25). The light stages must not pull in peft or transformers' model classes (seconds of
torch._inductor, bitsandbytes and modeling code), and the evaluation module, which evaluate_base also runs,
must not pull in peft. Checked in a subprocess, where sys.modules starts empty."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from data_helpers import ROOT, demo_settings

LIGHT_STAGES = ("download", "normalise", "compare", "pretokenise", "prepare_model", "mix", "cross_contamination",
                "power")
MODEL_CLASSES = ("peft", "transformers.modeling_utils", "bitsandbytes")


def modules_after(code: str) -> set[str]:
    """The names in sys.modules after running ``code`` in a fresh interpreter of this environment."""
    probe = code + "\nimport json, sys\nprint('MODULES=' + json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("MODULES="))
    return set(json.loads(line.removeprefix("MODULES=")))


@pytest.mark.parametrize("stage", LIGHT_STAGES)
def test_importing_a_light_stage_loads_neither_torch_nor_peft_nor_model_classes(stage):
    loaded = modules_after(f"import workflow_scripts.{stage}")
    assert not {"torch", "transformers", *MODEL_CLASSES} & loaded, sorted({"torch", "transformers", *MODEL_CLASSES} & loaded)


def test_the_evaluation_module_which_evaluate_base_runs_loads_no_peft():
    loaded = modules_after("import workflow_scripts.evaluate")
    assert not {"peft", "bitsandbytes"} & loaded


# One demo dataset per task type that has one (conversation has none: its task is checked below).
DEMO_DATASET_OF_TASK = {"generation": "amr_demo", "classification": "topics_demo", "masked_lm": "corpus_demo",
                        "vision_language": "shapes_demo"}


@pytest.mark.parametrize("task", sorted(DEMO_DATASET_OF_TASK))
def test_the_data_stages_run_without_torch_peft_or_transformers(tmp_path, task):
    """Not only the import: download and normalise of each task's demo dataset, run to the end, never load
    them (the task's module is loaded for its row mapping and keeps torch for training)."""
    name = DEMO_DATASET_OF_TASK[task]
    settings = json.dumps(demo_settings(name))
    raw, normalised = tmp_path / "raw", tmp_path / "normalised"
    loaded = modules_after(
        "from workflow_scripts import download, normalise\n"
        f"assert download.main(['--name', {name!r}, '--dataset', {settings!r}, '--out', {str(raw)!r},"
        f" '--manifest', {str(tmp_path / 'manifest.json')!r}]) == 0\n"
        f"assert normalise.main(['--name', {name!r}, '--dataset', {settings!r}, '--raw', {str(raw)!r},"
        f" '--out', {str(normalised)!r}, '--report', {str(tmp_path / 'report.json')!r}]) == 0\n")
    assert (normalised / "dataset_dict.json").exists() or any(normalised.iterdir())
    assert not {"torch", "transformers", *MODEL_CLASSES} & loaded, sorted({"torch", "transformers", *MODEL_CLASSES} & loaded)


# Each task's training loss class, reached through its task module as before (it lives in a module of its own).
LOSS_OF_TASK = {"generation": "TargetTokenLoss", "classification": "ClassificationLoss",
                "masked_lm": "MaskedTokenLoss", "vision_language": "VisionTargetTokenLoss", "conversation": None}


@pytest.mark.parametrize("task", sorted(LOSS_OF_TASK))
def test_a_task_loaded_for_its_data_loads_no_torch_and_its_loss_still_comes_with_torch(task):
    """normalise (row mapping, label set, rejection reasons), compare (comparison note) and the config checks
    load a task for data alone; the loss module and the collator still bring torch when asked for."""
    loaded = modules_after("from workflow_scripts.tasks import task_named\n"
                           f"task = task_named({task!r})\n"
                           "task.record_mapper, getattr(task, 'comparison_note', None), task.check_variant\n"
                           "getattr(task, 'normalise_state', None), getattr(task, 'rejection_reasons', None)\n")
    assert not {"torch", "transformers", *MODEL_CLASSES} & loaded, sorted({"torch", "transformers", *MODEL_CLASSES} & loaded)
    loss = LOSS_OF_TASK[task]
    if loss:
        modules_after(f"from workflow_scripts.tasks import {task}\nimport torch\n"
                      f"assert issubclass({task}.{loss}, torch.nn.Module)\n")


def test_the_generation_task_loaded_for_its_data_loads_no_torch():
    """normalise (row mapping, rejection reasons) and compare (comparison note) load a task for data alone;
    its loss (generation.TargetTokenLoss) still comes with torch when asked for."""
    loaded = modules_after("from workflow_scripts.tasks import task_named\n"
                           "task = task_named('generation')\n"
                           "task.record_mapper, getattr(task, 'comparison_note', None), task.rejection_reasons "
                           "if hasattr(task, 'rejection_reasons') else None\n")
    assert "torch" not in loaded
    assert "torch" in modules_after("from workflow_scripts.tasks import generation\ngeneration.TargetTokenLoss")


# A stage run as a command (its own interpreter) whose job quantises nothing leaves bitsandbytes out: peft
# imports it whenever it is installed, and it imports torch._inductor (model/quantization.leave_out_bitsandbytes).
STAGE_COMMAND_PROBE = """
import atexit, json, runpy, sys
atexit.register(lambda: print('MODULES=' + json.dumps(sorted(name for name, module in sys.modules.items() if module))))
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
"""


def stage_command_modules(stage: str, argv: list[str]) -> set[str]:
    """The modules loaded by ``python -m workflow_scripts.<stage> argv``, which must succeed."""
    done = subprocess.run([sys.executable, "-c", STAGE_COMMAND_PROBE, f"workflow_scripts.{stage}", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("MODULES="))
    return set(json.loads(line.removeprefix("MODULES=")))


@pytest.fixture(scope="module")
def gate_model(tmp_path_factory):
    """The demo's tiny Llama shape (hidden 64: bitsandbytes' 4-bit blocks fit it), a byte-level tokenizer."""
    from workflow_scripts.model import tiny_model

    tokenizer = tiny_model.train_tokenizer(iter(["stage imports"]), 128)
    directory = tmp_path_factory.mktemp("gate_model")
    tiny = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "seed": 0}
    tiny_model.build_model(tiny, tokenizer).save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize("quantised", [False, True], ids=["lora", "qlora"])
def test_a_model_stage_run_as_a_command_loads_bitsandbytes_only_when_it_quantises(tmp_path, gate_model,
                                                                                    tiny_tokenised_dir, quantised):
    """The sanity gate as Snakemake runs it: LoRA without bitsandbytes (peft still loads and trains), QLoRA with it."""
    from conftest import tiny_training_settings, training_json

    if quantised:
        pytest.importorskip("bitsandbytes")
    quantization = {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "fp32"} if quantised else None
    settings = tiny_training_settings(sanity_batches=1, quantization=quantization)
    out = tmp_path / "sanity.json"
    loaded = stage_command_modules("sanity", ["--model", str(gate_model), "--data", str(tiny_tokenised_dir),
                                              "--training", training_json(settings), "--seed", "1", "--out", str(out)])
    assert json.loads(out.read_text())["passed"] is True
    assert "peft" in loaded
    assert ("bitsandbytes" in loaded) is quantised


def test_a_stage_called_in_process_keeps_bitsandbytes_for_a_later_qlora_run():
    """main() called by a test or a notebook: this interpreter is not the stage's own, nothing is left out."""
    from workflow_scripts.model import quantization

    before = sys.modules.get("bitsandbytes", "absent")
    assert quantization.leave_out_bitsandbytes("workflow_scripts.sanity", quantised=False) is False
    assert sys.modules.get("bitsandbytes", "absent") is before


def test_an_evaluation_quantises_only_a_qlora_adapter_on_its_quantised_base(tmp_path):
    from workflow_scripts.model import quantization

    record = {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "fp32"}
    qlora, plain = tmp_path / "qlora", tmp_path / "plain"
    qlora.mkdir(), plain.mkdir()
    (qlora / quantization.ADAPTER_RECORD).write_text(json.dumps(record))
    assert quantization.evaluation_quantises(qlora, "quantised") is True
    assert quantization.evaluation_quantises(qlora, "unquantised") is False
    assert quantization.evaluation_quantises(plain, "quantised") is False
    assert quantization.evaluation_quantises(None, "quantised") is False  # the untrained base
