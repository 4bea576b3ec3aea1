"""pretokenise: templates, masking, eos, truncation, the cache key and parallel tokenisation."""
import json
import shutil

import pytest
import torch
from datasets import load_from_disk

from data_helpers import default_config, demo_settings, leftovers, run_download, run_normalise, typed_variant
from workflow_scripts import pretokenise
from workflow_scripts.tasks import templates
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model.model_loading import load_tokenizer

VARIANTS = default_config()["variants"]
BASELINE, MTUP = VARIANTS["baseline"], VARIANTS["mtup"]  # as the rules pass them (--variant)
TINY = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                                                  "num_heads": 2, "vocab_size": 400, "seed": 0}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The normalised AMR demo set and a tiny model whose tokenizer was trained on it."""
    from workflow_scripts import prepare_model

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("inputs")
    settings = demo_settings("amr_demo")
    data = run_normalise("amr", settings, run_download("amr", settings, tmp), tmp)[0]
    model = tmp / "model"
    assert prepare_model.main(["--model", json.dumps(TINY), "--out", str(model), "--corpus", str(data)]) == 0
    return data, model


def tokenise(data, model, out, variant=BASELINE, max_length=128, threads=1):
    report = out.parent / f"{out.name}_report.json"
    assert pretokenise.main(["--model", str(model), "--data", str(data), "--task", "generation", "--variant", json.dumps(variant),
                             "--max-length", str(max_length), "--threads", str(threads),
                             "--out", str(out), "--report", str(report)]) == 0
    return load_from_disk(str(out)), json.loads(report.read_text())


@pytest.mark.parametrize("variant", [BASELINE, MTUP], ids=["baseline", "mtup"])
def test_prompt_tokens_are_masked_and_the_target_ends_with_eos(inputs, tmp_path, variant):
    data_dir, model = inputs
    tokenised, report = tokenise(data_dir, model, tmp_path / "tok", variant)
    assert list(tokenised) == ["train", "validation"]  # the test split is evaluation's, never trained on
    tokenizer, source = load_tokenizer(model), load_from_disk(str(data_dir))["train"]
    assert tokenised["train"].features["input_ids"].feature.dtype == "int32"
    for row, out in zip(source.select(range(20)), tokenised["train"].select(range(20))):
        typed = typed_variant(variant)
        prompt = templates.encode_prompts(tokenizer, typed, [templates.render_prompt(typed, row)])[0]
        target = templates.encode_targets(tokenizer, [templates.render_target(typed, row)])[0]
        assert out["id"] == row["id"]
        assert out["input_ids"] == prompt + target and target[-1] == tokenizer.eos_token_id
        assert out["labels"] == [-100] * len(prompt) + target
        assert out["length"] == len(out["input_ids"])
    decoded = tokenizer.decode([t for t in tokenised["train"][0]["labels"] if t != -100], skip_special_tokens=True)
    assert decoded == templates.render_target(typed_variant(variant), source[0])
    assert report["splits"]["train"]["rows"] == len(source) and report["splits"]["train"]["truncated"] == 0
    meta = json.loads((tmp_path / "tok" / "tokenise_meta.json").read_text())
    assert {"cache_key", "tokenizer_fingerprint", "templates", "max_length", "input_fingerprint", "vocab_size",
            "pad_token_id", "eos_token_id"} <= set(meta)
    assert meta["eos_token_id"] == tokenizer.eos_token_id and meta["vocab_size"] == len(tokenizer)


def test_truncation_is_counted_and_rows_without_target_are_dropped(inputs, tmp_path):
    data_dir, model = inputs
    tokenizer = load_tokenizer(model)
    source = load_from_disk(str(data_dir))["train"]
    prompt_lengths = [len(ids) for ids in templates.encode_prompts(
        tokenizer, typed_variant(BASELINE), [templates.render_prompt(typed_variant(BASELINE), row) for row in source])]
    limit = sorted(prompt_lengths)[len(prompt_lengths) // 2]  # half the prompts fill the whole budget
    tokenised, report = tokenise(data_dir, model, tmp_path / "tok", max_length=limit)
    train = tokenised["train"]
    dropped = sum(length >= limit for length in prompt_lengths)
    assert report["splits"]["train"]["dropped"] == dropped > 0
    assert report["splits"]["train"]["kept"] == len(train) == len(source) - dropped
    assert report["splits"]["train"]["truncated"] == len(source)  # every target was cut
    # counted and named: the first 20 of each count, in row order
    assert report["splits"]["train"]["truncated_ids"] == source["id"][:20]
    assert report["splits"]["train"]["dropped_ids"] == [
        row_id for row_id, length in zip(source["id"], prompt_lengths) if length >= limit][:20]
    assert all(r["length"] <= limit and any(t != -100 for t in r["labels"]) for r in train)


def test_when_every_target_is_truncated_away_it_fails_and_writes_nothing(inputs, tmp_path):
    data_dir, model = inputs
    with pytest.raises(WorkflowError, match="no row keeps a target token; raise training.max_length"):
        tokenise(data_dir, model, tmp_path / "out" / "tok", max_length=3)
    assert leftovers(tmp_path / "out") == []


def test_same_inputs_reuse_the_output_and_a_changed_template_retokenises(inputs, tmp_path, capsys):
    data_dir, model = inputs
    out = tmp_path / "tok"
    first, _ = tokenise(data_dir, model, out)
    key = json.loads((out / "tokenise_meta.json").read_text())["cache_key"]
    arrow = next(out.rglob("data-*.arrow"))
    stamp = arrow.stat().st_mtime_ns
    tokenise(data_dir, model, out)
    assert "up to date" in capsys.readouterr().out and arrow.stat().st_mtime_ns == stamp

    edited = {**BASELINE, "prompt": "Q: {question}\nA:"}
    second, report = tokenise(data_dir, model, out, edited)  # the stale output must not be reused
    assert json.loads((out / "tokenise_meta.json").read_text())["cache_key"] != key
    assert report["templates"]["prompt"] == "Q: {question}\nA:"
    assert second["train"][0]["input_ids"] != first["train"][0]["input_ids"]


def test_cache_key_covers_tokenizer_max_length_and_data(inputs, tmp_path):
    data_dir, model = inputs
    tokenizer_fp = pretokenise.tokenizer_fingerprint(model)
    input_fp = pretokenise.input_fingerprint(data_dir)
    key = pretokenise.cache_key(tokenizer_fp, BASELINE, 128, input_fp)
    assert pretokenise.cache_key(tokenizer_fp, BASELINE, 64, input_fp) != key
    assert pretokenise.cache_key(tokenizer_fp, MTUP, 128, input_fp) != key

    other_model = tmp_path / "model"
    shutil.copytree(model, other_model)
    vocab = json.loads((other_model / "tokenizer.json").read_text())
    vocab["added_tokens"][0]["content"] = "<|end|>"  # a different eos token: same files, new content
    (other_model / "tokenizer.json").write_text(json.dumps(vocab))
    assert pretokenise.tokenizer_fingerprint(other_model) != tokenizer_fp

    other_data = tmp_path / "data"
    load_from_disk(str(data_dir)).map(lambda row: {"question": row["question"].lower()}).save_to_disk(str(other_data))
    assert pretokenise.input_fingerprint(other_data) != input_fp
    # an untouched copy has the same fingerprint: the key depends on content, not on paths or times
    shutil.copytree(data_dir, tmp_path / "copy")
    assert pretokenise.input_fingerprint(tmp_path / "copy") == input_fp


def test_a_changed_tokenizer_retokenises(inputs, tmp_path):
    data_dir, model = inputs
    out = tmp_path / "tok"
    tokenise(data_dir, model, out)
    other_model = tmp_path / "model"
    shutil.copytree(model, other_model)
    config = json.loads((other_model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 64
    (other_model / "tokenizer_config.json").write_text(json.dumps(config))
    before = json.loads((out / "tokenise_meta.json").read_text())
    tokenise(data_dir, other_model, out)
    after = json.loads((out / "tokenise_meta.json").read_text())
    assert after["tokenizer_fingerprint"] != before["tokenizer_fingerprint"] and after["cache_key"] != before["cache_key"]


def files_of(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("threads", [2, 3])
def test_tokenising_processes_write_byte_identical_output(inputs, tmp_path, monkeypatch, threads):
    """--threads N shares a split out between N forked processes (chunks of BATCH_SIZE rows, cut at chunk
    boundaries, the last range shorter); the files equal one process's, byte for byte."""
    data_dir, model = inputs
    monkeypatch.setattr(pretokenise, "BATCH_SIZE", 7)
    monkeypatch.setattr(pretokenise, "PROCESS_MIN_ROWS", 60)  # validation's 59 rows stay in this process
    rows = len(load_from_disk(str(data_dir))["train"])
    assert pretokenise.process_count(threads, [rows]) == threads and rows % 7 and rows > 3 * 7 * threads
    monkeypatch.setattr("workflow_scripts.data.arrow_split.BATCH_ROWS", 50)  # several record batches
    forked = []
    real = pretokenise.tokenise_in_processes
    monkeypatch.setattr(pretokenise, "tokenise_in_processes", lambda *a, **k: forked.append(a[3]) or real(*a, **k))
    one, one_report = tokenise(data_dir, model, tmp_path / "one", MTUP, threads=1)
    assert forked == []
    many, many_report = tokenise(data_dir, model, tmp_path / "many", MTUP, threads=threads)
    assert forked == [threads]  # train only: validation is below PROCESS_MIN_ROWS
    assert files_of(tmp_path / "one") == files_of(tmp_path / "many") and one_report == many_report
    # record batches of whole chunks, closed at the first chunk reaching 50 rows: 8 chunks of 7
    assert {batch.num_rows for batch in one["train"].data.to_batches()[:-1]} == {56}
    assert one["train"]["id"] == load_from_disk(str(data_dir))["train"]["id"]


