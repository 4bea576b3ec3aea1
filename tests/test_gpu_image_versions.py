"""What the GPU image's older versions (torch 2.11, the oldest the project supports) lack, met on CPU.

The first `make gpu-check` runs on the image's own torch: an option or function that only a newer torch has
fails there, in every launch, and costs the lent minutes. These run under whichever torch is installed
(CI: the project's pins; the issue-24 check: torch 2.11.0, transformers 5.17.0, peft 0.21.0).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from workflow_scripts.launch import launcher


def test_this_torchs_torchrun_accepts_the_launchers_command():
    """torch 2.11's torchrun refused --shutdown-timeout (added later): every GPU stage launch failed there."""
    from torch.distributed.run import get_args_parser

    command = launcher.torchrun_command("workflow_scripts.train", ["--seed", "1"], nproc=1, rendezvous_port=29500,
                                        grace_seconds=270)
    options = command[command.index("--nnodes"):]
    parsed = get_args_parser().parse_args(options)  # exits (SystemExit 2) on an option this torchrun lacks
    assert parsed.training_script == "workflow_scripts.train" and parsed.module


@pytest.mark.parametrize("supported", [True, False])
def test_the_grace_option_goes_only_to_a_torchrun_that_takes_it(monkeypatch, capsys, supported):
    monkeypatch.setattr(launcher, "torchrun_has_shutdown_timeout", lambda: supported)
    options = launcher.signal_handling(270)
    assert ("--shutdown-timeout" in options) is supported
    assert options[:4] == ["--max-restarts", "0", "--signals-to-handle", ",".join(launcher.FORWARDED_SIGNALS)]
    assert ("no --shutdown-timeout" in capsys.readouterr().err) is not supported


def test_the_probe_reads_the_installed_torchrun():
    from torch.distributed.run import get_args_parser

    options = {option for action in get_args_parser()._actions for option in action.option_strings}
    assert launcher.torchrun_has_shutdown_timeout() is ("--shutdown-timeout" in options)


def test_the_probe_imports_no_torch():
    """The launcher (the rule's torchrun command) reads torchrun's source: asking torch for it would cost a
    torch import in every launch."""
    import subprocess
    import sys

    probe = ("import sys; from workflow_scripts.launch import launcher; launcher.torchrun_has_shutdown_timeout(); "
             "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)  # this checkout's workflow_scripts
    assert done.stdout.strip() == "[]", done.stdout
