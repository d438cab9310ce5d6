"""The strict mypy run of test_types.py, started at the beginning of the session in the background.

mypy --strict over the package takes ~40 s of one core and no cache can help a fresh clone, while
most of the suite leaves the second core idle. So conftest.py starts it as the session starts (when
the test is selected) and the test collects its result. It runs at the lowest CPU priority, in its
own session so that its scheduler autogroup is niced too: the multi-process swarm tests, whose nodes
must register within a matchmaking window on two cores, take the CPU from it whenever they want it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PARTS = ("__init__.py", "errors.py", "settings.py", "protocol", "node", "dht_bootstrap")
TEST = "tests/test_types.py::test_package_is_strictly_typed"
IDLE_NICE = 19


def mypy_installed() -> bool:
    return shutil.which("mypy") is not None or (Path(sys.executable).parent / "mypy").exists()


@dataclass
class MypyRun:
    """One `mypy --strict` run over the package, writing its output into `folder`."""

    proc: subprocess.Popen[bytes]
    folder: Path

    def result(self, timeout: float) -> tuple[int, str]:
        """Its exit status and output, once it has finished (at full priority from now on)."""
        if self.proc.poll() is None:
            self._set_nice(0)  # best effort: lowering a nice value needs CAP_SYS_NICE
        code = self.proc.wait(timeout=timeout)
        out = (self.folder / "stdout").read_text() + (self.folder / "stderr").read_text()
        return code, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def _set_nice(self, nice: int) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, nice)
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(str(nice))


def start_mypy(folder: Path) -> MypyRun:
    """Start mypy --strict on the package at the lowest priority; its output goes into `folder`."""
    root = ROOT
    if not ROOT.name.isidentifier():
        # mypy names the package after the checkout's folder: give it an alias named `adloco`.
        root = folder / "adloco"
        root.symlink_to(ROOT, target_is_directory=True)
    argv = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    argv += ["--config-file", str(ROOT / "pyproject.toml"), *PACKAGE_PARTS]
    with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
        proc = subprocess.Popen(
            argv,
            cwd=root,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "MYPY_FORCE_COLOR": "0"},
            start_new_session=True,  # its own scheduler autogroup, niced with the process
            preexec_fn=_lowest_priority,  # only os calls, in the child after the fork
        )
    return MypyRun(proc, folder)


def _lowest_priority() -> None:
    """In the child, after its setsid: nice the process and, where the kernel groups sessions for
    the scheduler (autogroup), its session's group; nice only orders tasks within one group."""
    os.nice(IDLE_NICE)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(IDLE_NICE))


BACKGROUND = pytest.StashKey[MypyRun]()