def test_chunk_ranges_cover_the_rows_at_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(pretokenise, "BATCH_SIZE", 10)
    assert pretokenise.chunk_ranges(95, 2) == [(0, 50), (50, 95)]
    assert pretokenise.chunk_ranges(95, 3) == [(0, 40), (40, 80), (80, 95)]
    assert pretokenise.chunk_ranges(15, 4) == [(0, 10), (10, 15)]  # no empty range
    assert pretokenise.process_count(2, [10**9]) == 2 and pretokenise.process_count(1, [10**9]) == 1
    assert pretokenise.process_count(4, [pretokenise.PROCESS_MIN_ROWS - 1]) == 1


def test_an_error_in_a_tokenising_process_stops_the_stage_with_its_message(inputs, tmp_path, monkeypatch):
    data_dir, model = inputs
    monkeypatch.setattr(pretokenise, "BATCH_SIZE", 7)
    monkeypatch.setattr(pretokenise, "PROCESS_MIN_ROWS", 20)
    real = pretokenise.Tokeniser.chunk

    def failing(self, table):  # fails in the first forked process, on its fourth chunk
        if table.column("id")[0].as_py() == load_from_disk(str(data_dir))["train"][21]["id"]:
            raise WorkflowError("row 'x': planted failure")
        return real(self, table)

    monkeypatch.setattr(pretokenise.Tokeniser, "chunk", failing)
    with pytest.raises(WorkflowError, match="^row 'x': planted failure$"):
        tokenise(data_dir, model, tmp_path / "out" / "tok", MTUP, threads=2)
    assert leftovers(tmp_path / "out") == []


