"""The documentation (issue 39): generated pages current, the site built strictly and seen in a browser, the
README short and its five steps a plan Snakemake accepts.

docs/gen/generate.py writes the configuration reference (from config/schema.yaml), the messages page (from the
bad-input tables), the stages page (from rules/*.smk) and README.md's demo block (from the demo's comparison.md);
a stale one fails here. The site is built once per module with `mkdocs build --strict` (~2 s) and opened in
headless Chromium (docs/gen/browser_check.py, ~4 s; skipped without Chromium unless
LORA_WORKFLOW_REQUIRE_CHROMIUM=1, which .ci/run sets).
"""
from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_helpers import ROOT
from test_dag import job_counts, snakemake


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_gen_{name}", ROOT / "docs" / "gen" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load("generate")
browser_check = load("browser_check")
SCHEMA = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())


@pytest.fixture(scope="module")
def expected():
    return generate.outputs()


# --- generated pages --------------------------------------------------------------------------------------------
def test_every_generated_page_and_block_is_current(expected):
    assert generate.stale(expected) == [], "run `make docs-generate` (python docs/gen/generate.py) and commit"


def test_a_stale_schema_description_fails_the_check():
    planted = copy.deepcopy(SCHEMA)
    planted["$defs"]["training_settings"]["properties"]["max_length"]["description"] = "Tokens per example (stale)."
    planted["properties"]["evaluation"]["description"] = "How models are scored (stale)."
    behind = generate.stale(generate.outputs(schema=planted))
    assert behind == ["docs/reference/configuration.md", "config/README.md"]


def test_the_reference_has_every_key_of_the_schema_with_its_default_and_values():
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    rows = {match.group(1): match.group(0) for match in re.finditer(r"(?m)^\| `([^`]+)` \|.*$", page)}
    keys = [key.path for section, spec in SCHEMA["properties"].items()
            for key in [generate.Key(section, spec), *generate.walk(section, spec, SCHEMA)]]
    assert set(keys) <= set(rows) and len(keys) > 150
    assert "| `training.max_length` | integer | `512` | ≥ 8 | Tokens per example, prompt and target together. |" \
        in rows["training.max_length"]
    assert "`fp32`, `bf16`, `fp16`" in rows["training.precision"]
    assert "*task classification:*" in rows["datasets.*.labels"]  # a task's own key says which task


def test_the_schema_holds_only_json_schema_keywords():
    """A flow mapping's unquoted comma cut two descriptions short, leaving the rest as a key the validator
    ignores (`{description: Model directory, for source local.}`); the reference would print the stump."""
    keywords = {"type", "description", "default", "enum", "const", "properties", "additionalProperties", "required",
                "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items", "minItems", "uniqueItems",
                "pattern", "oneOf", "$ref", "if", "then", "else", "propertyNames", "minProperties", "maxProperties",
                "unevaluatedProperties", "minLength", "$defs", "$schema"}

    def odd(node, named: bool = False):
        if isinstance(node, dict):
            for key, value in node.items():
                if not named and key not in keywords:
                    yield key
                yield from odd(value, named=key in ("properties", "$defs"))
        elif isinstance(node, list):
            for value in node:
                yield from odd(value)

    found = set(odd({k: v for k, v in SCHEMA.items()}))
    found -= {"train", "validation", "test"}  # the default of datasets.*.splits, a value, not a schema
    assert found == set()


def test_the_messages_page_lists_every_case_of_both_tables():
    page = (ROOT / "docs" / "reference" / "messages.md").read_text()
    cases = generate.bad_input_cases()
    assert len(cases) > 200 and all(f"- **{name}**, at `{stage}`" in page for _, name, stage, *_ in cases)
    assert "effective_batch': 16 is not a multiple of micro_batch (5)" in page
    assert all(f"- **{family}** (" in page for family, *_ in generate.dry_run_cases())


def test_every_rule_is_on_the_stages_page():
    page = (ROOT / "docs" / "reference" / "stages.md").read_text()
    rules = re.findall(r"(?m)^rule (\w+):", "".join(p.read_text() for p in (ROOT / "rules").glob("*.smk")))
    assert rules and all(f"\n## {rule}\n" in page for rule in rules)
    assert "- data: `results/data/{dataset}/normalised`" in page


def test_the_stages_column_comes_from_the_config_reads_table(monkeypatch):
    """The reference's 'read by' column is the reads table's answer (core/config_reads.py, issue 35)."""
    from workflow_scripts.core import config_reads

    expected = ", ".join(f"`{stage}`" for stage in config_reads.unconditional_stages_reading("evaluation.max_new_tokens"))
    assert "evaluate" in expected
    page = generate.configuration_reference(SCHEMA)
    assert re.search(rf"(?m)^\| `evaluation.max_new_tokens` \|.*\| {re.escape(expected)}, `train` \(only with "
                     r"`training.validation.metric_examples` set\) \|$", page)
    monkeypatch.setitem(config_reads.READS, "compare", (*config_reads.READS["compare"], "evaluation.max_new_tokens"))
    assert generate.configuration_reference(SCHEMA) != page


