"""The whole package and its tests type-check under mypy --strict (STYLE 10), straight from the
source tree, for the lowest Python the package supports (pyproject's `python_version`).

The repository root is the package (pyproject maps `adloco` to it) and every import inside it is
relative, so mypy reads the tree as it is: it names the package after the checkout's folder. The
tests import it as `adloco`, so the run starts in an alias of that name (`background.strict_mypy`);
the modules checked are the same files either way. bench/, which the tests import from, is not
checked (`adloco.bench.*` is followed silently). Type-checking the tests keeps a fault-injection
patch honest: a monkeypatch whose signature went stale made two tests pass with the checks they
were about deleted (issue 25). The run starts with the session, in the background at the lowest
priority (tests/background.py); run alone, this test waits for it all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from background import collect, mypy_installed, strict_mypy


@pytest.mark.timeout(300)
def test_package_and_tests_are_strictly_typed(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not mypy_installed():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    run = collect(request, request.node.nodeid, lambda: tmp_path, strict_mypy)
    returncode, stdout, stderr = run.result(timeout=280)
    assert returncode == 0, stdout + stderr
