"""The whole package type-checks under mypy --strict (STYLE 10), straight from the source tree.

The repository root is the package (pyproject maps `adloco` to it) and every import inside it is
relative, so mypy reads the tree as it is: it names the package after the checkout's folder. Only a
checkout whose folder name is not a Python identifier (e.g. `adloco-node`) needs an alias named
`adloco` pointing at it; the modules checked are the same files either way. The run starts with the
session, in the background at the lowest priority (tests/typecheck.py); run alone, this test waits
for it all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from typecheck import BACKGROUND, mypy_installed, start_mypy


@pytest.mark.timeout(300)
def test_package_is_strictly_typed(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not mypy_installed():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    run = request.config.stash.get(BACKGROUND, None)
    if run is None:  # selected by a name conftest.py did not recognize: run it now
        run = start_mypy(tmp_path)
    returncode, output = run.result(timeout=280)
    assert returncode == 0, output
