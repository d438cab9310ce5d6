"""Shared fixtures: real processes, reaped whole (see tests/procs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from background import AT_SESSION_START, STARTED, mypy_installed, strict_mypy
from procs import Procs


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
    """Starts the subprocess checks of the selected tests that only run one (mypy, the kernel-path
    comparison) as the session starts, at the lowest priority, on the core the other tests leave
    idle (tests/background.py); each test collects its run."""
    selected = {item.nodeid for item in request.session.items}
    runs = {}
    try:
        for test, start in AT_SESSION_START.items():
            if test in selected and (start is not strict_mypy or mypy_installed()):
                runs[test] = start(tmp_path_factory.mktemp("background"))
        request.config.stash[STARTED] = runs
        yield
    finally:
        for run in runs.values():
            run.stop()
