"""Shared fixtures: real processes, reaped whole (see tests/procs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import Procs
from typecheck import BACKGROUND, TEST, mypy_installed, start_mypy


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        leftover = p.reap()
        assert not leftover, f"processes survived their group's SIGKILL: {leftover}"


@pytest.fixture(scope="session", autouse=True)
def strict_mypy_in_the_background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Starts test_types.py's mypy run as the session starts, if that test is selected, so that it
    runs on the core the other tests leave idle (tests/typecheck.py); the test collects it."""
    if not mypy_installed() or not any(item.nodeid == TEST for item in request.session.items):
        yield
        return
    run = start_mypy(tmp_path_factory.mktemp("mypy"))
    request.config.stash[BACKGROUND] = run
    try:
        yield
    finally:
        run.stop()
