"""Subprocess checks that start with the session, in the background, and are collected by their tests.

A few tests (or module fixtures) only run a long CPU-bound job and check what it produced: mypy
--strict over the package (~40 s of one core; no cache can help a fresh clone), the kernel-path
comparison (bench/kernel_paths.py, ~25 s of fresh processes), the simulator scenarios of
test_sim.py (~65 s), `adloco-bench --quick` (~90 s) and the container image's build (~50 s, pip
inside podman). One scenario starts with them at normal priority: test_faults.py's node cut off for
a minute (~100 s, mostly waiting). Most of the suite leaves the second core
idle, so conftest.py starts these as
the session starts (those a selected test needs) and the test or fixture collects its run's result.
They run at the lowest CPU priority, each in its own session so that its scheduler autogroup is
niced too (nice only orders tasks within one autogroup): the multi-process swarm tests, whose nodes
must register within a matchmaking window on two cores, take the CPU from them whenever they want
it. Once a test waits for its run, the run gets back its normal priority (where the test may raise
it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
IDLE_NICE = 19
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_GRACE_S = 20.0


@dataclass
class NicedRun:
    """One subprocess at the lowest priority, its output in files in `folder`."""

    proc: subprocess.Popen[bytes]
    folder: Path

    def result(self, timeout: float) -> tuple[int, str, str]:
        """Its exit status, stdout and stderr once it has finished (at normal priority from now on)."""
        if self.proc.poll() is None:
            self._set_nice(0)  # best effort: lowering a nice value needs CAP_SYS_NICE
        code = self.proc.wait(timeout=timeout)
        return code, (self.folder / "stdout").read_text(), (self.folder / "stderr").read_text()

    def stop(self) -> None:
        """SIGTERM to its group (a scenario reaps its own processes and namespaces), SIGKILL after
        STOP_GRACE_S."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)

    def _set_nice(self, nice: int) -> None:
        with contextlib.suppress(OSError):  # every thread of every process of its group
            os.setpriority(os.PRIO_PGRP, self.proc.pid, nice)
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(str(nice))


def start_background(
    argv: list[str],
    folder: Path,
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    nice: int = IDLE_NICE,
) -> NicedRun:
    """Start `argv` at priority `nice` (by default the lowest) in a new session; stdout and stderr go
    into `folder`. `env` is the child's whole environment (default: ours)."""
    with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            env=dict(os.environ) if env is None else env,
            start_new_session=True,  # its own scheduler autogroup, niced with the process
            preexec_fn=lambda: _in_the_child(nice),  # only os calls, in the child after the fork
        )
    return NicedRun(proc, folder)


def _in_the_child(nice: int) -> None:
    """After its setsid: nice the process and, where the kernel groups sessions for the scheduler
    (autogroup), its session's group; and end with pytest, should pytest be killed (its own
    session keeps it from the terminal's signals, and a killed pytest runs no finalizer): SIGTERM,
    so that a scenario still reaps what it started."""
    if nice:
        os.nice(nice)
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(str(nice))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# ---- the runs -----------------------------------------------------------------------------------

PACKAGE_PARTS = ("__init__.py", "errors.py", "settings.py", "protocol", "node", "dht_bootstrap")
KERNEL_PATHS = ROOT / "bench" / "kernel_paths.py"
AVERAGER_TEST_MARK = "ADLOCO_AVERAGER_TEST_"  # test_averager_contract.py's p2pd marker
KERNEL_VARIANTS = "reference,aten-default,threads-1,threads-3,mkl-compatible"


def mypy_installed() -> bool:
    return shutil.which("mypy") is not None or (Path(sys.executable).parent / "mypy").exists()


def strict_mypy(folder: Path) -> NicedRun:
    """mypy --strict over the package and the tests (test_types.py), its cache in `folder`.

    mypy names the package after the folder it sits in, and the tests import it as `adloco`, so the
    run starts in an alias named `adloco`; the alias's parent and tests/ (whose helpers, such as
    procs.py, the tests import by their bare names) are its search path. An alias even where the
    checkout is itself named `adloco`: there mypy also reached tests/ through the checkout's parent
    and found each helper twice, as `adloco.tests.procs` and as `procs`."""
    root = folder / "adloco"
    root.symlink_to(ROOT, target_is_directory=True)
    argv = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--no-incremental",
        "--cache-dir",
        str(folder / "cache"),
    ]
    argv += ["--config-file", str(ROOT / "pyproject.toml"), *PACKAGE_PARTS, "tests"]
    env = {"MYPY_FORCE_COLOR": "0", "MYPYPATH": f"{root.parent}:{root / 'tests'}"}
    return start_background(argv, folder, cwd=root, env=env)


