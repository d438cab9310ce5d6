"""Shared fixtures: real processes, reaped whole (see tests/procs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from background import AT_SESSION_START, STARTED, mypy_installed, strict_mypy, wanted
from procs import Procs

# Tests that only collect a long background run (tests/background.py) and would otherwise come early
# in the session: last, so that their run has had the whole session to finish on the idle core.
COLLECT_LAST = (
    "tests/test_bench.py::test_quick_run_writes_every_key_of_results_json_and_a_report_of_the_goals",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [item for item in items if item.nodeid in COLLECT_LAST]
    items[:] = [item for item in items if item.nodeid not in COLLECT_LAST] + last


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        leftover = p.reap()
        assert not leftover, f"processes survived their group's SIGKILL: {leftover}"


@pytest.fixture(scope="session", autouse=True)
def checks_in_the_background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Starts the long CPU-bound jobs the selected tests need (mypy, the kernel-path comparison, the
    simulator scenarios) as the session starts, at the lowest priority, on the core the other tests
    leave idle (tests/background.py); each test or fixture collects its run."""
    runs = {}
    try:
        for key, start in AT_SESSION_START.items():
            if wanted(key, request.session.items) and (start is not strict_mypy or mypy_installed()):
                runs[key] = start(tmp_path_factory.mktemp("background"))
        request.config.stash[STARTED] = runs
        yield
    finally:
        for run in runs.values():
            run.stop()
