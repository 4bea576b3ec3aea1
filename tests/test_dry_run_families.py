"""`snakemake -n` stops on each family of config mistake before any job, for each task family it applies to.

One table: a row per (family of mistake, task). Each row starts from a small valid config of one task
(one model, one dataset, the task's two variants; checked in-process by
``test_each_task_config_is_valid_without_its_mistake``), plants one mistake (a config edit, a text
edit of the YAML, a missing split file, or extra command-line arguments) and runs ``snakemake -n``
as tests/test_dag.py's helper does, but in a fork of the test process (``dry_run``). The run must exit
non-zero with the exact message as one line of its output, build no DAG (no "Job stats"), and leave
nothing under results/.

Messages may name ``{config}`` (the config file), ``{data}`` (the row's dataset directory) and the
row's names ``{dataset}``, ``{model}``, ``{variant}`` (the task's second variant) and ``{reference}``.
"""
from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from data_helpers import ROOT, default_config, write_jsonl
from test_dag import config_file, snakemake


def dry_run(workdir: Path, *args: str) -> tuple[int, str]:
    """test_dag's ``snakemake(workdir, *args)``, in a fork of this process (tests/snakemake_fork.py): a run that
    stops at parse time costs ~1 s of CPU instead of ~6 (measured on the 2-core machine)."""
    return snakemake(workdir, *args)


@dataclass(frozen=True)
class Task:
    """A task family's small config: its demo dataset (or, for conversation, files written here) and variants."""

    name: str
    model: str
    dataset: str
    variants: tuple[str, str]  # (reference, other)
    data_suffix: str = ".jsonl"

    def config(self, data: Path) -> dict:
        demo = default_config()
        if self.name == "conversation":
            dataset = {"task": "conversation", "source": {"type": "local", "path": str(data)},
                       "fields": {"id": "id", "messages": "messages"}, "metric": "token_f1"}
            variants = {"chat": {"task": "conversation"},
                        "terse": {"task": "conversation", "system_prompt": "Answer in one word."}}
        else:
            dataset = demo["datasets"][self.dataset]
            dataset.pop("models", None)
            dataset["source"]["path"] = str(data)
            # copies: the demo's classifier variants share one training mapping (a YAML anchor)
            variants = {name: copy.deepcopy(demo["variants"][name]) for name in self.variants}
        return {"models": {self.model: demo["models"][self.model]}, "datasets": {self.dataset: dataset},
                "variants": variants, "seeds": [1], "training": demo["training"],
                "evaluation": demo["evaluation"],
                "comparison": {**demo["comparison"], "reference_variant": {self.name: self.variants[0]}}}

    def write_data(self, data: Path) -> None:
        """The dataset's split files in ``data`` (a copy of the demo's, so a row may rename one)."""
        data.mkdir(parents=True)
        if self.name == "conversation":
            for split in ("train", "validation", "test"):
                write_jsonl(data / f"{split}.jsonl", [{"id": f"{split}{i}", "messages": [
                    {"role": "user", "content": f"colour of thing {i}?"}, {"role": "assistant", "content": "blue"}]}
                    for i in range(4)])
            return
        source = ROOT / default_config()["datasets"][self.dataset]["source"]["path"]
        for path in source.glob(f"*{self.data_suffix}"):
            shutil.copyfile(path, data / path.name)


TASKS = {
    "generation": Task("generation", "tiny-llama", "amr_demo", ("baseline", "mtup")),
    "classification": Task("classification", "tiny-llama", "topics_demo", ("plain", "framed")),
    "masked_lm": Task("masked_lm", "tiny-bert", "corpus_demo", ("mlm_tokens", "mlm_whole_word"), ".txt"),
    "vision_language": Task("vision_language", "tiny-llava", "shapes_demo", ("text_only", "vision")),
    "conversation": Task("conversation", "tiny-llama", "chat_demo", ("chat", "terse")),
}
TEMPLATED = ("generation", "classification", "vision_language")  # tasks whose variants hold templates


@dataclass(frozen=True)
class Mistake:
    """One planted mistake: ``edit(config, task)`` changes the config in place; ``text(yaml_text, task)``
    then changes the written file; ``plant(data)`` changes the dataset's files; ``args`` go to snakemake."""

    edit: Callable[[dict, Task], None] | None = None
    text: Callable[[str, Task], str] | None = None
    plant: Callable[[Path, Task], None] | None = None
    args: tuple[str, ...] = field(default_factory=tuple)
    default_file: bool = False  # the config as config/config.yaml in the working directory, no --configfile


