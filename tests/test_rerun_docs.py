"""docs/reruns.md's table of what each change reruns is generated from core/config_reads.py (issue 35)."""
from __future__ import annotations

import pytest

from data_helpers import ROOT
from workflow_scripts.core import config_reads


@pytest.mark.parametrize("page", ["docs/reruns.md", "README.md"])
def test_the_rerun_table_in_docs_is_the_generated_one(page):
    text = (ROOT / page).read_text()
    assert "<!-- rerun-table:start -->" in text, f"{page} lost its rerun table"
    assert config_reads.replace_table_block(text) == text, (
        f"{page}'s rerun table is stale: run python -m workflow_scripts.core.config_reads docs/reruns.md README.md")


def test_a_stale_table_is_seen(monkeypatch):
    text = (ROOT / "docs" / "reruns.md").read_text()
    monkeypatch.setitem(config_reads.READS, "compare", (*config_reads.READS["compare"], "tracking"))
    assert config_reads.replace_table_block(text) != text


def test_the_table_covers_the_kinds_of_change_the_issue_names():
    kinds = " ".join(kind for kind, _, _ in config_reads.rerun_table())
    for word in ("seed", "field mapping", "template", "training setting", "evaluation setting", "metric",
                 "comparison setting", "tracking"):
        assert word in kinds, word


def test_stages_reading_answers_for_schema_paths():
    assert config_reads.stages_reading("datasets.*.fields") == ("download", "normalise")
    assert "compare" not in config_reads.stages_reading("datasets.*.also_metrics")
    assert set(config_reads.stages_reading("datasets.*.also_metrics")) >= {"evaluate", "evaluate_base"}
    assert config_reads.stages_reading("training.lora.rank") == ("sanity", "train")
    assert config_reads.stages_reading("model.tiny.hidden_size") == ("prepare_model",)
    assert config_reads.stages_reading("tracking.mlflow.enabled") == ()
    assert config_reads.stages_reading("seeds") == ()
    assert "power" not in config_reads.stages_reading("seeds")


def test_every_schema_leaf_is_read_by_a_stage_decides_the_plan_or_is_read_at_run_time():
    """A new key comes with its readers: one that no stage declares would reach no stage at all (each stage gets
    only the keys the table gives it), so its setting would be silently dropped. Seen failing when the encoding,
    duplicates and pixel-budget keys joined the schema without an entry here."""
    from test_rerun_matrix import schema_leaves

    unread = [leaf for leaf in sorted(schema_leaves()) if not config_reads.stages_reading(leaf)
              and not config_reads.plan_key(leaf) and not config_reads.runtime_stages_reading(leaf)]
    assert unread == [], f"declare the stages that read these keys in workflow_scripts/core/config_reads.py: {unread}"