def test_chat_template_variant_uses_the_tokenizers_template(inputs, tmp_path):
    data_dir, model = inputs
    tokenised, _ = tokenise(data_dir, model, tmp_path / "tok", {**BASELINE, "chat_template": True})
    tokenizer = load_tokenizer(model)
    row = tokenised["train"][0]
    prompt = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == -100])
    assert prompt.startswith("<|user|>\nQuestion:") and prompt.endswith("<|assistant|>\n")


@pytest.mark.parametrize("change, message", [
    ({"--variant": '{"prompt": "{question}"}'}, r"^--variant: config key 'variants.<name>.target': required, but missing"),
    ({"--variant": '{"prompt": "{question}", "target": "{answer}", "colour": 1}'}, r"^--variant: config key "
     r"'variants.<name>': Additional properties are not allowed \('colour' was unexpected\)"),
    ({"--variant": '{"prompt": "{title}", "target": "{answer}"}'}, r"normalised split 'train' row 0: row id 'amr-train-0000': the prompt template refers to field 'title'"),
    ({"--max-length": "1"}, "argument --max-length"),
    ({"--model": "/nonexistent/model"}, "run prepare_model first"),
    ({"--data": "/nonexistent/data"}, "run normalise first"),
])
def test_bad_arguments_end_in_one_message_and_no_output(inputs, tmp_path, change, message):
    data_dir, model = inputs
    argv = {"--model": str(model), "--data": str(data_dir), "--task": "generation", "--variant": json.dumps(BASELINE), "--max-length": "64",
            "--out": str(tmp_path / "out" / "tok"), "--report": str(tmp_path / "out" / "report.json"), **change}
    with pytest.raises(WorkflowError, match=message):
        pretokenise.main([part for pair in argv.items() for part in pair])
    assert leftovers(tmp_path / "out") == []


