"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd started by hand.

There is no systemd on CI machines, so the daemons run in the foreground as our children and are
stopped by PID. State, sockets and logs live in one private directory and munged uses its own
socket. The config must sit at the default /etc/slurm/slurm.conf: the executor plugin strips
``SLURM_*`` variables (``SLURM_CONF`` included) before its nested ``srun``. A slurm.conf that these
tests did not write is never overwritten (the tests skip), and ours is removed at the end.
GPUs are declared through gres with ``AutoDetect=off`` and ``File=`` entries that point at
symlinks to /dev/null (a count without device files drains the node).

Run by hand:  python tests/slurm/cluster.py  (brings a cluster up, prints its env, waits for Ctrl-C)
"""
from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SYSTEM_CONF_DIR = Path("/etc/slurm")
MARKER = "# written by the lora-workflow test suite (tests/slurm/cluster.py); removed when it stops"
DAEMONS = ("munged", "slurmctld", "slurmd")
# One cluster per machine (it owns /etc/slurm/slurm.conf): concurrent test sessions take turns.
MACHINE_LOCK = Path(tempfile.gettempdir()) / "lora-workflow-slurm-cluster.lock"


def why_unavailable() -> str | None:
    """None when this machine can run the cluster, else the reason (used as the skip message)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "real-SLURM tests need root (they start munged, slurmctld and slurmd); CI runs them as root"
    missing = [daemon for daemon in DAEMONS if not (shutil.which(daemon) or Path(f"/usr/sbin/{daemon}").exists())]
    if missing and not shutil.which("apt-get"):
        return f"SLURM daemons {missing} are not installed and there is no apt-get to install {list(PACKAGES)}"
    conf = SYSTEM_CONF_DIR / "slurm.conf"
    if conf.exists() and MARKER not in conf.read_text(errors="replace"):
        return f"{conf} exists and was not written by these tests: this looks like a real SLURM node, left alone"
    return None


