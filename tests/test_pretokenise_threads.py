"""pretokenise asks Snakemake for the tokenizer's cores only when its normalised data are worth them
(rules/common.smk: pretokenise_threads): below 4 MiB it takes one core, so the other cores run other jobs
during its start-up (the demo's 12 pretokenise jobs held both of 2 cores for ~70 s). Dry runs in a fork."""
from __future__ import annotations

import re

from test_dag import absolute_demo_config, config_file
from test_dry_run_families import dry_run
from test_gate_once import make_finished


def pretokenise_threads(workdir, config) -> set[str]:
    code, output = dry_run(workdir, "-n", "-p", "--forcerun", "pretokenise", "--configfile",
                           str(config_file(workdir, config)), "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    return set(re.findall(r"python -m workflow_scripts\.pretokenise .*? --threads (\S+)", output))


def test_small_data_take_one_core_and_large_data_the_tokenizers_pool(tmp_path):
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    make_finished(tmp_path, output)  # the normalised data exist (a few bytes), as after normalise
    assert pretokenise_threads(tmp_path, config) == {"1"}
    (tmp_path / "results/data/amr_demo/normalised/train.arrow").write_bytes(b"\0" * (5 * 2**20))
    assert pretokenise_threads(tmp_path, config) == {"2"}  # 8, scaled down to --cores 2
