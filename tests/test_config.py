"""Config validation: the JSON schema (with defaults) and the checks it cannot express."""
import copy

import pytest
import yaml

from data_helpers import ROOT, default_config, single_model_config, without_idle_models
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.checks.config import check_config, load_config
from workflow_scripts.checks.sections import validate_section
from workflow_scripts.core.config_files import check_workflow_config, validate_schema


def write(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("name", ["config.yaml", "smollm2.yaml", "real_hub.yaml"])
def test_shipped_configs_are_valid(name):
    config = load_config(ROOT / "config" / name)
    assert config["datasets"] and config["variants"]


def test_real_hub_config_names_the_real_ids_and_rank_128():
    config = load_config(ROOT / "config" / "real_hub.yaml")
    assert config["model"]["hub_id"] == "Qwen/Qwen2.5-7B-Instruct" and len(config["model"]["revision"]) == 40
    assert config["datasets"]["chartqa"]["source"]["id"] == "HuggingFaceM4/ChartQA"
    assert config["training"]["lora"]["rank"] == 128


def test_defaults_are_filled():
    config = load_config(ROOT / "config" / "config.yaml")
    ocr = config["datasets"]["ocrvqa_demo"]
    assert ocr["splits"] == {"train": "train", "validation": "validation", "test": "test"}
    assert ocr["format"] == "jsonl" and config["variants"]["baseline"]["extractor"] == {"type": "whole"}


def edit(path, value):
    """the demo config as one model's (``model:``) with ``value`` set at the dotted ``path`` (None deletes the key)."""
    config = single_model_config()
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return config


@pytest.mark.parametrize("path, value, key, message", [
    ("datasets.chartqa_demo.source", {"type": "url", "url": "https://x/y.zip"}, "datasets.chartqa_demo.source.sha256", "required when source.type is 'url'"),
    ("datasets.chartqa_demo.source", {"type": "url", "url": "https://x/y.zip", "sha256": "abc"}, "datasets.chartqa_demo.source.sha256", "does not match"),
    ("datasets.chartqa_demo.source", {"type": "url", "url": "ftp://x/y.zip", "sha256": "0" * 64}, "datasets.chartqa_demo.source.url", "does not match"),
    ("datasets.chartqa_demo.source", {"type": "hub", "id": "HuggingFaceM4/ChartQA"}, "datasets.chartqa_demo.source.revision", "required"),
    ("datasets.chartqa_demo.source", {"type": "hub", "id": "HuggingFaceM4/ChartQA", "revision": "main"}, "datasets.chartqa_demo.source.revision", "a branch, not a pinned revision"),
    ("datasets.chartqa_demo.source", {"type": "local"}, "datasets.chartqa_demo.source.path", "required"),
    ("model", {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-7B-Instruct", "revision": "master"}, "model.revision", "a branch"),
    ("model", {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-7B-Instruct"}, "model.revision", "required"),
    ("model", {"name": "m", "source": "gguf"}, "model.gguf", "required"),
    ("model.name", "bad name!", "model.name", "does not match"),
    ("datasets.amr_demo.derived.aux.transform", "no_such_transform", "datasets.amr_demo.derived.aux.transform", "unknown transform"),
    ("datasets.chartqa_demo.splits", {"train": "train"}, "evaluation.split", "'test' is not a split of dataset 'chartqa_demo' (its splits: ['train']); it has no held-out split to score; add one to datasets.chartqa_demo.splits (e.g. test: <the source split of held-out rows>)"),
    ("datasets.chartqa_demo.splits", {}, "datasets.chartqa_demo.splits", "should be non-empty"),
    ("datasets.chartqa_demo.fields", {"question": "query", "answer": "label"}, "datasets.chartqa_demo.fields", ""),
    ("datasets.chartqa_demo.max_rejected_fraction", 1.5, "datasets.chartqa_demo.max_rejected_fraction", "greater than the maximum"),
    ("datasets.chartqa_demo.derived", None, "variants.mtup.target", "refers to ['aux'], which dataset 'chartqa_demo' does not provide"),
    ("variants.mtup.extractor", {"type": "section"}, "variants.mtup.extractor.marker", "needs the final task's marker"),
    ("variants.baseline.prompt", "Title: {title}\n{question}", "variants.baseline.prompt", "refers to ['title']"),
    ("training.micro_batch", 5, "training.effective_batch", "not a multiple of micro_batch"),
    ("comparison.reference_variant", "plain", "comparison.reference_variant", "not one of the generation variants"),
    # evaluate decodes on one device: two GPUs reserved, one idle (issue 23)
    ("evaluation.gpus", 2, "evaluation.gpus", "evaluation runs on one GPU"),
])
def test_bad_config_names_the_key(tmp_path, path, value, key, message):
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, edit(path, value)))
    assert caught.value.key == key
    assert message in str(caught.value) and str(tmp_path / "config.yaml") in str(caught.value)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_validate_section_fills_defaults_like_the_whole_config():
    settings = validate_section({"source": {"type": "local", "path": "d"}, "fields": {"question": "q", "answers": "a"},
                                 "metric": "exact_match"}, "datasets", "datasets.d")
    assert settings["format"] == "jsonl" and settings["flatten"] is False
    assert settings["max_rejected_fraction"] == 0.01 and settings["extra_fields"] == {} and settings["derived"] == {}
    model = validate_section({"name": "t", "source": "tiny"}, "model", "model")
    assert model["tiny"]["architecture"] == "llama" and model["trust_remote_code"] is False
    with pytest.raises(ConfigError, match=r"datasets\.d\.source\.type"):
        validate_section({"source": {"type": "ftp"}, "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"},
                         "datasets", "datasets.d")


def test_validation_does_not_change_a_valid_config_a_second_time():
    config = validate_schema(default_config())
    again = validate_schema(copy.deepcopy(config))
    check_config(again)
    assert again == config


def refused(tmp_path, config):
    """The one-line ConfigError load_config raises for ``config`` (written to tmp_path/config.yaml)."""
    path = write(tmp_path, config)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message
    return message.removeprefix(f"{path}: ")


def with_variant(prompt, target=" {answer}", **dataset_changes):
    """The demo config with chartqa_demo only (changed as given) and a variant 'hinted'."""
    config = default_config()
    config["datasets"] = {"chartqa_demo": {**config["datasets"]["chartqa_demo"], **dataset_changes}}
    config["variants"]["hinted"] = {"prompt": prompt, "target": target}
    return without_idle_models(config)


LEAK_FIX = ("so evaluation would put the gold answer into every test prompt; remove {%s} from the prompt "
            "(a field computed from the answer belongs in the target, as MTUP's aux does)")


@pytest.mark.parametrize("prompt, dataset_changes, field, why", [
    # MTUP's auxiliary field, derived from the answer by the demo config itself
    ("Q: {question} hint: {aux}", {}, "aux", "is derived from the gold answer (aux = answer_kind(answer))"),
    ("Q: {question} ({answer})", {}, "answer", "is the first gold answer"),
    ("Q: {question} {answers}", {}, "answers", "holds the gold answers"),
    # a derived field taking a derived field: still the gold, transitively
    ("Q: {question} {kind}", {"derived": {"aux": {"transform": "answer_kind", "field": "answer"},
                                          "kind": {"transform": "answer_kind", "field": "aux"}}},
     "kind", "is derived from the gold answer (kind = answer_kind(aux), aux = answer_kind(answer))"),
    # an extra field carrying the same source column as the answers
    ("Q: {question} {gold}", {"extra_fields": {"image": "image", "gold": "label"}},
     "gold", "carries source field 'label', the gold answers"),
])
def test_a_prompt_showing_the_gold_answer_or_a_field_derived_from_it_is_refused(tmp_path, prompt, dataset_changes, field, why):
    message = refused(tmp_path, with_variant(prompt, **dataset_changes))
    assert message == (f"config key 'variants.hinted.prompt': shows field '{field}', which in dataset 'chartqa_demo' "
                       f"{why}, " + LEAK_FIX % field)


def test_answer_derived_fields_stay_allowed_in_the_target():
    config = validate_schema(with_variant("Q: {question}\n", "Task 1: {aux}\nTask 2: {answer}"))
    check_config(config)


def test_a_prompt_showing_the_gold_stops_a_snakemake_dry_run(tmp_path):
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    config = absolute_demo_config(["chartqa_demo"])
    config["variants"]["hinted"] = {"prompt": "Q: {question} hint: {aux}", "target": " {answer}"}
    path = config_file(tmp_path, config)
    code, output = dry_run(tmp_path, "-n", "--configfile", str(path), "--replace-workflow-config", "--cores", "1")
    assert code != 0
    assert (f"{path}: config key 'variants.hinted.prompt': shows field 'aux', which in dataset 'chartqa_demo' is derived "
            "from the gold answer (aux = answer_kind(answer)), " + LEAK_FIX % "aux") in output


HINT = "a field is a plain name such as {question}, write {{ and }} for literal braces"


@pytest.mark.parametrize("part, template, problem", [
    ("prompt", "Q: {question.upper}", "{question.upper} uses attribute access or indexing; " + HINT),
    ("prompt", "Q: {question[0]}", "{question[0]} uses attribute access or indexing; " + HINT),
    ("target", " {answer!r}", "{answer!r} uses a conversion or format spec; " + HINT),
    ("target", " {answer:.3}", "{answer:.3} uses a conversion or format spec; " + HINT),
    ("prompt", 'Reply as {"answer": x}: {question}', '{"answer": x} is not a field name; ' + HINT),
    ("prompt", "Q: {question", "unbalanced braces (expected '}' before end of string); a field is written {name}, "
                               "write {{ and }} for literal braces"),
    ("target", " {answer}}", "unbalanced braces (Single '}' encountered in format string); a field is written {name}, "
                             "write {{ and }} for literal braces"),
    ("prompt", "  \n", "the prompt is empty for every row; write a template such as 'Question: {question}'"),
])
def test_template_syntax_is_checked_with_the_config(tmp_path, part, template, problem):
    config = default_config()
    config["variants"]["baseline"][part] = template
    assert refused(tmp_path, config) == f"config key 'variants.baseline.{part}': {problem}"


def test_literal_braces_are_allowed(tmp_path):
    config = default_config()
    config["variants"]["baseline"]["prompt"] = 'Reply as {{"answer": ...}}: {question}'
    load_config(write(tmp_path, config))


DEMO = (ROOT / "config" / "config.yaml").read_text()
SMALL = """\
model: {name: tiny-llama, source: tiny}
datasets:
  amr_demo:
    source: {type: local, path: demo_data/amr}
    fields: {id: id, question: sentence, answers: graph}
    metric: smatch
%s
variants:
  baseline: {prompt: "Q: {question}", target: " {answer}"}
%s
training: {max_length: 128%s}
"""


@pytest.mark.parametrize("text, key, line, first", [
    # a second dataset or variant of the same name would silently replace the first
    (SMALL % ("  amr_demo:\n    source: {type: local, path: elsewhere}", "", ""), "datasets.amr_demo", 7, 3),
    (SMALL % ("", "  baseline: {prompt: 'Q: {question}', target: '{answer}'}", ""), "variants.baseline", 10, 9),
    # deeper, on one line in a flow mapping
    (SMALL % ("", "", ", max_length: 64"), "training.max_length", 11, 11),
])
def test_duplicate_keys_are_refused_naming_file_line_and_key(tmp_path, text, key, line, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    assert yaml.safe_load(text)  # plain PyYAML accepts it, keeping the last
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    name = key.rsplit(".", 1)[-1]
    assert str(caught.value) == (f"{path}: config key '{key}': line {line}: key '{name}' is given twice (first at line "
                                 f"{first}); YAML would silently keep only the last, so remove or rename one")


def test_the_snakefile_check_rereads_each_config_file_strictly(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(DEMO)
    bad.write_text("seeds: [1]\nseeds: [2]\n")
    config = default_config()
    check_workflow_config([good], config)
    assert config["evaluation"]["split"] == "test"  # defaults filled, as snakemake.utils.validate does
    with pytest.raises(ConfigError) as caught:
        check_workflow_config([good, bad], default_config())
    assert str(caught.value) == (f"{bad}: config key 'seeds': line 2: key 'seeds' is given twice (first at line 1); "
                                 "YAML would silently keep only the last, so remove or rename one")


@pytest.mark.parametrize("text, message", [
    ("model: [unclosed", "not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>' "
                         "(while parsing a flow sequence at line 1, column 8); the [ list opened at line 1, column 8 "
                         "needs its closing ] and a comma between items: close it, add the missing comma, or quote an "
                         "item that holds ':' or a bracket"),
    ("model:\n  name: x\n   source: tiny\n", "not valid YAML at line 3, column 10: mapping values are not allowed here"),
    # issue 44: the fault is reported a line after the mapping that is not closed, so the message names both
    ("model: {name: x\nseeds: [1]\n", "not valid YAML at line 2, column 6: expected ',' or '}', but got ':' "
                                      "(while parsing a flow mapping at line 1, column 8); the { mapping opened at line "
                                      "1, column 8 needs its closing } and a comma between entries: close it, add the "
                                      "missing comma, or quote a value that holds ',', ':' or a bracket"),
])
def test_yaml_syntax_errors_are_one_line_with_line_and_column(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: config key '<file>': {message}"


@pytest.mark.parametrize("path, value, expected", [
    ("training.max_steps", "many", "config key 'training.max_steps': 'many' is not of type 'integer', 'null'"),
    ("model.name", None, "config key 'model.name': required, but missing (model has keys ['source', 'tiny', 'training', 'trust_remote_code'])"),
    ("model", None, "config key 'model': required, but missing: give the base model under model: (one) or models: "
                    "(several, by name) (the config has keys "
                    "['comparison', 'datasets', 'evaluation', 'mixtures', 'seeds', 'tracking', 'training', 'variants'])"),
    # a value under a key that looks like a secret is never echoed, nor one inside a value that is echoed
    ("datasets.chartqa_demo.extra_fields", {"api_key": 8675309}, "config key 'datasets.chartqa_demo.extra_fields.api_key': "
                                                                 "<redacted> is not of type 'string'"),
    ("datasets.chartqa_demo.extra_fields", {"hf_token": ["hf_abcdef123"]}, "config key "
     "'datasets.chartqa_demo.extra_fields.hf_token': <redacted> is not of type 'string'"),
    ("seeds", {"password": "hunter22"}, "config key 'seeds': {'password': '<redacted>'} is not of type 'array'"),
])
def test_schema_errors_are_one_line_and_never_echo_a_secret(path, value, expected):
    config = edit(path, value)
    with pytest.raises(ConfigError) as caught:
        validate_schema(config, "c.yaml")
    assert str(caught.value) == f"c.yaml: {expected}"
    assert not any(secret in str(caught.value) for secret in ("8675309", "hf_abcdef123", "hunter22"))


UNFAIR = ("config key 'variants.mtup.training.max_length': sets 256 where the reference variant 'baseline' uses 128, "
          "so the comparison would not be fair; make them equal, or list it under comparison.intended_differences: "
          "[training.max_length] if the difference is the point")


def test_a_variant_changing_a_compared_training_key_is_refused_before_any_job():
    """The seeds' 512-vs-2048 case: refused when the config is read, not by compare after training."""
    config = default_config()
    config["variants"]["mtup"]["training"] = {"max_length": 256}
    with pytest.raises(ConfigError) as raised:
        validate_schema(config)
        check_config(config)
    assert UNFAIR in str(raised.value)
    config["comparison"]["intended_differences"] = ["training.max_length"]
    check_config(config)  # declared: allowed
    config = default_config()
    config["variants"]["mtup"]["training"] = {"runtime_minutes": 2000, "gpus": 0}
    validate_schema(config)
    check_config(config)  # runtime-only keys change nothing that is learned
    config = default_config()
    for name in ("baseline", "mtup"):  # the same override on every variant of the task is fair
        config["variants"][name]["training"] = {"lora": {"rank": 8}}
    validate_schema(config)
    check_config(config)


def test_an_unfair_variant_stops_a_snakemake_dry_run(tmp_path):
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    config = absolute_demo_config(["chartqa_demo"])
    config["variants"]["mtup"]["training"] = {"max_length": 256}
    code, output = dry_run(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "1")
    assert code != 0 and UNFAIR in output and "Job stats" not in output


@pytest.mark.parametrize("seed", [-1, 2 ** 32])
def test_a_seed_outside_what_numpy_and_torch_accept_is_refused(seed):
    config = default_config()
    config["seeds"] = [seed]
    with pytest.raises(ConfigError, match=r"seeds\.0"):
        validate_schema(config)


def test_masked_lm_variants_with_other_max_length_are_refused_as_scored_on_other_tokens():
    """Issue 22 (decision): masked-LM evaluation cuts test lines at the training max_length, so listing
    training.max_length as intended still leaves the variants scored on different tokens; the config-time
    guard names evaluation.eval_mask.max_length (as compare does after training)."""
    config = default_config()
    config["variants"]["mlm_whole_word"]["training"] = {"max_length": 32}
    config["comparison"]["intended_differences"] = ["training.max_length"]
    validate_schema(config)
    with pytest.raises(ConfigError) as raised:
        check_config(config)
    message = str(raised.value)
    assert "config key 'variants.mlm_whole_word.training.max_length': sets 32 where the reference variant " \
           "'mlm_tokens' uses" in message
    assert "(evaluation.eval_mask.max_length), so the variants would be scored on different tokens" in message
    assert "list evaluation.eval_mask under comparison.intended_differences" in message
    config["comparison"]["intended_differences"] = ["training.max_length", "evaluation.eval_mask"]
    check_config(config)
    config = default_config()  # a generation variant's max_length needs only training.max_length listed
    config["variants"]["mtup"]["training"] = {"max_length": 256}
    config["comparison"]["intended_differences"] = ["training.max_length"]
    validate_schema(config)
    check_config(config)