def install_packages() -> None:
    """apt-get the Debian packages if the daemons are missing (CI machines start bare)."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
                   check=True, env=env, timeout=900)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class Cluster:
    root: Path
    gpus: int
    cpus: int
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    lock_fd: int | None = None

    etc: Path = SYSTEM_CONF_DIR

    controller_address = "127.0.0.1"

    def nodes(self) -> list[tuple[str, str]]:
        """(NodeName, NodeAddr) of every slurmd: here one, this machine."""
        return [(self.host, "127.0.0.1")]

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Environment for clients (sbatch, squeue, snakemake) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- configuration ---------------------------------------------------------------------
    def write_config(self) -> None:
        etc = self.etc
        dev, state, spool, logs = (self.root / d for d in ("dev", "state", "spool", "log"))
        for directory in (etc, dev, state, logs, *(spool / name for name, _ in self.nodes())):
            directory.mkdir(parents=True, exist_ok=True)
        for index in range(self.gpus):
            link = dev / f"nvidia{index}"
            if not link.exists():
                link.symlink_to("/dev/null")
        socket_path = self.root / "munge" / "munge.socket"
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        node_lines = "\n".join(f"NodeName={name} NodeAddr={address} CPUs={self.cpus} RealMemory=128000{gres} State=UNKNOWN"
                               for name, address in self.nodes())
        (etc / "slurm.conf").write_text(f"""\
{MARKER}
ClusterName=loratest
SlurmctldHost={self.host}({self.controller_address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={state}
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.%n.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes by ancestry, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Refuse at submission what the partition can never run (e.g. 2 nodes here) instead of queueing it forever.
EnforcePartLimits=ALL
GresTypes=gpu
# Without slurmdbd, finished jobs are only visible to squeue for MinJobAge seconds: keep them
# long enough for the executor plugin's squeue status queries.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=15
ReturnToService=2
# The node may declare more CPUs than a small CI machine has, so several jobs run at once.
SlurmdParameters=config_overrides
{node_lines}
PartitionName=debug Nodes={",".join(name for name, _ in self.nodes())} Default=YES MaxTime=INFINITE State=UP
""")
        (etc / "gres.conf").write_text(
            f"{MARKER}\nAutoDetect=off\n"
            + "".join(f"NodeName={name} Name=gpu File={dev}/nvidia[0-{self.gpus - 1}]\n"
                      for name, _ in self.nodes() if self.gpus)
        )

    # -- daemons ---------------------------------------------------------------------------
    def _start_munge(self) -> None:
        munge_dir = self.root / "munge"
        munge_dir.mkdir(exist_ok=True)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        user = pwd.getpwnam("munge")
        for path in (munge_dir, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        munge_dir.chmod(0o700)
        key.chmod(0o400)
        # munged refuses to run as root; its private dir must not be writable by others.
        self.root.chmod(0o755)
        self.processes["munged"] = subprocess.Popen(
            ["runuser", "-u", "munge", "--", _sbin("munged"), "--foreground", f"--socket={munge_dir}/munge.socket",
             f"--key-file={key}", f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
             f"--seed-file={munge_dir}/munged.seed", "--force"],
            stdout=subprocess.DEVNULL, stderr=(self.root / "log" / "munged.out").open("w"),
        )
        self._wait(lambda: (munge_dir / "munge.socket").exists(), 20, "munged did not create its socket")

    def _start(self, name: str) -> None:
        log = (self.root / "log" / f"{name}.out").open("w")
        self.processes[name] = subprocess.Popen([_sbin(name), "-D", "-f", str(self.conf)],
                                                stdout=log, stderr=subprocess.STDOUT, env=self.env())

    def _wait(self, ready, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}: {self.logs(name)}")
            time.sleep(0.3)
        raise RuntimeError(f"{message} within {timeout} s\n{self.logs()}")

    def node_state(self) -> str:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env())
        return result.stdout.strip()

    def take_machine(self, timeout: float) -> None:
        """Wait until no other test session runs its cluster on this machine."""
        self.lock_fd = os.open(MACHINE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.lock_fd)
                    self.lock_fd = None
                    raise RuntimeError(f"another test session kept the SLURM test cluster ({MACHINE_LOCK}) "
                                       f"for more than {timeout:.0f} s") from None
                time.sleep(2)

    def start(self, wait_for_machine: float = 1800) -> None:
        self.take_machine(wait_for_machine)
        self.write_config()
        self._start_munge()
        self._start("slurmctld")
        self._wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, env=self.env()).returncode == 0,
                   30, "slurmctld did not answer")
        self.start_slurmds()
        self._wait(self.all_nodes_up, 60, "the nodes did not become idle")

    def start_slurmds(self) -> None:
        self._start("slurmd")

    def all_nodes_up(self) -> bool:
        states = self.node_state().split()
        return len(states) == len(self.nodes()) and all(s in ("idle", "mixed", "allocated") for s in states)

    def stop(self) -> None:
        """Stop the daemons by PID, newest first; kill what does not stop in time."""
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        # runuser may exit before munged does; stop munged by its own PID as well.
        pid_file = self.root / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ValueError, ProcessLookupError, PermissionError):
                pass
        for name in ("slurm.conf", "gres.conf"):
            path = self.etc / name
            if path.exists() and MARKER in path.read_text(errors="replace"):
                path.unlink()
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the next session may bring up its cluster
            self.lock_fd = None

    def logs(self, *names: str) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            if not names or any(path.name.startswith(n) for n in names):
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(out)


def start_cluster(gpus: int = 4, cpus: int = 8, root: Path | None = None) -> Cluster:
    return started(Cluster(root=Path(root or tempfile.mkdtemp(prefix="lora-slurm-")), gpus=gpus, cpus=cpus))


def started(cluster: Cluster) -> Cluster:
    """Start ``cluster``; on any failure stop what did start (and give the machine back) first."""
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


if __name__ == "__main__":
    reason = why_unavailable()
    if reason:
        sys.exit(reason)
    install_packages()
    # Background jobs ignore SIGINT: stop cleanly on SIGTERM as well.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    running = start_cluster()
    print(f"export SLURM_CONF={running.conf}", flush=True)
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        running.stop()