def test_read_by_keeps_the_conditions_and_the_run_time_reads_and_runtime_only_is_defined_once():
    """A key train reads only under training.validation.metric_examples is never shown as read by train outright
    (the page said a new max_new_tokens retrains every adapter, which the rerun table denies); a key received at
    run time says it reruns nothing; "Runtime-only" keeps the one meaning the page defines (issue 42)."""
    page = generate.configuration_reference(SCHEMA)
    rows = {match.group(1): match.group(0) for match in re.finditer(r"(?m)^\| `([^`]+)` \|.*$", page)}
    conditional = "`train` (only with `training.validation.metric_examples` set)"
    for key in ("evaluation.max_new_tokens", "evaluation.batch_size", "datasets.*.metric", "variants.*.prompt"):
        assert conditional in rows[key] and "`train`, " not in rows[key] and not rows[key].endswith("`train` |"), rows[key]
    assert rows["datasets.*.metric"].endswith("`normalise` (only when the dataset's graph metrics (smatch, smatchpp) "
                                              "change: its gold-graph check) |"), rows["datasets.*.metric"]
    assert rows["training.learning_rate"].endswith("| `sanity`, `train` |")
    assert rows["tracking.mlflow.enabled"].endswith("| `train` at run time |")
    assert rows["seeds"].endswith("| `sanity` at run time, the plan: which jobs exist |")
    assert rows["model"].endswith("| its keys, below |")  # not every stage of every model key, one per line
    assert page.count("*Runtime-only* in a description means") == 1
    assert not re.search(r"(?i)runtime only", page), "a second meaning of runtime-only"


# --- the README and its demo figures ----------------------------------------------------------------------------
def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_a_changed_demo_figure_fails_the_check_and_the_findings_follow_the_table():
    comparison = (ROOT / "docs" / "demo" / "comparison.md").read_text()
    vision = next(line for line in comparison.splitlines() if "| shapes_demo |" in line and "| vision |" in line)
    planted = comparison.replace(vision, vision.replace("0.9505 ± 0.0239", "0.6505 ± 0.0239")
                                 .replace("+0.7005 [+0.6328, +0.7656]", "+0.4005 [+0.3328, +0.4656]"))
    outputs = generate.outputs(comparison=planted)
    assert generate.stale(outputs) == ["README.md"]
    readme = outputs[ROOT / "README.md"]
    assert "`vision` 0.65 against `text_only` 0.25" in readme and "Δ +0.40 [+0.33, +0.47]" in readme


def test_every_demo_figure_in_the_readme_is_in_the_generated_block():
    """Figures like 0.7350 or -0.21 appear in the README only inside the block generated from the run."""
    readme = (ROOT / "README.md").read_text()
    begin, end = readme.index("<!-- BEGIN GENERATED: demo -->"), readme.index("<!-- END GENERATED: demo -->")
    outside = readme[:begin] + readme[end:]
    assert re.findall(r"[+-]?\d\.\d{2,}", outside) == []


def test_the_five_steps_plan_a_real_experiment(tmp_path):
    """README step 4 on its own config: `snakemake -n` with a hub model and a local dataset plans every job."""
    readme = (ROOT / "README.md").read_text()
    config = re.search(r"(?ms)^```yaml\n(# my_experiment\.yaml\n.*?)^```", readme).group(1)
    (tmp_path / "my_experiment.yaml").write_text(config)
    data = tmp_path / "data" / "my_qa"
    data.mkdir(parents=True)
    for split, rows in (("train", 24), ("validation", 4), ("test", 6)):
        lines = [f'{{"id": "{split}-{i}", "question": "What is {i} plus {i}?", "answer": ["{2 * i}"]}}'
                 for i in range(rows)]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    command = re.search(r"snakemake -n (--configfile my_experiment\.yaml .*?)\s+#", readme).group(1).split()
    places = {"my_experiment.yaml": str(tmp_path / "my_experiment.yaml"), "profiles/local": str(ROOT / "profiles" / "local")}
    command = [places.get(word, word) for word in command]
    code, output = snakemake(tmp_path, "-n", *command[:2], "--replace-workflow-config", *command[2:])
    assert code == 0, output
    counts = job_counts(output)
    page = (ROOT / "docs" / "getting-started.md").read_text()
    table = dict(re.findall(r"(?m)^(\w+)\s+(\d+)$", page.split("Job stats:", 1)[1].split("```", 1)[0]))
    assert {rule: int(count) for rule, count in table.items() if rule != "total"} == counts
    assert counts["train"] == 6 and "Qwen/Qwen2.5-7B-Instruct" in output


