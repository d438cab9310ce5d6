"""Real processes for multi-peer tests: each in its own session, reaped as a whole process group.

A peer killed with SIGKILL leaves its p2pd behind (hivemind sets no parent-death signal), so tests
never rely on a peer cleaning up after itself: every process they start leads a new process group,
and teardown kills the group and checks that nothing of it survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adloco.node.cli.processes import group_members
from adloco.node.cli.progress import parse_status_lines

# A node that trains fast enough for multi-process tests on 2 cores (tiny model, short rounds).
FAST_NODE_ARGS = [
    *("--inner-steps", "3", "--seq-len", "64", "--batch-size", "4", "--max-corpus-mb", "2"),
    *("--threads", "1", "--window-s", "2", "--no-nat-port-map", "--data-shards", "4"),
    *("--control-port", "0"),  # several nodes share the machine
]


class Procs:
    """Starts console scripts as process-group leaders and reaps every group at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        script = str(Path(sys.executable).parent / argv[0])
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
        proc = subprocess.Popen(
            [script, *argv[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stacks(self, name: str, proc: subprocess.Popen[bytes], *, tail: int = 6000) -> str:
        """The tail of `name`'s log after asking the node for every thread's stack (SIGUSR1): what a
        node that seems stuck is doing, for a failing test's message."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        return self.log(name)[-tail:]

    def reap(self) -> list[int]:
        """SIGKILL every started group; returns pids that were still alive (should be none after)."""
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        leftover: list[int] = []
        while time.monotonic() < deadline:
            leftover = [pid for proc in self.started for pid in group_members(proc.pid)]
            if not leftover:
                break
            time.sleep(0.1)
        for proc in self.started:
            proc.wait(timeout=5)
        return leftover


def read_events(path: Path) -> list[dict[str, Any]]:
    """A status file's events so far: whole lines only, as the node may be writing the last one."""
    if not path.exists():
        return []
    records, bad, _ = parse_status_lines(path.read_bytes())
    assert not bad, f"malformed lines in {path}: {bad[:3]}"
    return records


def wait_for(
    predicate: Callable[[], object], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
