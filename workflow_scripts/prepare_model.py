"""Stage ``prepare_model``: put the base model into ``resources/models/<name>/`` once (a local rule),
so training and evaluation never reach the network.

Sources (``model.source``): ``tiny`` (built locally from the demo corpus), ``hub`` (snapshot at a
pinned revision; safetensors and tokenizer files only, pickle weights refused), ``gguf`` (a GGUF
file shipped in a Python package, converted to safetensors) and ``local`` (an existing directory,
validated and copied). Every model directory gets ``model_manifest.json``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from workflow_scripts.core.atomic_output import atomic_path, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.checks.sections import model_argument
from workflow_scripts.core.entry_settings import ModelSettings
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.model.model_files import MANIFEST_NAME, PICKLE_SUFFIXES, local_model_files

# model.tiny.architecture -> the module whose build() makes it (others: tiny_model's causal LMs)
TINY_BUILDERS = {
    "llava": "workflow_scripts.model.tiny_vlm",
    "idefics3": "workflow_scripts.model.tiny_vlm",
    "qwen2_vl": "workflow_scripts.model.tiny_vlm",
    "qwen2_5_vl": "workflow_scripts.model.tiny_vlm",
    "qwen3_vl": "workflow_scripts.model.tiny_vlm",
    "gemma3": "workflow_scripts.model.tiny_vlm",
    "llava_onevision": "workflow_scripts.model.tiny_vlm",
    "bert": "workflow_scripts.model.tiny_bert",
}
# What a snapshot keeps: config, safetensors weights (and their index), tokenizer and generation files.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def needs_weights(model: ModelSettings) -> bool:
    """``model.initialise: random`` draws the weights from the config at load time: none are fetched."""
    return model.initialise != "random"


def check_model_dir(directory: Path, origin: str, weights: bool = True) -> None:
    """A usable model directory: config.json, safetensors weights (unless ``weights`` is False: a model
    initialised at random), a tokenizer, no pickle weights."""
    names = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
    if not names:
        raise WorkflowError(f"{origin}: not a model directory (missing or empty)")
    if "config.json" not in names:
        raise WorkflowError(f"{origin}: no config.json")
    if weights and not any(name.endswith(".safetensors") for name in names):
        pickled = sorted(name for name in names if name.endswith(PICKLE_SUFFIXES))
        why = f"only pickle weights {pickled}, which can run code when loaded" if pickled else "no weights"
        raise WorkflowError(f"{origin}: {why}; convert them to safetensors first")
    if not names & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        raise WorkflowError(f"{origin}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")


def check_processor_files(prepared: Path, model: ModelSettings) -> None:
    """A dynamic-resolution VLM (Qwen2/2.5/3-VL) needs its processor file: refused here, naming the user's folder
    (or the hub repo), not at pretokenise in transformers' words about the prepared copy."""
    from workflow_scripts.model import processor_files

    fields = processor_files.read_json(prepared / "config.json", "a model config")
    problem = processor_files.missing_processor_problem(
        Path(model.path) if model.source == "local" else prepared, fields.get("model_type") if isinstance(fields, dict) else None)
    if problem is not None:
        where = f"model.path {model.path}" if model.source == "local" else f"model.hub_id {model.hub_id}@{model.revision}"
        raise WorkflowError(f"{where}: {problem}")


def snapshot_hub(model: ModelSettings, out: Path) -> dict[str, Any]:
    """Download the pinned revision's safetensors + tokenizer files; refuse a repo with pickle weights only.
    For ``initialise: random`` the weights are not downloaded (a 7B model's 15 GB would never be read)."""
    import huggingface_hub

    repo, revision = model.hub_id, model.revision
    try:
        files = huggingface_hub.list_repo_files(repo, revision=revision)
        if needs_weights(model) and not any(name.endswith(".safetensors") for name in files):
            pickled = sorted(name for name in files if name.endswith(PICKLE_SUFFIXES))
            raise WorkflowError(
                f"model.hub_id {repo}@{revision}: no safetensors weights (only {pickled or 'nothing loadable'}); "
                "pickle weights are refused because loading them can run code"
            )
        # A repo's own Python code is fetched only when the config opts into running it.
        patterns = HUB_PATTERNS + (["*.py"] if model.trust_remote_code else [])
        if not needs_weights(model):
            patterns = [pattern for pattern in patterns if pattern != "*.safetensors"]
        huggingface_hub.snapshot_download(repo, revision=revision, local_dir=str(out), allow_patterns=patterns)
    except WorkflowError:
        raise
    except Exception as error:  # one line, never a token: the hub client's errors carry URLs only
        raise WorkflowError(f"model.hub_id {repo}@{revision}: {type(error).__name__}: {error}") from None
    shutil.rmtree(out / ".cache", ignore_errors=True)  # the hub client's download bookkeeping
    if not needs_weights(model):  # an index naming shards that were not fetched would mislead a later load
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return {"hub_id": repo, "revision": revision}


def copy_local(model: ModelSettings, out: Path) -> dict[str, Any]:
    source = Path(model.path)
    check_model_dir(source, f"model.path {source}")
    for path in local_model_files(source):
        try:
            os.link(path, out / path.name)  # a hard link costs no space; copy across file systems
        except OSError:
            shutil.copyfile(path, out / path.name)
    return {"local_path": str(source)}


def prepare(model: ModelSettings, corpus: Sequence[str], out: Path) -> dict[str, Any]:
    source = model.source
    if source == "tiny":  # each family of tiny model has its own builder module
        import importlib

        module = TINY_BUILDERS.get(model.tiny.architecture, "workflow_scripts.model.tiny_model")
        return importlib.import_module(module).build(model.tiny.builder_settings(), corpus, out)
    if source == "gguf":
        from workflow_scripts.model import gguf_model

        return gguf_model.convert(model.gguf, out, model.trust_remote_code)
    if source == "hub":
        return snapshot_hub(model, out)
    return copy_local(model, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description="Prepare the base model directory (offline afterwards).")
    parser.add_argument("--model", required=True, help="The config's model section as JSON.")
    parser.add_argument("--out", required=True, type=Path, help="Model directory to create.")
    parser.add_argument("--corpus", nargs="*", default=[], help="Normalised datasets for the tiny model's tokenizer.")
    args = parser.parse_args(argv)
    model = model_argument(args.model)
    if model.source != "tiny" and args.corpus:
        raise WorkflowError(f"--corpus is only used by model.source 'tiny', not '{model.source}'")

    with atomic_path(args.out, directory=True) as out:
        out.mkdir(parents=True, exist_ok=True)
        facts = prepare(model, args.corpus, out)
        check_model_dir(out, f"prepared model {args.out}", weights=needs_weights(model))
        if model.source in ("hub", "local"):  # the tiny and GGUF builders write configs transformers knows
            from workflow_scripts.model.model_loading import check_remote_code

            origin = f"model.path {model.path}" if model.source == "local" else f"model.hub_id {model.hub_id}"
            check_remote_code(out, model.trust_remote_code, origin)
            check_processor_files(out, model)
        files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
        write_json(out / MANIFEST_NAME, build_manifest("prepare_model", model.to_dict(), model_source=model.source, files=files, **facts))
    print(f"model {model.name} ({model.source}) ready in {args.out}: {facts}")
    return 0


if __name__ == "__main__":
    run_main(main)