# --- pages a newcomer reads first (issue 42) ----------------------------------------------------------------------
USER_FILES = [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "tasks").glob("*.md")),
              ROOT / "README.md", ROOT / "config" / "README.md", ROOT / "mkdocs.yml",
              ROOT / ".snakemake-workflow-catalog.yml", *sorted((ROOT / "config").glob("*.yaml")),
              *sorted((ROOT / "config" / "examples").glob("*.yaml"))]
DEVELOPER_PAGES = {"architecture.md", "development.md"}  # how the code is built: its tests and modules by name


def test_the_catalog_and_the_pages_give_the_slurm_profile_alike():
    """Snakemake 9: --profile is the compute environment's profile (executor, jobs, resources), which
    profiles/slurm is; --workflow-profile is for a workflow's own settings. The catalog said the other."""
    assert "executor: slurm" in (ROOT / "profiles" / "slurm" / "config.yaml").read_text()
    for path in USER_FILES:
        text = path.read_text()
        assert "--workflow-profile" not in text, path
    assert "--profile profiles/slurm" in (ROOT / ".snakemake-workflow-catalog.yml").read_text()


def test_no_internal_process_words_on_user_pages():
    """Post-mortems are post-mortems, not "seeds" (the random seeds' word); no page speaks of who writes it or
    of the tracker's issue numbers; user pages name no test file. The benchmark results (included in the site)
    also name no work session and no one who ran a figure ("helpers"): dates, commits, machines and load do."""
    words = re.compile(r"(?i)other engineers|being written by|\bissues? \d+\b|seeds' set-up|set-up of the seeds|"
                       r"seed's kind|\(the seed's\)|(CNM-BERT|LMOL|SHIRG|MTUP) seed")
    results = ROOT / "benchmarks" / "RESULTS.md"
    for path in [*USER_FILES, results]:
        text = path.read_text()
        assert not words.search(text), f"{path}: {words.search(text).group(0)!r}"
        if path.parent.name in ("docs", "tasks") and path.name not in DEVELOPER_PAGES | {"what-it-prevents.md"}:
            assert not re.search(r"tests/test_\w+\.py", text), path
    # Only on RESULTS.md: "helper" means a code helper elsewhere (e.g. rules/common.smk's); a file path such as
    # `peft/helpers.py` is a module, not a person, so a word joined to "/" or "." does not count.
    process = re.compile(r"(?i)\bsessions? \d+\b|(?<![/.\w])helpers?\b(?![./\w])|\bthe lead\b|\bintegrator\b")
    found = process.search(results.read_text())
    assert not found, f"{results}: {found.group(0)!r}"


def test_getting_starteds_smallest_config_is_valid_and_offline(tmp_path):
    from workflow_scripts.checks.config import load_config

    page = (ROOT / "docs" / "getting-started.md").read_text()
    config = re.search(r"(?ms)The smallest config.*?^```yaml\n(.*?)^```", page).group(1)
    assert "source: tiny" in config
    path = tmp_path / "smallest.yaml"
    path.write_text(config.replace("path: demo_data/", f"path: {ROOT}/demo_data/"))
    assert load_config(path)["model"]["source"] == "tiny"


# --- the site ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(target)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    return target


