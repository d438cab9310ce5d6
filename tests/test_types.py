"""The whole package type-checks under mypy --strict (STYLE 10), straight from the source tree.

The repository root is the package (pyproject maps `adloco` to it) and every import inside it is
relative, so mypy reads the tree as it is: it names the package after the checkout's folder. Only a
checkout whose folder name is not a Python identifier (e.g. `adloco-node`) needs an alias named
`adloco` pointing at it; the modules checked are the same files either way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PARTS = ("__init__.py", "errors.py", "settings.py", "protocol", "node", "dht_bootstrap")


@pytest.mark.timeout(300)
def test_package_is_strictly_typed(tmp_path: Path) -> None:
    if shutil.which("mypy") is None and not (Path(sys.executable).parent / "mypy").exists():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    root = ROOT
    if not ROOT.name.isidentifier():
        root = tmp_path / "adloco"
        root.symlink_to(ROOT, target_is_directory=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            *PACKAGE_PARTS,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
