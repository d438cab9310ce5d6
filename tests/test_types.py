"""The whole package type-checks under mypy --strict (STYLE 10), straight from the source tree.

The repository root is the package (pyproject maps `adloco` to it) and every import inside it is
relative, so mypy reads the tree as it is: it names the package after the checkout's folder. Only a
checkout whose folder name is not a Python identifier (e.g. `adloco-node`) needs an alias named
`adloco` pointing at it; the modules checked are the same files either way. The run starts with the
session, in the background at the lowest priority (tests/background.py); run alone, this test waits
for it all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from background import collect, mypy_installed, strict_mypy


@pytest.mark.timeout(300)
def test_package_is_strictly_typed(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not mypy_installed():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    run = collect(request, request.node.nodeid, lambda: tmp_path, strict_mypy)
    returncode, stdout, stderr = run.result(timeout=280)
    assert returncode == 0, stdout + stderr
