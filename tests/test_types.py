"""protocol/ type-checks under mypy --strict (STYLE 10).

The folders are installed under the `adloco` namespace through setuptools' package-dir mapping,
which mypy cannot follow in an editable install, so the check runs on a throwaway tree of symlinks
shaped like the installed package.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_protocol_is_strictly_typed(tmp_path: Path) -> None:
    if shutil.which("mypy") is None and not (Path(sys.executable).parent / "mypy").exists():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    package = tmp_path / "adloco"
    package.mkdir()
    shutil.copy(ROOT / "adloco" / "__init__.py", package / "__init__.py")
    for folder in ("protocol", "node"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "-p",
            "adloco.protocol",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