def at(dotted: str, value: Any) -> Callable[[dict, Task], None]:
    """An edit setting ``dotted`` (``{dataset}``, ``{model}``, ``{variant}`` filled in) to ``value``."""
    def edit(config: dict, task: Task) -> None:
        *parents, last = fill(dotted, task).split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = copy.deepcopy(value)
    return edit


def fill(text: str, task: Task) -> str:
    return (text.replace("{dataset}", task.dataset).replace("{model}", task.model)
            .replace("{variant}", task.variants[1]).replace("{reference}", task.variants[0]))


def duplicate_line(start: str) -> Callable[[str, Task], str]:
    """Repeat the first line of the YAML text that starts with ``start`` (names filled in) right after it."""
    def text(yaml_text: str, task: Task) -> str:
        lines = yaml_text.splitlines()
        index = next(i for i, line in enumerate(lines) if line.startswith(fill(start, task)))
        lines.insert(index + 1, lines[index])
        return "\n".join(lines) + "\n"
    return text


def edits(*changes: Callable[[dict, Task], None]) -> Callable[[dict, Task], None]:
    def edit(config: dict, task: Task) -> None:
        for change in changes:
            change(config, task)
    return edit


def rename_split_file(old: str, new: str) -> Callable[[Path, Task], None]:
    def plant(data: Path, task: Task) -> None:
        (data / f"{old}{task.data_suffix}").rename(data / f"{new}{task.data_suffix}")
    return plant


# The task-specific value each task's variant refuses by type, and a key from another task it does not know.
WRONG_TYPE = {"generation": ("prompt", 5, "5 is not of type 'string'"),
              "classification": ("input", 5, "5 is not of type 'string'"),
              "masked_lm": ("mask_rate", "high", "'high' is not of type 'number'"),
              "vision_language": ("images", "no", "'no' is not of type 'boolean'"),
              "conversation": ("system_prompt", 5, "5 is not valid under any of the given schemas")}
FOREIGN_KEY = {"generation": "mask_rate", "classification": "prompt", "masked_lm": "prompt",
               "vision_language": "input", "conversation": "prompt"}
TEMPLATE_KEY = {"generation": "prompt", "classification": "input", "vision_language": "prompt"}
TEMPLATE_FIELD = {"generation": "question", "classification": "text", "vision_language": "question"}
FIELD_MISSING = {  # classification checks its one input template as a whole
    "generation": "{config}: config key 'variants.{variant}.prompt': refers to ['title'], which dataset '{dataset}' does not provide (it has ['answer', 'answers', 'aux', 'id', 'question']); add them under datasets.{dataset}.extra_fields or derived",
    "classification": "{config}: config key 'variants.{variant}': variant input template 'Title: {title}' must show {text} and never {label} (the gold)",
    "vision_language": "{config}: config key 'variants.{variant}.prompt': refers to ['title'], which dataset '{dataset}' does not provide (it has ['answer', 'answers', 'id', 'question']); add them under datasets.{dataset}.extra_fields or derived"}
UNSAFE = {
    "generation": "{config}: config key 'variants.{variant}.prompt': {question.upper} uses attribute access or indexing; ",
    "classification": "{config}: config key 'variants.{variant}': variant input template 'Q: {text.upper}': {text.upper} uses attribute access or indexing; ",
    "vision_language": "{config}: config key 'variants.{variant}.prompt': {question.upper} uses attribute access or indexing; "}
# where a user sets micro_batch (tiny-bert has its own), and the key the message names
MICRO_BATCH = {"masked_lm": "models.{model}.training"}
UNFAIR = ("sets 256 where the reference variant '{reference}' uses {old}, so the comparison would not be fair; make "
          "them equal, or list it under comparison.intended_differences: [training.max_length] if the difference "
          "is the point")
HINT = "a field is a plain name such as {question}, write {{ and }} for literal braces"
GPU = ("variant '{reference}' on model '{model}' asks for 8 GPUs (training.gpus 8 x training.nodes 1) but --resources "
       "gpu=2: Snakemake would silently count the job as 2 GPUs while it starts 8 processes; lower training.gpus "
       "(accumulation grows, the effective batch stays) or raise --resources gpu")


