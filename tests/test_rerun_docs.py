"""docs/reruns.md's table of what each change reruns is generated from core/config_reads.py (issue 35)."""
from __future__ import annotations

from data_helpers import ROOT
from workflow_scripts.core import config_reads


def test_the_rerun_table_in_docs_is_the_generated_one():
    text = (ROOT / "docs" / "reruns.md").read_text()
    assert config_reads.replace_table_block(text) == text, (
        "docs/reruns.md's rerun table is stale: run python -m workflow_scripts.core.config_reads docs/reruns.md")


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