def test_the_site_builds_strictly_with_every_page(site):
    for page in ("index.html", "getting-started.html", "reference/configuration.html", "benchmarks.html"):
        assert (site / page).is_file(), page
    # included, not copied: the README's demo block and benchmarks/RESULTS.md
    assert "0.9505 ± 0.0239" in (site / "getting-started.html").read_text()
    assert "Benchmark results" in (site / "benchmarks.html").read_text()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("gen"))
    (docs / "statistics.md").write_text((docs / "statistics.md").read_text() + "\nSee [gone](no-such-page.md).\n")
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(tmp_path / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode != 0 and "no-such-page.md" in done.stderr


@pytest.fixture(scope="module")
def browser():
    found = browser_check.chromium()
    if found is None:
        if os.environ.get("LORA_WORKFLOW_REQUIRE_CHROMIUM") == "1":
            pytest.fail("no Chromium, and LORA_WORKFLOW_REQUIRE_CHROMIUM=1 (apt-get install chromium)")
        pytest.skip("no Chromium (apt-get install chromium)")
    return found


def test_the_start_page_and_the_reference_render_with_navigation_search_and_code(site, browser, tmp_path):
    shot, reference = tmp_path / "start_page.png", tmp_path / "reference.png"
    assert browser_check.problems(site, browser, screenshot=shot, reference_screenshot=reference) == []
    assert shot.read_bytes()[:8] == reference.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_browser_check_sees_a_missing_search_index_and_navigation(site, browser, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "search" / "search_index.json").unlink()
    assert browser_check.problems(broken, browser) == [f"{broken}/search/search_index.json: no search index "
                                                       "(is the search plugin on?)"]
    index = broken / "index.html"
    shutil.copy(site / "search" / "search_index.json", broken / "search" / "search_index.json")
    index.write_text(index.read_text().replace('class="md-nav', 'class="gone').replace('class="highlight', 'class="x'))
    found = browser_check.problems(broken, browser, pages={"start page": "index.html"})
    assert any("index.html (start page): the navigation" in line for line in found)
    assert any("index.html (start page): no highlighted code block" in line for line in found)


def test_the_browser_check_sees_reference_tables_past_a_1280_px_column(browser, tmp_path):
    """Without the table of contents in the left navigation and the narrower table cells, the reference's tables
    ran past the text column at 1280 px and the model section's row was a 312 px band (issue 42)."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert "- toc.integrate" in config
    (tmp_path / "mkdocs.yml").write_text(config.replace("    - toc.integrate\n", "")
                                         .replace("docs_dir: docs", f"docs_dir: {ROOT / 'docs'}"))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(tmp_path / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    server, base = browser_check.serve(tmp_path / "site")
    try:
        found = browser_check.layout_problems(browser, base)
    finally:
        server.shutdown()
    assert any("scrolls sideways" in line for line in found), found


def test_the_statistics_page_figures_from_the_demo_table_agree_with_it():
    """The achieved minimum detectable effects quoted on the statistics page are computed from the demo's
    comparison (its Δ intervals), as compare computes them; the estimates beside them come from power.json."""
    from workflow_scripts.analysis.power import achieved_mde

    _, rows = generate.demo_tables((ROOT / "docs" / "demo" / "comparison.md").read_text())
    delta = next(column for column in rows[0] if column.startswith("Δ vs"))
    achieved = {(row["dataset"], row["metric"]): achieved_mde(*generate.interval(row[delta])[1:])
                for row in rows if row[delta] != "—"}
    page = " ".join((ROOT / "docs" / "statistics.md").read_text().split())
    chartqa = next(row for row in rows if row["dataset"] == "chartqa_demo" and row[delta] != "—")
    low, high = generate.interval(chartqa[delta])[1:]
    assert f"interval [{low:.3f}, {high:.3f}] gives ±{achieved['chartqa_demo', 'relaxed_accuracy']:.3f}" in page
    quoted = re.search(r"\(ChartQA (\S+) against ±\S+, OCR-VQA (\S+) against ±\S+, the masked LM (\S+) against", page)
    assert quoted, "the statistics page no longer quotes the achieved MDEs; update this test"
    assert [float(value) for value in quoted.groups()] == [
        round(achieved[key], 2) for key in (("chartqa_demo", "relaxed_accuracy"), ("ocrvqa_demo", "exact_match"),
                                            ("corpus_demo", "masked_accuracy"))]


def test_every_key_of_the_schema_is_described():
    """The reference is only as good as the schema's descriptions: a new key comes with one."""
    undescribed = [key.path for section, spec in SCHEMA["properties"].items()
                   for key in [generate.Key(section, spec), *generate.walk(section, spec, SCHEMA)]
                   if not generate.resolve(key.spec, SCHEMA).get("description")]
    assert undescribed == []


def test_the_generator_reads_the_comparison_that_compare_writes(tmp_path):
    """`make demo-docs` feeds the generator compare's own comparison.md: its tables are the README's block,
    and the lines compare writes after them (achieved MDEs, method, fairness) stay out."""
    from test_compare import correct, run, write_experiment

    root = tmp_path / "results"
    for seed, (base_k, mtup_k) in {1: (10, 16), 2: (12, 18)}.items():
        write_experiment(root, "chart", "baseline", seed, correct(base_k))
        write_experiment(root, "chart", "mtup", seed, correct(mtup_k))
    write_experiment(root, "chart", "baseline", "base", correct(2))
    write_experiment(root, "chart", "mtup", "base", correct(1))
    rows, markdown = run(tmp_path, root)
    block, parsed = generate.demo_tables(markdown)
    assert [(row["dataset"], row["variant"]) for row in parsed] == [(row["dataset"], row["variant"]) for row in rows]
    assert block.startswith("| model | dataset |") and "Minimum detectable effect" not in block
    assert "Fairness" not in block and "Mean and sample standard deviation" not in block
    assert generate.demo_findings(parsed).startswith("Every dataset's trained variants beat the untrained model")