def per_task(family: str, tasks, mistake: Callable[[Task], Mistake], expected: Callable[[Task], str]) -> list:
    return [pytest.param(TASKS[t], mistake(TASKS[t]), expected(TASKS[t]), id=f"{family}-{t}") for t in tasks]


ALL = tuple(TASKS)
BREAK_YAML = lambda text, task: text.replace("variants:\n", "variants: [\n", 1)  # noqa: E731


def table() -> list:
    return [
        # schema: a wrong type, and a key of another task's variants
        *per_task("schema-type", ALL, lambda t: Mistake(at(f"variants.{{variant}}.{WRONG_TYPE[t.name][0]}", WRONG_TYPE[t.name][1])),
                  lambda t: f"{{config}}: config key 'variants.{{variant}}.{WRONG_TYPE[t.name][0]}': {WRONG_TYPE[t.name][2]}"),
        *per_task("unknown-key", ALL, lambda t: Mistake(at(f"variants.{{variant}}.{FOREIGN_KEY[t.name]}", "x")),
                  lambda t: f"{{config}}: config key 'variants.{{variant}}': Additional properties are not allowed ('{FOREIGN_KEY[t.name]}' was unexpected)"),
        # YAML: a key twice in the dataset, the dataset's name twice, a syntax error
        *per_task("duplicate-yaml-key", ALL, lambda t: Mistake(text=duplicate_line("    metric: ")),
                  lambda t: rx_line(r"\{config\}: config key 'datasets\.\{dataset\}\.metric': line \d+: key 'metric' is given twice \(first at line \d+\); YAML would silently keep only the last, so remove or rename one")),
        *per_task("duplicate-name", ALL, lambda t: Mistake(text=duplicate_line("  {reference}:")),
                  lambda t: rx_line(r"\{config\}: config key 'variants\.\{reference\}': line \d+: key '\{reference\}' is given twice \(first at line \d+\); YAML would silently keep only the last, so remove or rename one")),
        # a syntax error in config/config.yaml is named by file, line and column; one in a --configfile is
        # refused by Snakemake itself before the workflow is read, without naming either
        *per_task("yaml-syntax", ("generation",), lambda t: Mistake(text=BREAK_YAML, default_file=True),
                  lambda t: rx_line(r"config/config\.yaml: config key '<file>': not valid YAML at line \d+, column 11: expected ',' or '\]', but got ':' \(while parsing a flow sequence at line \d+, column 11\); the \[ list opened at line \d+, column 11 needs its closing \] and a comma between items: close it, add the missing comma, or quote an item that holds ':' or a bracket")),
        *per_task("yaml-syntax-in-a-configfile", ("generation",), lambda t: Mistake(text=BREAK_YAML),
                  lambda t: "Config file is not valid JSON or YAML. In case of YAML, make sure to not mix whitespace and tab indentation."),
        # templates: a field the dataset does not give, and attribute access
        *per_task("template-field-missing", TEMPLATED, lambda t: Mistake(at(f"variants.{{variant}}.{TEMPLATE_KEY[t.name]}", "Title: {title}")),
                  lambda t: FIELD_MISSING[t.name]),
        *per_task("template-unsafe", TEMPLATED, lambda t: Mistake(at(f"variants.{{variant}}.{TEMPLATE_KEY[t.name]}", f"Q: {{{TEMPLATE_FIELD[t.name]}.upper}}")),
                  lambda t: UNSAFE[t.name] + HINT),
        # fairness: a variant changing a compared key
        *per_task("variant-changes-max-length", ALL, lambda t: Mistake(at("variants.{variant}.training.max_length", 256)),
                  lambda t: "{config}: config key 'variants.{variant}.training.max_length': " + UNFAIR.replace("{old}", str(64 if t.name == "vision_language" else 128))),
        # seeds, training shape, GPUs
        *per_task("seed-out-of-range", ("generation",), lambda t: Mistake(at("seeds", [1, 2 ** 32])),
                  lambda t: "{config}: config key 'seeds.1': 4294967296 is greater than the maximum of 4294967295"),
        *per_task("effective-batch-not-divisible", ALL, lambda t: Mistake(at(MICRO_BATCH.get(t.name, "training") + ".micro_batch", 5)),
                  lambda t: f"{{config}}: config key '{MICRO_BATCH.get(t.name, 'training')}.effective_batch': 16 is not a multiple of micro_batch (5) x processes (1); choose an effective batch divisible by 5 or change micro_batch"),
        *per_task("gpus-above-resources", ALL, lambda t: Mistake(edits(at("models.{model}.training.gpus", 8), at("models.{model}.training.micro_batch", 2)), args=("--resources", "gpu=2")),
                  lambda t: GPU),
        *per_task("evaluation-gpus-above-resources", ("generation",), lambda t: Mistake(at("evaluation.gpus", 1), args=("--resources", "gpu=0")),
                  lambda t: "evaluation.gpus is 1 but --resources gpu=0: Snakemake would silently count each evaluation as 0 GPUs; lower evaluation.gpus or raise --resources gpu"),
        *per_task("evaluation-gpus-above-one", ("generation",), lambda t: Mistake(at("evaluation.gpus", 2)),
                  lambda t: "{config}: config key 'evaluation.gpus': is 2, but evaluation runs on one GPU (the others would be reserved and idle); set evaluation.gpus: 1 (or 0 for the CPU)"),
        # the dataset's files: a split file under another name
        *per_task("split-file-missing", ALL, lambda t: Mistake(plant=rename_split_file("validation", "val")),
                  lambda t: f"{{config}}: config key 'datasets.{{dataset}}.splits.validation': {{data}}/validation{t.data_suffix} is missing (the directory holds {split_files(t)}); if val{t.data_suffix} is the validation split, map it: splits: {{train: train, validation: val, test: test}}"),
        # --config: a dotted key (Snakemake's own refusal), a section's key at the top level
        *per_task("dotted-config-key", ("generation",), lambda t: Mistake(args=("--config", "training.max_steps=10")),
                  lambda t: "ValueError: Invalid config definition: Config entry must start with a valid identifier."),
        *per_task("config-key-outside-its-section", ("generation",), lambda t: Mistake(args=("--config", "max_steps=10")),
                  lambda t: "--config: config key 'max_steps': is not a top-level setting but a key of training; set it with --config 'training={max_steps: 10}' (Snakemake takes no dotted keys)"),
    ]


