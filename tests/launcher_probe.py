"""A torchrun worker for tests/test_launcher.py: joins the process group, reports what it sees.

Usage: python -m launcher_probe REPORT_DIR JOB_NAME PEERS  (each rank writes REPORT_DIR/JOB_NAME-rank<r>.json;
every rank then waits until PEERS other jobs have started (and while REPORT_DIR/JOB_NAME.hold exists), so the jobs provably run at the same time).
On SIGUSR1 a rank writes REPORT_DIR/JOB_NAME-rank<r>.signal and exits 75, as training does; with
PROBE_CHECKPOINT_SECONDS set it first spends that long "checkpointing" (a slow checkpoint).
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    report_dir, job, peers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    def on_signal(signum, _frame):
        time.sleep(float(os.environ.get("PROBE_CHECKPOINT_SECONDS", "0")))
        (report_dir / f"{job}-rank{rank}.signal").write_text(signal.Signals(signum).name)
        sys.exit(75)

    signal.signal(signal.SIGUSR1, on_signal)
    dist.init_process_group("gloo")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    report = {
        "rank": rank, "world_size": dist.get_world_size(), "all_reduce": total.item(), "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "master_port": os.environ.get("MASTER_PORT"),
    }
    (report_dir / f"{job}-rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        (report_dir / f"{job}.started").touch()
    # Every rank waits in Python (not in a collective), so a signal handler can run at once.
    deadline = time.monotonic() + 120
    while len(list(report_dir.glob("*.started"))) < peers + 1 or (report_dir / f"{job}.hold").exists():
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
