"""The check after a successful ``snakemake`` run (the Snakefile's ``onsuccess:``): nothing it was asked for is
still out of date.

Snakemake can finish with exit 0 while jobs that its own rules make out of date were never run: it skips the
jobs after a rerun job with an ancient() input, even those with reasons of their own (snakemake#4166), and has
left multi-output jobs with changed inputs alone (#2011, #2626). The workflow avoids the constructs known to do
so (rules/power.smk, core/experiment_set.py), and this check catches whatever is left: after the run it asks
the same DAG again which of the jobs that did not run are out of date now, and fails naming them.

``check_published`` refuses a published table whose content is no longer the one compare wrote (a hand edit:
Snakemake reruns nothing for it). The Snakefile calls it when the workflow is read as well as on success, as a
run with "Nothing to be done" ends before ``onsuccess:``.
"""
from __future__ import annotations

from typing import Any

from workflow_scripts.core import experiment_set
from workflow_scripts.core.errors import WorkflowError


def stale_jobs(workflow: Any) -> list[str]:
    """Each job of the run's DAG that did not run and is out of date now: 'rule (output, ...): reason'."""
    dag = workflow.dag
    workflow.async_run(dag.update_needrun())
    stale = []
    for job in dag.needrun_jobs():
        if job.rule.norun:  # a target rule (all): out of date only through the jobs listed
            continue
        outputs = ", ".join(sorted(map(str, job.output))[:3]) + (", ..." if len(job.output) > 3 else "")
        stale.append(f"{job.rule.name} ({outputs}): {dag.reason(job)}")
    return sorted(stale)


def check_up_to_date(workflow: Any) -> None:
    """Raise WorkflowError (Snakemake then exits non-zero) when the run left a planned target out of date."""
    stale = stale_jobs(workflow)
    if stale:
        raise WorkflowError(
            f"snakemake finished, but {len(stale)} job(s) it should have run are still out of date (a Snakemake "
            "limitation, snakemake#4166): " + "; ".join(stale) + ". Run snakemake again to bring them up to date; "
            "if they stay out of date, please report it"
        )


def check_published(stamp: str) -> None:
    """Raise WorkflowError when a table the experiment set's ``stamp`` records (results/comparison.md, .csv) was
    changed after compare wrote it."""
    edited = experiment_set.edited_outputs(stamp)
    if edited:
        raise WorkflowError(
            f"{' and '.join(edited)} changed since compare wrote {'it' if len(edited) == 1 else 'them'} (the sha256 "
            f"recorded in {stamp} no longer matches), so {'it is' if len(edited) == 1 else 'they are'} not the "
            "comparison the workflow computed, and no rerun would notice; keep your edits in another file, then delete "
            f"{' and '.join(edited)} and run snakemake again (or run it with --forcerun compare): compare writes "
            f"{'it' if len(edited) == 1 else 'them'} anew")