def split_files(task: Task) -> str:
    return str(sorted(f"{split}{task.data_suffix}" for split in ("test", "train", "val")))


@dataclass(frozen=True)
class LinePattern:
    pattern: str


def rx_line(pattern: str) -> LinePattern:
    """An expected message as a regex a whole output line must match (names written as \\{dataset\\} ...)."""
    return LinePattern(pattern)


def names(task: Task, config: Path, data: Path) -> dict[str, str]:
    return {"config": str(config), "data": str(data), "dataset": task.dataset, "model": task.model,
            "variant": task.variants[1], "reference": task.variants[0]}


def planted(tmp_path: Path, task: Task, mistake: Mistake) -> tuple[Path, Path]:
    """The row's config file and dataset directory, with the mistake in place."""
    data = tmp_path / "data"
    task.write_data(data)
    if mistake.plant is not None:
        mistake.plant(data, task)
    config = task.config(data)
    if mistake.edit is not None:
        mistake.edit(config, task)
    path = config_file(tmp_path, config)
    if mistake.default_file:
        (tmp_path / "config").mkdir()
        path = path.rename(tmp_path / "config" / "config.yaml")
    if mistake.text is not None:
        path.write_text(mistake.text(path.read_text(), task))
    return path, data


@pytest.mark.parametrize("task, mistake, expected", table())
def test_a_dry_run_stops_before_any_job_with_one_line(tmp_path, task, mistake, expected):
    path, data = planted(tmp_path, task, mistake)
    config = [] if mistake.default_file else ["--configfile", str(path), "--replace-workflow-config"]
    code, output = dry_run(tmp_path, "-n", *config, "--cores", "1", *mistake.args)
    assert code != 0, output[-3000:]
    lines = output.splitlines()
    values = names(task, path, data)
    if isinstance(expected, LinePattern):
        pattern = expected.pattern
        for name, value in values.items():
            pattern = pattern.replace(re.escape("{" + name + "}"), re.escape(value))
        assert any(re.fullmatch(pattern, line) for line in lines), f"no line matches {pattern!r}:\n{output[-3000:]}"
    else:
        message = expected
        for name, value in values.items():
            message = message.replace("{" + name + "}", value)
        assert message in lines, f"no line is {message!r}:\n{output[-3000:]}"
    assert "Job stats" not in output and "rule download" not in output, "the DAG was built: the check came too late"
    assert not (tmp_path / "results").exists() and not (tmp_path / "resources").exists()


