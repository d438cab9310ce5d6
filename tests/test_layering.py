"""The folders are the dependency graph: imports only go down (STYLE.md 1, DESIGN.md §2).

Every module under protocol/, node/ and dht_bootstrap/ is parsed with `ast` (nothing is imported), so
new modules are checked as soon as they exist. Rules:
(a) a protocol module imports hivemind only if its file name is in TRANSPORT_MODULES;
(b) nothing under protocol/ or dht_bootstrap/ imports adloco.node (an upward edge);
(c) a math module (protocol, not transport) imports only the standard library, torch, numpy and
    adloco.protocol, and never a transport module (that would pull hivemind in through the back door);
(d) no module imports a folder by its bare name (`protocol`, `node`, `dht_bootstrap`): installed, they
    exist only as adloco.*.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"protocol": "adloco.protocol", "node": "adloco.node", "dht_bootstrap": "adloco.dht_bootstrap"}
TRANSPORT_MODULES = {
    "hivemind_averager.py",
    "dht.py",
    "state_transfer.py",
    "averager.py",
    "records.py",
    "wire.py",
}
MATH_ALLOWED_ROOTS = {"torch", "numpy"}
STDLIB = set(sys.stdlib_module_names)


@dataclass(frozen=True)
class Import:
    module: str
    line: int


def module_name(rel: Path) -> str:
    """Dotted import name of a source file, e.g. protocol/outer.py -> adloco.protocol.outer."""
    parts = [PACKAGES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, name: str, *, is_package: bool) -> list[Import]:
    """Absolute names of everything `source` imports, relative imports resolved against `name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, name, is_package=is_package)
            if node.module is None:
                found += [Import(f"{base}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append(Import(base, node.lineno))
                if base.startswith("adloco."):
                    # `from adloco.protocol import dht` imports the submodule dht
                    found += [Import(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _resolve(module: str | None, level: int, name: str, *, is_package: bool) -> str:
    if level == 0:
        return module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def violations(rel: Path, source: str) -> list[str]:
    """Rule violations of `source`, the text of the file at `rel` (relative to the repository root)."""
    folder = rel.parts[0]
    is_transport = rel.name in TRANSPORT_MODULES
    is_math = folder == "protocol" and not is_transport
    transport_names = {f"adloco.protocol.{Path(t).stem}" for t in TRANSPORT_MODULES}
    problems = []
    for imp in imports_of(source, module_name(rel), is_package=rel.name == "__init__.py"):
        root = imp.module.split(".")[0]
        where = f"{rel.as_posix()}:{imp.line} imports {imp.module}"
        if folder == "protocol" and root == "hivemind" and not is_transport:
            problems.append(f"{where}: hivemind outside a transport module (add it to TRANSPORT_MODULES?)")
        if folder in ("protocol", "dht_bootstrap") and _within(imp.module, "adloco.node"):
            problems.append(f"{where}: upward edge into adloco.node")
        if is_math and not _math_ok(imp.module, transport_names):
            problems.append(f"{where}: math modules import only stdlib, torch, numpy, adloco.protocol")
        if root in PACKAGES:
            problems.append(f"{where}: use adloco.{root}, the installed name")
    return problems


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _math_ok(module: str, transport_names: set[str]) -> bool:
    root = module.split(".")[0]
    if root in STDLIB or root in MATH_ALLOWED_ROOTS:
        return True
    return _within(module, "adloco.protocol") and not any(_within(module, t) for t in transport_names)


def source_files() -> list[Path]:
    return sorted(
        p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
    )


@pytest.mark.parametrize("path", source_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_respects_layers(path: Path) -> None:
    assert violations(path.relative_to(ROOT), path.read_text()) == []


def test_discovery_finds_the_math_modules() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in source_files()}
    assert {"protocol/__init__.py", "protocol/outer.py", "protocol/schedule.py", "node/__init__.py"} <= names


@pytest.mark.parametrize(
    ("rel", "source", "fragment"),
    [
        ("protocol/fake_math.py", "import hivemind\n", "hivemind outside a transport"),
        ("protocol/fake_math.py", "from hivemind.p2p import P2P\n", "hivemind outside a transport"),
        ("protocol/fake_math.py", "from adloco.node import trainer\n", "upward edge"),
        ("protocol/fake_math.py", "from ..node import trainer\n", "upward edge"),
        ("protocol/sub/__init__.py", "from ...node import trainer\n", "upward edge"),
        ("dht_bootstrap/fake.py", "import adloco.node.cli\n", "upward edge"),
        ("protocol/fake_math.py", "import pydantic\n", "math modules import only"),
        ("protocol/fake_math.py", "from adloco.protocol import dht\n", "math modules import only"),
        ("protocol/fake_math.py", "from . import averager\n", "math modules import only"),
        ("protocol/fake_math.py", "def f():\n    import hivemind\n", "hivemind outside a transport"),
        ("node/fake.py", "from protocol import outer\n", "installed name"),
    ],
)
def test_rules_catch_violations(rel: str, source: str, fragment: str) -> None:
    assert any(fragment in p for p in violations(Path(rel), source))


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        (
            "protocol/fake_math.py",
            "import math\nimport torch\nfrom torch import Tensor\nimport numpy as np\n",
        ),
        ("protocol/fake_math.py", "from __future__ import annotations\nfrom .outer import outer_step\n"),
        ("protocol/fake_math.py", "from adloco.protocol.batchtest import GradStats\n"),
        ("protocol/dht.py", "import hivemind\nimport pydantic\n"),
        ("node/fake.py", "import hivemind\nfrom adloco.node import x\nfrom adloco.protocol import dht\n"),
    ],
)
def test_rules_allow_legal_imports(rel: str, source: str) -> None:
    assert violations(Path(rel), source) == []
