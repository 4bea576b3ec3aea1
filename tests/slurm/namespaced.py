"""A several-node SLURM cluster on one machine: each slurmd in its own network namespace.

Every node gets a network namespace with its own address on a bridge, its own host name (a UTS
namespace) and an /etc/hosts naming all nodes (bound over /etc/hosts in a private mount table). slurmctld and munged stay in the root namespace; munged's socket is a path, so
every namespace reaches it. Jobs, srun steps and torchrun then run "on" a node the way they would on
a real cluster: their host name, address and rendezvous are the node's. The file system is shared,
as on a cluster with a shared home.

Needs root, iproute2 (``ip``) and ``unshare``; :func:`why_unavailable` says what is missing.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cluster import Cluster, _sbin, started

BRIDGE = "lorabr0"
SUBNET = "10.231.0"
NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_unavailable() -> str | None:
    """None when network namespaces can be made here, else the reason (the skip message)."""
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"'{tool}' is not installed (iproute2 / util-linux): no network namespaces for a two-node cluster"
    probe = "lora-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here ({made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    bridge = _ip("link", "add", "lorabrprobe", "type", "bridge", check=False)
    if bridge.returncode != 0:
        return f"cannot create a bridge here ({bridge.stderr.strip()})"
    _ip("link", "del", "lorabrprobe", check=False)
    return None


@dataclass
class NamespacedCluster(Cluster):
    node_count: int = 2

    controller_address = f"{SUBNET}.1"

    def node_name(self, index: int) -> str:
        return f"lora-node{index}"

    def namespace(self, index: int) -> str:
        return f"lora-node{index}"

    def nodes(self) -> list[tuple[str, str]]:
        return [(self.node_name(i), f"{SUBNET}.{10 + i}") for i in range(1, self.node_count + 1)]

    # -- network -----------------------------------------------------------------------------
    def remove_network(self) -> None:
        """Tear down what :meth:`make_network` made (also what a killed earlier run left)."""
        for index in range(1, self.node_count + 1):
            _ip("netns", "del", self.namespace(index), check=False)
            shutil.rmtree(NETNS_ETC / self.namespace(index), ignore_errors=True)
        _ip("link", "del", BRIDGE, check=False)

    def make_network(self) -> None:
        self.remove_network()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{self.controller_address}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n" + f"{self.controller_address} {self.host}\n" + "".join(
            f"{address} {name}\n" for name, address in self.nodes())
        for index, (name, address) in enumerate(self.nodes(), start=1):
            namespace, veth = self.namespace(index), f"lorav{index}"
            _ip("netns", "add", namespace)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", veth, "master", BRIDGE)
            _ip("link", "set", veth, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / namespace / "hosts").write_text(hosts)

    # -- daemons -------------------------------------------------------------------------------
    def start(self, wait_for_machine: float = 1800) -> None:
        self.take_machine(wait_for_machine)  # the network names are per machine too
        self.make_network()
        super().start(wait_for_machine=0)

    def take_machine(self, timeout: float) -> None:
        if self.lock_fd is None:
            super().take_machine(timeout)

    def start_slurmds(self) -> None:
        for index, (name, _) in enumerate(self.nodes(), start=1):
            log = (self.root / "log" / f"slurmd-{name}.out").open("w")
            # Not `ip netns exec`: it remounts /sys, hiding /sys/fs/cgroup, and slurmd stops without
            # it. nsenter joins the network namespace; unshare gives the node its own host name and a
            # private mount table for its /etc/hosts. exec all the way down: the Popen pid is slurmd's.
            hosts = NETNS_ETC / self.namespace(index) / "hosts"
            command = ["nsenter", f"--net=/run/netns/{self.namespace(index)}", "unshare", "--uts", "--mount", "sh", "-c",
                       f"mount --bind {hosts} /etc/hosts && hostname {name} && "
                       f"exec {_sbin('slurmd')} -D -N {name} -f {self.conf}"]
            self.processes[f"slurmd-{name}"] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                                 env=self.env())

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.remove_network()


def start_namespaced_cluster(cpus: int, root: Path, nodes: int = 2) -> NamespacedCluster:
    return started(NamespacedCluster(root=root, gpus=0, cpus=cpus, node_count=nodes))
