"""tests/test_train_ddp_resume.py's torchrun entry: the train stage with each micro-step slowed down,
so the test can signal the run mid-way. The training code itself is unchanged."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workflow_scripts import train  # noqa: E402
from workflow_scripts.training import training_setup  # noqa: E402
from workflow_scripts.core.errors import run_main  # noqa: E402

_micro_step = training_setup.micro_step


def slowed_micro_step(*args, **kwargs):
    time.sleep(0.1)
    return _micro_step(*args, **kwargs)


training_setup.micro_step = slowed_micro_step

if __name__ == "__main__":
    run_main(train.main)