def kernel_paths(folder: Path) -> NicedRun:
    """bench/kernel_paths.py on the small tensors, every variant a fresh process (test_kernel_paths.py)."""
    argv = [sys.executable, str(KERNEL_PATHS), "--size", "small", "--variants", KERNEL_VARIANTS, "--json"]
    return start_background(argv, folder)


SIM_SCENARIOS = ("sync_run", "async_runs", "overlap_runs")


def sim_scenario(name: str) -> Callable[[Path], NicedRun]:
    """test_sim.py's module fixture `name`, its simulation run by test_sim.py as a script."""

    def start(folder: Path) -> NicedRun:
        return start_background(
            [sys.executable, str(ROOT / "tests" / "test_sim.py"), name, str(folder)], folder
        )

    return start


# adloco-bench --quick but for the system section, whose real nodes in network namespaces must keep
# to matchmaking windows (tests/test_bench.py runs that one in the foreground).
BENCH_SECTIONS = "comm,convergence,heterogeneity,overhead,memory,scale"


def bench_quick(folder: Path) -> NicedRun:
    """adloco-bench --quick into folder/out (test_bench.py)."""
    argv = [sys.executable, "-m", "adloco.bench.suite", "--quick", "--out", str(folder / "out")]
    return start_background([*argv, "--sections", BENCH_SECTIONS], folder)


def cut_off_run(folder: Path) -> NicedRun:
    """test_faults.py's cut-off scenario (its `cut_off` fixture): not niced, since its nodes must keep
    to their matchmaking windows; they sleep most of the time (6× slowdown), so the tests beside
    it lose little CPU. Without the averager tests' p2pd marker, which they count as their own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(AVERAGER_TEST_MARK)}
    argv = [sys.executable, str(ROOT / "tests" / "test_faults.py"), str(folder)]
    return start_background(argv, folder, env=env, nice=0)


def container_image(folder: Path) -> NicedRun:
    """test_container.py's probe and image build (its `cpu_image` fixture)."""
    return start_background([sys.executable, str(ROOT / "tests" / "test_container.py"), str(folder)], folder)


# What conftest.py starts as the session starts: a test's node id, or the name of a fixture that
# some selected test uses, -> its run.
AT_SESSION_START: dict[str, Callable[[Path], NicedRun]] = {
    "tests/test_types.py::test_package_and_tests_are_strictly_typed": strict_mypy,
    "tests/test_kernel_paths.py::test_decode_outer_step_and_codec_choice_agree_across_kernel_paths": (
        kernel_paths
    ),
    **{name: sim_scenario(name) for name in SIM_SCENARIOS},
    "tests/test_bench.py::test_quick_run_writes_every_key_of_results_json_and_a_report_of_the_goals": (
        bench_quick
    ),
    "cpu_image": container_image,
    "cut_off": cut_off_run,
}
STARTED = pytest.StashKey[dict[str, NicedRun]]()


def wanted(key: str, items: list[pytest.Item]) -> bool:
    return any(item.nodeid == key or key in getattr(item, "fixturenames", ()) for item in items)


def collect(
    request: pytest.FixtureRequest, key: str, folder: Callable[[], Path], start: Callable[[Path], NicedRun]
) -> NicedRun:
    """The run conftest.py started under `key`, or (not started: selected in a way it did not see)
    a new one in `folder()`."""
    run = request.config.stash.get(STARTED, {}).get(key)
    return run if run is not None else start(folder())


def collect_outcome(
    request: pytest.FixtureRequest,
    key: str,
    folder: Callable[[], Path],
    start: Callable[[Path], NicedRun],
    *,
    timeout: float,
) -> tuple[Path, dict[str, Any]]:
    """A scenario's folder and the outcome it wrote there (outcome.json), once it has ended; the
    test skips with the scenario's {"skip": why}, and fails if it ended otherwise than with exit 0."""
    run = collect(request, key, folder, start)
    code, _, err = run.result(timeout=timeout)
    path = run.folder / "outcome.json"
    assert code == 0 and path.is_file(), f"{key} ended with exit {code}:\n{err[-6000:]}"
    outcome: dict[str, Any] = json.loads(path.read_text())
    if outcome.get("skip"):
        pytest.skip(str(outcome["skip"]))
    return run.folder, outcome
