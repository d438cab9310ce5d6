"""Network namespaces for benchmarks: peers on hosts of their own, and the bytes each host's link moved.

Two layouts, both built from scratch and deleted whole by `close()` (every process still inside is
killed first):
- `Loopback`: one namespace whose only interface is its own `lo`: the peers share it on 127.0.0.1,
  isolated from the machine's other traffic, so `lo`'s counters are exactly what they sent.
- `Star`: a hub namespace bridging `hosts` namespaces, each joined by a veth pair (`eth0` inside the
  host) optionally shaped with tbf on both ends' egress, i.e. upload and download, as
  tests/netns.py builds it (this module adds the loopback layout and the link counters, and needs
  neither pytest nor tests/ on the path).

Names are `adlb<pid>-<random>`: `remove_stale` deletes the ones whose creating process is gone (a
crashed earlier run) and never touches a live run's. Needs root and iproute2 (`available()`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

BASE = "adlb"
# Ethernet (14) + IPv4 (20) + TCP with the timestamp option Linux sends by default (32): the headers
# of one counted packet. `LinkCount.payload` subtracts them per packet (a GSO packet counts once
# and carries one header, so the subtraction holds with or without segmentation offload).
TCP_HEADER_BYTES = 66


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{BASE}{os.getpid()}-probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete(ns: str) -> None:
    """Kill whatever still runs in `ns` (only processes a benchmark started there), then delete it."""
    with contextlib.suppress(RuntimeError):
        for pid in ip("netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        ip("netns", "del", ns)


def remove_stale() -> list[str]:
    """Delete benchmark namespaces whose creating process is gone; returns their names."""
    stale = []
    for line in ip("netns", "list").splitlines():
        ns = line.split()[0] if line.strip() else ""
        pid = ns[len(BASE) :].split("-", 1)[0] if ns.startswith(BASE) else ""
        if pid.isdigit() and not _pid_alive(int(pid)):
            stale.append(ns)
    for ns in sorted(stale, key=lambda n: n.endswith("-hub")):  # hosts first, then their hub
        delete(ns)
    return stale


def shape(ns: str, dev: str, rate_mbit: float) -> None:
    """Token bucket on `dev`'s egress: `rate_mbit` Mbit/s, a 32 KB bucket, 100 ms of queue."""
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "32kb", "latency", "100ms"]
    ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)


@dataclass(frozen=True)
class LinkCount:
    """One interface's counters: bytes and packets sent (tx) and received (rx)."""

    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    rx_packets: int

    def __sub__(self, other: LinkCount) -> LinkCount:
        return LinkCount(
            self.tx_bytes - other.tx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_bytes - other.rx_bytes,
            self.rx_packets - other.rx_packets,
        )

    @property
    def tx_payload(self) -> int:
        """Bytes sent less the Ethernet/IP/TCP headers of each packet: what TCP carried."""
        return self.tx_bytes - TCP_HEADER_BYTES * self.tx_packets

    @property
    def rx_payload(self) -> int:
        return self.rx_bytes - TCP_HEADER_BYTES * self.rx_packets


def link_count(ns: str, dev: str) -> LinkCount:
    stats = json.loads(ip("-n", ns, "-j", "-s", "link", "show", "dev", dev))[0]["stats64"]
    return LinkCount(
        stats["tx"]["bytes"], stats["tx"]["packets"], stats["rx"]["bytes"], stats["rx"]["packets"]
    )


class Lan:
    """Namespaces made by one benchmark run; `hosts[i]` is where peer i runs, at `addrs[i]`."""

    def __init__(self) -> None:
        self.prefix = f"{BASE}{os.getpid()}-{secrets.token_hex(3)}"
        self.created: list[str] = []
        self.hosts: list[str] = []
        self.addrs: list[str] = []

    def _add(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def exec_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host` (`ip netns exec` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def counts(self) -> list[LinkCount]:
        """Each host's link counters, in host order."""
        raise NotImplementedError

    def close(self) -> None:
        for ns in reversed(self.created):
            delete(ns)
        self.created.clear()

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Loopback(Lan):
    """`hosts` peers in one namespace on 127.0.0.1; `counts()` gives its `lo` once (all peers)."""

    def __init__(self, hosts: int) -> None:
        super().__init__()
        try:
            self._add(f"{self.prefix}-lo")
        except BaseException:
            self.close()
            raise
        self.hosts = [self.created[0]] * hosts
        self.addrs = ["127.0.0.1"] * hosts

    def counts(self) -> list[LinkCount]:
        return [link_count(self.created[0], "lo")]


class Star(Lan):
    """A hub bridge and `hosts` namespaces on `subnet`.1, .2, ...; `counts()` gives each host's eth0."""

    def __init__(self, hosts: int, *, subnet: str = "10.78.0", rate_mbit: float | None = None) -> None:
        super().__init__()
        self.rate_mbit = rate_mbit
        try:
            self._build(hosts, subnet)
        except BaseException:
            self.close()
            raise

    def _build(self, hosts: int, subnet: str) -> None:
        hub = f"{self.prefix}-hub"
        self._add(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for i in range(hosts):
            ns, addr, port = f"{self.prefix}-h{i}", f"{subnet}.{i + 1}", f"v{i}"
            self._add(ns)
            self.hosts.append(ns)
            self.addrs.append(addr)
            ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", hub, "link", "set", port, "master", "br0")
            ip("-n", hub, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            if self.rate_mbit is not None:
                shape(ns, "eth0", self.rate_mbit)  # host -> hub (upload)
                shape(hub, port, self.rate_mbit)  # hub -> host (download)

    def counts(self) -> list[LinkCount]:
        return [link_count(ns, "eth0") for ns in self.hosts]