def test_report_statistics_cover_every_row_including_dropped_ones(inputs, tmp_path):
    data_dir, model = inputs
    tokenizer = load_tokenizer(model)
    source = load_from_disk(str(data_dir))["train"]
    typed = typed_variant(BASELINE)
    prompts = templates.encode_prompts(tokenizer, typed, [templates.render_prompt(typed, r) for r in source])
    targets = templates.encode_targets(tokenizer, [templates.render_target(typed, r) for r in source])
    limit = sorted(len(p) for p in prompts)[len(prompts) // 2]
    lengths = [min(len(p) + len(t), limit) for p, t in zip(prompts, targets)]
    _, report = tokenise(data_dir, model, tmp_path / "tok", max_length=limit)
    stats = report["splits"]["train"]
    assert stats["max_length_seen"] == max(lengths) and isinstance(stats["max_length_seen"], int)
    assert stats["mean_length"] == sum(lengths) / len(lengths)
    assert stats["truncated"] == sum(len(p) + len(t) > limit for p, t in zip(prompts, targets))


@pytest.mark.parametrize("plant", ["none", "truncation", "padding", "split_special_tokens"])
def test_token_ids_equal_the_tokenizer_call_whatever_state_the_tokenizer_is_in(inputs, plant):
    """The fast path must not give other ids than ``tokenizer(texts)``, e.g. when something left the
    Rust tokenizer truncating or padding, or asked for special tokens to be split."""
    _, model = inputs
    tokenizer = load_tokenizer(model)
    texts = ["Question: what is the AMR of the boy wants to go?\nAnswer:", f"a {tokenizer.eos_token} b", ""]
    if plant == "truncation":
        tokenizer.backend_tokenizer.enable_truncation(3)
    elif plant == "padding":
        tokenizer.backend_tokenizer.enable_padding(length=40)
    elif plant == "split_special_tokens":
        tokenizer.split_special_tokens = True
    for add_special in (True, False):
        ids = templates.token_ids(tokenizer, texts, add_special)
        assert ids == tokenizer(texts, add_special_tokens=add_special)["input_ids"]
    assert len(ids[0]) > 3 and len(ids[2]) == 0  # neither truncated nor padded
