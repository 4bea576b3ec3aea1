"""A job for tests/test_job_zygote.py: reports what it was given, then acts as its arguments say."""
import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    action = sys.argv[1]
    if action == "wait":  # until SIGTERM (handled before it reports, so the test's signal finds the handler)
        signal.signal(signal.SIGTERM, lambda number, frame: (open(sys.argv[2], "w").write("terminated"), sys.exit(7)))
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
               "marker": os.environ.get("PROBE_MARKER"), "stdin": sys.stdin.read() if action == "echo" else "",
               "name": __name__, "path0": sys.path[0], "torch_loaded": "torch" in sys.modules}, sys.stdout)
    print()
    sys.stdout.flush()
    print("to stderr", file=sys.stderr)
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise RuntimeError("planted")
    if action == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "wait":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
