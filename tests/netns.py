"""Network namespaces for tests: hosts on their own addresses behind shaped links.

`Star` builds a switched LAN: a 'hub' namespace holding a bridge, and one namespace per host joined
to it by a veth pair (`eth0` inside the host, `v<i>` on the bridge). Every host link can be shaped
with tbf on both ends' egress, i.e. in both directions. Names carry a per-test prefix that embeds the
creating process's pid, so `remove_stale` can delete what a crashed earlier run left behind without
touching namespaces of a test still running. Nothing is created in the root namespace: the veth
pairs are made inside the hub and their host ends moved straight into the host namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from procs import Procs

BASE = "adlt"  # every test namespace name starts with BASE + "<pid>-"


def available() -> str | None:
    """None when namespaces can be used here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{BASE}{os.getpid()}-probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def tc(ns: str, *args: str) -> None:
    ip("netns", "exec", ns, "tc", *args)


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete(ns: str) -> None:
    """Kill whatever still runs in `ns` (only ever processes a test started there), then delete it."""
    with contextlib.suppress(RuntimeError):
        for pid in ip("netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        ip("netns", "del", ns)


def remove_stale() -> list[str]:
    """Delete test namespaces whose creating process is gone; returns their names."""
    stale = []
    for ns in namespaces():
        if not ns.startswith(BASE):
            continue
        pid = ns[len(BASE) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.append(ns)
    for ns in sorted(stale, key=lambda n: n.endswith("-hub")):  # hosts first, then their hub
        delete(ns)
    return stale


class Star:
    """A hub bridge and `hosts` namespaces on `subnet`.1, .2, ... (a /24 given as "a.b.c")."""

    def __init__(self, hosts: int, *, subnet: str = "10.77.0", rate_mbit: float | None = None) -> None:
        self.prefix = f"{BASE}{os.getpid()}-{secrets.token_hex(3)}"
        self.hub = f"{self.prefix}-hub"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self.rate_mbit = rate_mbit
        self.created: list[str] = []
        try:
            self._build(subnet)
        except BaseException:
            self.close()
            raise

    def _build(self, subnet: str) -> None:
        for ns in (self.hub, *self.hosts):
            ip("netns", "add", ns)
            self.created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addrs, strict=True)):
            port = f"v{i}"
            ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.hub, "link", "set", port, "master", "br0")
            ip("-n", self.hub, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            if self.rate_mbit is not None:
                shape(ns, "eth0", self.rate_mbit)  # host -> hub (upload)
                shape(self.hub, port, self.rate_mbit)  # hub -> host (download)

    def close(self) -> None:
        for ns in reversed(self.created):
            delete(ns)
        self.created.clear()

    def start(self, procs: Procs, host: int, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Procs.start for a console script run inside host `host`'s namespace.

        `ip netns exec` execs the command, so the returned pid is the script's own and leads its
        process group, which `procs.reap()` kills whole.
        """
        script = str(Path(sys.executable).parent / argv[0])
        log = open(procs.log_dir / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host], script, *argv[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.started.append(proc)
        return proc

    def set_link(self, host: int, *, up: bool) -> None:
        """Take host `host`'s link down or up at the hub (its bridge port): a cable pulled and plugged
        back. The host keeps its address; its eth0 loses carrier meanwhile, so its packets go
        nowhere and its TCP connections see silence, not resets."""
        ip("-n", self.hub, "link", "set", f"v{host}", "up" if up else "down")

    def run(self, host: int, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[host], *argv], capture_output=True, text=True, timeout=timeout
        )


@contextlib.contextmanager
def star_lan(procs: Procs, hosts: int, **kwargs: Any) -> Iterator[Star]:
    """A `Star` for one test (skipped where namespaces cannot be made); at the end every process
    the test started is killed before the namespaces go, and neither may survive."""
    import pytest  # here: bench/system.py uses this module where pytest may not be installed

    why = available()
    if why is not None:
        pytest.skip(why)
    remove_stale()
    lan = Star(hosts, **kwargs)
    try:
        yield lan
    finally:
        leftover = procs.reap()  # processes out before their namespaces go
        lan.close()
        assert not leftover, f"processes survived their group's SIGKILL: {leftover}"
        assert not [ns for ns in namespaces() if ns.startswith(lan.prefix)]


def tbf(rate_mbit: float) -> list[str]:
    """tc's root qdisc for a link of `rate_mbit` Mbit/s: a token bucket, 32 KB deep, 100 ms of queue."""
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", "32kb", "latency", "100ms"]


def shape(ns: str, dev: str, rate_mbit: float) -> None:
    """`dev`'s egress at `rate_mbit` Mbit/s (`tbf`)."""
    tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf(rate_mbit))


def netns_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def wait_exec(pid: int, needle: str, timeout: float = 10) -> None:
    """Wait until `ip netns exec` has exec'd: `pid` runs a command line containing `needle`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if Path(argv[0]).name != "ip" and any(needle in arg for arg in argv):
                return
        time.sleep(0.05)
    raise TimeoutError(f"pid {pid} never ran {needle!r}")
