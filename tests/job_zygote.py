"""The suite's Snakemake jobs started from one pre-loaded interpreter (a "zygote"), not from a fresh one each.

Why: every job of a rule is ``python -m workflow_scripts.<stage>``, and a fresh interpreter spends ~5 s of CPU
importing torch, transformers, peft and datasets before the stage does anything: with the suite's ~600 jobs that
was most of ``make test``'s time on a 2-core machine. Here one interpreter per test worker imports them once
(a fresh process, started by :func:`start`: no test's state, monkeypatches or torch threads in it) and forks a
child per job; the child takes the job's working directory, environment, arguments and standard streams and runs
the stage module as ``python -m`` would (``runpy``, ``__main__``, atexit handlers, the exit code).

How a job reaches it: :mod:`snakemake_fork` points the Snakemake run's ``sys.executable`` at a folder whose
``python`` is :data:`SHIM` (the rules put that folder first on ``PATH``). The shim hands the zygote only
``-m workflow_scripts.<stage>``; anything else (``-m snakemake``, ``-c``, torchrun's workers, which use the
child's real ``sys.executable``) becomes the real interpreter by ``exec``, as does a job whose environment
differs from the zygote's in a variable that libraries read when imported (:data:`IMPORT_TIME_VARIABLES`).
The shim forwards signals to the job and exits as it did (its code, or the signal that ended it); a job whose
shim is killed kills itself.

What it does not give: a fresh hash seed per job (the children share the zygote's, as the forked Snakemake
runs share the test process's; tests/test_hash_seed.py plans the demo under two seeds in fresh interpreters).
The SLURM tests, the lint test and the demo start every job in a fresh interpreter;
``LORA_WORKFLOW_FRESH_JOBS=1`` does so here too.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

SOCKET_VARIABLE = "LORA_WORKFLOW_JOB_ZYGOTE"
MODULES_VARIABLE = "LORA_WORKFLOW_JOB_ZYGOTE_MODULES"  # the module prefixes it serves (its own tests add one)
FRESH_JOBS_VARIABLE = "LORA_WORKFLOW_FRESH_JOBS"
# Read by libraries when they are imported (huggingface_hub's, datasets' and transformers' constants, the hash seed):
# the zygote imported them under its own environment, so a job whose value differs starts a fresh interpreter.
# Variables read when first used (OMP_NUM_THREADS, TOKENIZERS_PARALLELISM, CUDA_VISIBLE_DEVICES, ...) reach the
# job through its own environment, which the child takes before the stage runs.
IMPORT_TIME_VARIABLES = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "PYTHONHASHSEED", "PYTHONWARNINGS")
PRELOAD = ("torch", "numpy", "yaml", "safetensors.torch", "PIL.Image", "datasets", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama", "peft",
           "accelerate")

SHIM = '''#!{python} -S
# Test-only (tests/job_zygote.py): `python -m workflow_scripts.<stage>` run by the pre-loaded zygote.
import json, os, signal, socket, struct, sys
REAL = {python!r}
argv = sys.argv[1:]
path = os.environ.get({variable!r})
served = tuple(os.environ.get({modules!r}, "workflow_scripts.").split(","))
if not path or len(argv) < 2 or argv[0] != "-m" or not argv[1].startswith(served):
    os.execv(REAL, [REAL, *argv])
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    connection.connect(path)
except OSError:
    os.execv(REAL, [REAL, *argv])
request = json.dumps({{"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
try:
    socket.send_fds(connection, [struct.pack("!I", len(request)) + request], [0, 1, 2])
except OSError:  # a standard stream closed: a fresh interpreter
    os.execv(REAL, [REAL, *argv])
def receive(size):
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            sys.exit(1)
        data += chunk
    return data
connection.settimeout(300)  # the zygote answers at once; past this it is stuck: fail loudly, never run twice
try:
    pid = struct.unpack("!i", receive(4))[0]
except socket.timeout:
    sys.exit("tests/job_zygote.py: the zygote did not answer in 300 s (LORA_WORKFLOW_FRESH_JOBS=1 avoids it)")
connection.settimeout(None)
if pid == 0:  # the zygote declined it (its environment differs): a fresh interpreter
    os.execv(REAL, [REAL, *argv])
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(number, lambda number, frame: os.kill(pid, number))
status = struct.unpack("!i", receive(4))[0]
if os.WIFSIGNALED(status):  # end as the job ended: by its signal
    number = os.WTERMSIG(status)
    if number not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def _relevant(environment: dict) -> dict:
    return {key: value for key, value in environment.items() if key.startswith(IMPORT_TIME_VARIABLES)}


def _receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _flags, _address = socket.recv_fds(connection, 1 << 20, 3)
    size = struct.unpack("!I", message[:4])[0]
    data = message[4:]
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the shim went away")
        data += chunk
    return json.loads(data), list(fds)


def _run_job(connection: socket.socket, request: dict, fds: list[int], set_by_imports: dict) -> None:
    """In the forked child: become the job, run its module as ``python -m`` does, exit with its code."""
    import runpy
    import threading
    import traceback

    os.setpgid(0, 0)  # its own group: a signal to it reaches what it starts (torchrun's workers) only via it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})  # as a fresh interpreter's imports would set them
    argv = request["argv"]
    module = argv[1]
    for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
        sys.path.insert(0, entry)
    sys.path.insert(0, request["cwd"])  # as `python -m` puts the working directory first
    for signal_number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signal_number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def die_with_the_shim():  # the shim killed (SIGKILL cannot be forwarded): no job left behind
        try:
            while connection.recv(64):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=die_with_the_shim, daemon=True).start()
    sys.argv = [module, *argv[2:]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as error:
        if error.code is None:
            code = 0
        elif isinstance(error.code, int):
            code = error.code
        else:
            print(error.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def serve(path: str, parent: int) -> None:
    """The zygote: import the heavy libraries once, then fork a child per job until the test worker is gone."""
    import gc
    import importlib
    import select

    own = _relevant(dict(os.environ))  # before the imports, which set some (torch: TORCHINDUCTOR_CACHE_DIR)
    before = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # the loaded libraries out of the collector's sight: children copy fewer pages on write
    set_by_imports = {key: value for key, value in os.environ.items() if before.get(key) != value}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable only once everything is loaded
    listener.listen(64)
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            connection, _ = listener.accept()
            connection.settimeout(10)  # a shim that dies mid-request must not stall every later job
            try:
                request, fds = _receive_request(connection)
            except (OSError, ValueError, ConnectionError):
                connection.close()
                continue
            connection.settimeout(None)
            if _relevant(request["env"]) != own:
                try:
                    connection.sendall(struct.pack("!i", 0))
                except OSError:
                    pass
                connection.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in running.values():
                    other.close()
                _run_job(connection, request, fds, set_by_imports)
            for fd in fds:
                os.close(fd)
            try:
                connection.sendall(struct.pack("!i", pid))
            except OSError:  # the shim is gone: its job notices (die_with_the_shim) and ends
                pass
            running[pid] = connection
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = running.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(struct.pack("!i", status))
                except OSError:
                    pass
                connection.close()


_started: dict[str, object] = {}


def start() -> Path | None:
    """This test worker's zygote (started on first use, not waited for) -> the folder holding its ``python``
    shim, or None when ``LORA_WORKFLOW_FRESH_JOBS=1`` or the platform has no fork."""
    if os.environ.get(FRESH_JOBS_VARIABLE) == "1" or not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return None
    if "shim_dir" not in _started:
        folder = Path(tempfile.mkdtemp(prefix="lora-workflow-zygote-"))
        path = str(folder / "socket")
        process = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
                                    f"import job_zygote; job_zygote.serve({path!r}, {os.getpid()})"],
                                   stdin=subprocess.DEVNULL)
        shim = folder / "python"
        shim.write_text(SHIM.format(python=sys.executable, variable=SOCKET_VARIABLE, modules=MODULES_VARIABLE))
        shim.chmod(0o755)

        def stop():
            process.kill()
            process.wait()
            for name in ("python", "socket"):
                (folder / name).unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass

        atexit.register(stop)
        _started.update(shim_dir=folder, socket=path, process=process)
    # No wait: until the zygote listens (~5 s of imports) a job's shim finds no socket and runs a fresh interpreter.
    return _started["shim_dir"]
