"""Which base a QLoRA adapter is scored on (evaluation.qlora_base, model/quantization.evaluation_base): the
decision and the record train writes beside the adapter, without bitsandbytes. Loading the quantised base
itself is in test_qlora.py (bitsandbytes on CPU) and, on a GPU, tests/test_gpu.py's runs."""
import json
import shlex

import pytest
import torch

from conftest import tiny_training_settings
from workflow_scripts.compare import qlora_lines
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import quantization

CPU = torch.device("cpu")


def test_train_records_the_base_settings_of_a_qlora_adapter_only(tmp_path):
    settings = tiny_training_settings(quantization={"bits": 4}, precision="bf16")
    quantization.write_adapter_record(tmp_path, settings)
    record = json.loads((tmp_path / quantization.ADAPTER_RECORD).read_text())
    # compute_dtype null means the training precision's: recorded resolved, so evaluation needs no settings.
    assert record == {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "bf16"}
    assert quantization.read_adapter_record(tmp_path) == record
    plain = tmp_path / "plain"
    plain.mkdir()
    quantization.write_adapter_record(plain, tiny_training_settings())
    assert not (plain / quantization.ADAPTER_RECORD).exists() and quantization.read_adapter_record(plain) is None


def test_a_quantised_evaluation_asks_for_the_recorded_bitsandbytes_settings(tmp_path, monkeypatch):
    from transformers import BitsAndBytesConfig

    monkeypatch.setattr(quantization, "require_bitsandbytes", lambda: None)  # the arguments, not the loading
    quantization.write_adapter_record(tmp_path, tiny_training_settings(
        quantization={"bits": 4, "type": "fp4", "double_quant": False, "compute_dtype": "fp16"}))
    kwargs, facts = quantization.evaluation_base(tmp_path, "quantised", CPU)
    config = kwargs["quantization_config"]
    assert isinstance(config, BitsAndBytesConfig) and config.load_in_4bit
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant, config.bnb_4bit_compute_dtype) == (
        "fp4", False, torch.float16)
    assert kwargs["device_map"] == {"": "cpu"}
    assert facts == {"qlora_base": "quantised", "base_quantization": {"bits": 4, "type": "fp4", "double_quant": False,
                                                                      "compute_dtype": "fp16"}}
    # Asked for the unquantised base: no quantisation arguments, and eval.json says so.
    assert quantization.evaluation_base(tmp_path, "unquantised", CPU) == (
        {}, {"qlora_base": "unquantised", "base_quantization": None})


def test_an_adapter_without_the_record_and_the_untrained_base_load_unquantised(tmp_path):
    assert quantization.evaluation_base(tmp_path, "quantised", CPU) == ({}, {"qlora_base": None, "base_quantization": None})
    assert quantization.evaluation_base(None, "quantised", CPU) == ({}, {"qlora_base": None, "base_quantization": None})


def test_a_bad_setting_or_record_is_one_line(tmp_path):
    with pytest.raises(WorkflowError, match=r"^evaluation.qlora_base: 'nf4' is not one of \['quantised', 'unquantised'\]$"):
        quantization.evaluation_base(tmp_path, "nf4", CPU)
    (tmp_path / quantization.ADAPTER_RECORD).write_text('{"bits": 3}')
    with pytest.raises(WorkflowError, match=r"base_quantization.json: not the record train writes .*train the adapter again"):
        quantization.evaluation_base(tmp_path, "quantised", CPU)


def test_the_comparison_names_the_base_qlora_adapters_were_scored_on():
    rows = [{"dataset": "d", "variant": "qlora", "qlora_base": "quantised"},
            {"dataset": "d", "variant": "baseline", "qlora_base": None}]
    assert qlora_lines(rows) == ["QLoRA adapters (d/qlora) were scored on the quantised base, as they were trained "
                                 "(evaluation.qlora_base: quantised).", ""]
    assert qlora_lines(rows[1:]) == []


def test_the_table_names_the_base_a_qlora_variants_untrained_model_was_scored_on():
    """Issue 36: the untrained model of a QLoRA variant is scored on the quantised base; the table says so
    beside its score and under the table."""
    from workflow_scripts.compare import table_lines

    row = {"model": "tiny", "dataset": "d", "trained_on": "d", "metric": "exact_match", "variant": "qlora", "n_seeds": 1,
           "mean": 0.5, "std": None, "ci_low": 0.4, "ci_high": 0.6, "base_score": 0.1, "gain_over_base": None,
           "difference": None, "p_value": None, "qlora_base": "quantised", "untrained_qlora_base": "quantised"}
    assert "| 0.1000 (quantised base) |" in table_lines([row], "baseline")[2]
    assert ("The untrained model of QLoRA variants (d/qlora) was scored on the quantised base, as their adapters "
            "were (evaluation.qlora_base), so the gain over untrained holds no quantisation effect.") in qlora_lines([row])
    plain = {**row, "qlora_base": None, "untrained_qlora_base": None}
    assert "| 0.1000 |" in table_lines([plain], "baseline")[2] and qlora_lines([plain]) == []


@pytest.mark.parametrize("qlora_base", ["quantised", "unquantised"])
def test_evaluate_base_of_a_qlora_variant_passes_its_quantisation(tmp_path, qlora_base):
    """The rule gives evaluate_base the variant's bitsandbytes settings (a dry run), only for the QLoRA variant
    and only under evaluation.qlora_base: quantised."""
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    config = absolute_demo_config(datasets=["chartqa_demo"])
    config["evaluation"]["evaluate_base_model"] = True
    config["evaluation"]["qlora_base"] = qlora_base
    config["variants"]["mtup"].setdefault("training", {})["quantization"] = {"bits": 4}
    config["comparison"]["intended_differences"] = ["training.quantization"]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "2",
                           "results/tiny-llama/chartqa_demo/mtup/base/eval.json",
                           "results/tiny-llama/chartqa_demo/baseline/base/eval.json")
    assert code == 0, output
    commands = [line for line in output.splitlines() if "workflow_scripts.evaluate" in line]
    mtup, baseline = ([c for c in commands if "--variant-name mtup" in c], [c for c in commands if "--variant-name baseline" in c])
    assert len(mtup) == 1 and len(baseline) == 1 and "--base-quantization" not in baseline[0]
    assert ("--base-quantization" in mtup[0]) == (qlora_base == "quantised")
    if qlora_base == "quantised":
        words = shlex.split(mtup[0].removeprefix("Shell command: ").split(" > ")[0])
        given = json.loads(words[words.index("--base-quantization") + 1])
        assert given == {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": config["training"]["precision"]}