@pytest.mark.parametrize("task", TASKS.values(), ids=list(TASKS))
def test_each_task_config_is_valid_without_its_mistake(tmp_path, task):
    """The rows fail for their mistake only: each task's config passes the checks the Snakefile runs."""
    from workflow_scripts.checks.config import check_config
    from workflow_scripts.core.config_files import check_workflow_config
    from workflow_scripts.core.experiment_config import dataset_entries
    from workflow_scripts.data.split_names import check_local_splits

    path, _ = planted(tmp_path, task, Mistake())
    config = yaml.safe_load(path.read_text())
    check_workflow_config([path], config)
    check_config(config, "config")
    check_local_splits(dataset_entries(config))


def test_a_gpu_request_within_resources_builds_the_dag(tmp_path):
    """The GPU check refuses only what --resources cannot hold: 8 GPUs with gpu=8 plan their jobs."""
    task = TASKS["generation"]
    mistake = Mistake(edits(at("models.{model}.training.gpus", 8), at("models.{model}.training.micro_batch", 2)))
    path, _ = planted(tmp_path, task, mistake)
    code, output = dry_run(tmp_path, "-n", "--configfile", str(path), "--replace-workflow-config", "--cores", "1",
                           "--resources", "gpu=8")
    assert code == 0 and "Job stats" in output, output[-3000:]


@pytest.mark.parametrize("missing, splits, available, fix", [
    ("val", {"train": "train", "validation": "val", "test": "test"}, ["dev", "test", "train"],
     "if split 'dev' is the validation split, map it: splits: {train: train, validation: dev, test: test}"),
    ("validation", {"train": "train", "validation": "validation", "test": "test"}, ["test", "train", "valid", "extra"],
     "if split 'valid' is the validation split, map it: splits: {train: train, validation: valid, test: test}"),
    ("test", {"train": "train", "test": "test"}, ["held_out", "train"],
     "if split 'held_out' is the test split, map it: splits: {train: train, test: held_out}"),
    ("test", {"train": "train", "test": "test"}, ["a", "b", "train"], "add split 'test', or map test to one of ['a', 'b']"),
    ("train", {"train": "train", "test": "test"}, ["test"], "add split 'train'"),
    ("validation", {"train": "train", "validation": "validation", "test": "test"}, ["test", "train"],
     "add split 'validation', or leave validation out: splits: {train: train, test: test}"),
])
def test_a_missing_split_names_the_alias_or_what_to_add(missing, splits, available, fix):
    """As download words it for a hub dataset (no file names): a look-alike or the only unused split is
    offered as the whole splits: mapping (a partial one would replace the default and drop splits)."""
    from workflow_scripts.data.split_names import missing_split_fix

    assert missing_split_fix(missing, splits, available) == fix


def test_a_hub_dataset_without_a_mapped_split_names_the_alias(tmp_path, monkeypatch):
    """ChartQA on the hub has 'val': download names the whole mapping that would use it."""
    import datasets

    from workflow_scripts import download
    from workflow_scripts.core.entry_settings import DatasetSettings
    from workflow_scripts.core.errors import WorkflowError

    rows = datasets.Dataset.from_list([{"q": "x?", "a": "1"}])
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.DatasetDict(
        {"train": rows, "val": rows, "test": rows}))
    settings = DatasetSettings.parse({"source": {"type": "hub", "id": "org/set", "revision": "abc123"},
                                      "splits": {"train": "train", "validation": "validation", "test": "test"},
                                      "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"}, "chart")
    with pytest.raises(WorkflowError) as caught:
        download.download_hub(settings, tmp_path / "raw")
    assert str(caught.value) == ("hub dataset org/set: no split ['validation'] (it has ['test', 'train', 'val']); if "
                                 "split 'val' is the validation split, map it: splits: {train: train, validation: val, "
                                 "test: test}")


def test_the_table_covers_every_task_and_the_families():
    ids = [row.id for row in table()]
    assert len(ids) == len(set(ids))
    tasks = {task for i in ids for task in TASKS if i.endswith("-" + task)}
    assert tasks == set(TASKS)
    families = {i[: -len(task) - 1] for i in ids for task in TASKS if i.endswith("-" + task)}
    assert len(families) >= 13, sorted(families)
