"""The child processes of `adloco-swarm`: each started in its own session, stopped with nothing left.

For node/cli/launcher.py. Every child leads its own session, because a peer's p2pd outlives its
parent: `stop_children` sends SIGTERM to each group leader (the node shuts its DHT, averager and
p2pd down itself), waits up to 30 s, then SIGKILLs the whole group, and checks /proc that nothing of
any group is left; a group whose leader exited on its own is killed once `ORPHAN_GRACE_S` has passed
(`Child.kill_orphans`). `describe_pids`, `describe_exit` and `log_tail` put what happened into words
for the launcher's output, and tests use `group_members` to check that a group is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ...protocol.transport.procfs import live_processes

STOP_TIMEOUT_S = 30.0  # DESIGN §4: a node exits 0 within 30 s of SIGTERM
KILL_TIMEOUT_S = 10.0  # after SIGKILL only the kernel is left to wait for
ORPHAN_GRACE_S = 5.0  # a group whose leader exited: p2pd may still be on its way out
LOG_TAIL_LINES = 20


class SwarmError(Exception):
    """The swarm could not be brought up (not the user's input): `adloco-swarm: error: ...`, exit 1."""


def group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`, from /proc."""
    return [p.pid for p in live_processes() if p.group == pgid]


def find_script(name: str) -> str:
    """A console script of this installation (next to the interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise SwarmError(f"{name} not found next to {sys.executable} or on PATH; is adloco-node installed?")
    return found


def describe_pids(pids: Sequence[int]) -> str:
    """`123 (p2pd), 456 (python3)`: what each pid is, from /proc."""
    names = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "gone"
        names.append(f"{pid} ({name})")
    return ", ".join(names)


def describe_exit(code: int) -> str:
    """Popen's return code in words: `2`, or `-9 (SIGKILL)` for a death by signal."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"    (no log: {e.strerror})"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


@dataclass
class Child:
    """A started process that leads its own session (pgid == pid), with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    orphaned_at: float | None = None
    killed: bool = False

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log_path: Path) -> Child:
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return cls(name, proc, log_path, log_file)

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def members(self) -> list[int]:
        self.proc.poll()  # reap the leader so it does not linger as a zombie
        return group_members(self.proc.pid)

    def kill_orphans(self) -> None:
        """SIGKILL the group once its leader has been gone for ORPHAN_GRACE_S (e.g. a p2pd left behind)."""
        if self.proc.returncode is None or self.killed:
            return
        if self.orphaned_at is None:
            self.orphaned_at = time.monotonic()
        elif time.monotonic() - self.orphaned_at > ORPHAN_GRACE_S and (left := self.members()):
            print(f"[{self.name}] exited but left {describe_pids(left)} running: SIGKILL", flush=True)
            self.signal_group(signal.SIGKILL)
            self.killed = True


def stop_children(children: Sequence[Child], *, hurry: threading.Event) -> list[int]:
    """SIGTERM each leader, wait up to STOP_TIMEOUT_S, SIGKILL what is left of each group.

    Only the leader gets SIGTERM: hivemind's DHT and averager processes and p2pd share its group and
    must stay up while the node leaves the swarm and writes its checkpoint. What a leader leaves behind
    when it exits has no one left to stop it and is killed after ORPHAN_GRACE_S. Returns the pids
    still alive after the SIGKILL (should be none).
    """
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    live = _live(children)
    while live and time.monotonic() < deadline and not hurry.is_set():
        for child in live:
            child.kill_orphans()
        time.sleep(0.1)
        live = _live(children)
    for child in live:
        print(f"[{child.name}] still running {STOP_TIMEOUT_S:.0f}s after SIGTERM: SIGKILL", flush=True)
        child.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while _live(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=1)
        child.log_file.close()
    return [pid for child in children for pid in child.members()]


def _live(children: Sequence[Child]) -> list[Child]:
    return [child for child in children if child.members()]
