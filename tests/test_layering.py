"""The folders are the dependency graph: imports only go down (STYLE.md 1, DESIGN.md §2).

The repository root is the package `adloco` (pyproject maps it), each folder one of its layers.
Every module of the package and every bench script is parsed with `ast` (nothing is imported), so a
new module is checked as soon as it exists. A module may import:
- from the package, only the layers `ALLOWED` lists for its folder (its own included);
- inside the package, only relatively (`from ..training.peer import Peer`), so that the source reads
  the same on disk as installed; tests and bench scripts, which stand outside, import `adloco.*`;
- hivemind only in protocol/transport/, grpc only in protocol/control/ and node/operations/;
- in protocol/algorithms/ (the math), nothing beyond the standard library, torch and numpy;
- in protocol/control/ (protoc's output), nothing beyond the standard library, protobuf and grpc;
- never a folder by its bare name (`protocol`, `node`): installed, they exist only as adloco.*.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("protocol", "node", "dht_bootstrap")
ROOT_MODULES = {"adloco", "adloco.errors", "adloco.settings"}
# Layer (a folder, "" for the root modules) -> the layers its modules may import, below it.
ALLOWED: dict[str, set[str]] = {
    "": {""},
    "protocol": set(),
    "protocol/algorithms": {"protocol/algorithms"},
    "protocol/transport": {"protocol/algorithms", "protocol/transport"},
    "protocol/control": {"protocol/control"},
    "dht_bootstrap": {"", "protocol/transport", "dht_bootstrap"},
    "node": set(),
    # The data, the model below the round; the model imports the data only for its state checks.
    "node/data": {"", "protocol/algorithms", "node/data"},
    "node/model": {"", "protocol/algorithms", "node/data", "node/model"},
    "node/training": {"", "protocol/algorithms", "node/data", "node/model", "node/training"},
    "node/operations": {"", "protocol/control", "node/operations"},
    # The solo trainer checkpoints as a swarm node does (node/operations knows no Peer).
    "node/solo": {
        "",
        "protocol/algorithms",
        "protocol/transport",
        "node/data",
        "node/model",
        "node/training",
        "node/operations",
        "node/solo",
    },
    "node/sim": {
        "",
        "protocol/algorithms",
        "protocol/transport",
        "node/data",
        "node/model",
        "node/training",
        "node/sim",
    },
    "node/swarm": {
        "",
        "protocol/algorithms",
        "protocol/transport",
        "node/data",
        "node/model",
        "node/training",
        "node/operations",
        "node/swarm",
    },
    "node/cli": {
        "",
        "protocol/algorithms",
        "protocol/transport",
        "node/data",
        "node/model",
        "node/training",
        "node/operations",
        "node/solo",
        "node/sim",
        "node/swarm",
        "node/cli",
    },
}
ANY_LAYER = set(ALLOWED)  # bench scripts stand on top of everything
# Third-party packages confined to some layers.
CONFINED = {
    "hivemind": {"protocol/transport"},
    "grpc": {"protocol/control", "node/operations"},
    "google": {"protocol/control"},
}
# What bench scripts may import beyond the package: hivemind, whose own averager bench/allreduce.py
# measures ours against.
BENCH_MAY_IMPORT = {"hivemind"}
PURE = {  # layers that import nothing from outside but these roots (and the standard library)
    "protocol/algorithms": {"torch", "numpy"},
    "protocol/control": {"google", "grpc"},
}
STDLIB = set(sys.stdlib_module_names)


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    relative: bool


# Sub-packages that are rooms of their folder's layer, not layers of their own: their modules follow
# that layer's rules (`layer_of_module` already places them in it, as they are not in ALLOWED).
SUBPACKAGES = {"protocol/algorithms/codecs": "protocol/algorithms"}


def layer_of_path(rel: Path) -> str:
    """The layer of a source file: its folder relative to the root ("" for the root modules), or,
    for a module of a sub-package in `SUBPACKAGES`, the layer the sub-package belongs to."""
    folder = rel.parent.as_posix() if rel.parent != Path(".") else ""
    return SUBPACKAGES.get(folder, folder)


def module_name(rel: Path) -> str:
    """Installed name of a package file: protocol/algorithms/outer.py -> adloco.protocol.algorithms.outer."""
    parts = ["adloco", *rel.with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of_module(module: str) -> str | None:
    """The layer an adloco module lives in (None: not part of the package)."""
    parts = module.split(".")[1:]
    if not parts or f"adloco.{parts[0]}" in ROOT_MODULES:
        return ""
    for n in range(len(parts), 0, -1):
        folder = "/".join(parts[:n])
        if folder in ALLOWED:
            return folder
    return None


def imports_of(source: str, name: str, *, is_package: bool) -> list[Import]:
    """Absolute names of everything `source` imports, relative imports resolved against `name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, name, is_package=is_package)
            relative = node.level > 0
            found.append(Import(base, node.lineno, relative))
            if base == "adloco" or base.startswith("adloco."):
                # `from ..protocol import transport` imports the subpackage transport
                found += [Import(f"{base}.{alias.name}", node.lineno, relative) for alias in node.names]
    return found


def _resolve(module: str | None, level: int, name: str, *, is_package: bool) -> str:
    if level == 0:
        return module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def violations(rel: Path, source: str) -> list[str]:
    """Rule violations of `source`, the text of the file at `rel` (relative to the repository root)."""
    in_package = rel.parts[0] in PACKAGE_FOLDERS or len(rel.parts) == 1
    layer = layer_of_path(rel) if in_package else None
    allowed = ALLOWED.get(layer, set()) if layer is not None else ANY_LAYER
    name = module_name(rel) if in_package else f"bench.{rel.stem}"
    problems = []
    for imp in imports_of(source, name, is_package=rel.name == "__init__.py"):
        root = imp.module.split(".")[0]
        where = f"{rel.as_posix()}:{imp.line} imports {imp.module}"
        if root in PACKAGE_FOLDERS:
            problems.append(f"{where}: use adloco.{root}, the installed name")
        if root == "adloco":
            target = layer_of_module(imp.module)
            own_bench = not in_package and (
                imp.module == "adloco.bench" or imp.module.startswith("adloco.bench.")
            )
            if target is None and imp.module != "adloco" and not own_bench:
                problems.append(f"{where}: not a module of the package (bench and tests stand outside)")
            elif target is not None and target not in allowed:
                problems.append(
                    f"{where}: layer {layer or 'root'!r} may not import layer {target or 'root'!r}"
                )
            if in_package and not imp.relative:
                problems.append(f"{where}: import relatively inside the package (reads the same on disk)")
        if root in CONFINED and layer not in CONFINED[root] and (in_package or root not in BENCH_MAY_IMPORT):
            problems.append(f"{where}: {root} belongs in {sorted(CONFINED[root])}")
        if layer in PURE and root not in STDLIB and root != "adloco" and root not in PURE[layer]:
            problems.append(f"{where}: {layer} imports only the standard library and {sorted(PURE[layer])}")
    return problems


def source_files() -> list[Path]:
    files = [ROOT / f for f in ("__init__.py", "errors.py", "settings.py")]
    for folder in (*PACKAGE_FOLDERS, "bench"):
        files += (p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


@pytest.mark.parametrize("path", source_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_respects_layers(path: Path) -> None:
    assert violations(path.relative_to(ROOT), path.read_text()) == []


def test_every_folder_of_the_package_is_a_declared_layer() -> None:
    folders = {layer_of_path(p.relative_to(ROOT)) for p in source_files() if p.parts[-2] != "bench"}
    folders.discard("bench")
    assert folders <= set(ALLOWED), f"undeclared layers: {sorted(folders - set(ALLOWED))}"
    assert {"protocol/algorithms", "protocol/transport", "node/training", "node/swarm"} <= folders


@pytest.mark.parametrize(
    ("rel", "source", "fragment"),
    [
        ("protocol/algorithms/fake.py", "import hivemind\n", "hivemind belongs in"),
        ("protocol/algorithms/fake.py", "from hivemind.p2p import P2P\n", "hivemind belongs in"),
        ("protocol/algorithms/fake.py", "def f():\n    import hivemind\n", "hivemind belongs in"),
        ("protocol/algorithms/fake.py", "from ...node.training import peer\n", "may not import layer"),
        ("protocol/algorithms/fake.py", "from ..transport import dht\n", "may not import layer"),
        ("protocol/algorithms/fake.py", "from ..control import control_pb2\n", "may not import layer"),
        ("protocol/algorithms/fake.py", "import pydantic\n", "imports only the standard library"),
        ("protocol/transport/fake.py", "from ...node.swarm import node\n", "may not import layer"),
        ("protocol/transport/sub/__init__.py", "from ....node import swarm\n", "may not import layer"),
        ("dht_bootstrap/fake.py", "from ..node.cli import node\n", "may not import layer"),
        ("node/training/fake.py", "from ...protocol.transport import dht\n", "may not import layer"),
        ("node/training/fake.py", "from ..swarm.node import SwarmNode\n", "may not import layer"),
        ("node/model/fake.py", "from ..training.instances import adamw\n", "may not import layer"),
        ("node/data/fake.py", "from ..training.config import TrainConfig\n", "may not import layer"),
        ("node/data/fake.py", "from ..model.model import build_model\n", "may not import layer"),
        ("node/operations/fake.py", "from ..training.peer import Peer\n", "may not import layer"),
        ("node/sim/fake.py", "from ..swarm import node\n", "may not import layer"),
        ("node/swarm/fake.py", "from ..sim.engine import Simulator\n", "may not import layer"),
        ("node/swarm/fake.py", "from ..cli import node\n", "may not import layer"),
        ("node/swarm/fake.py", "import hivemind\n", "hivemind belongs in"),
        ("node/training/fake.py", "import grpc\n", "grpc belongs in"),
        ("errors.py", "from .node.training import peer\n", "may not import layer"),
        ("node/training/fake.py", "from adloco.protocol.algorithms import outer\n", "import relatively"),
        ("node/fake.py", "from protocol import outer\n", "installed name"),
        ("protocol/control/control_pb2.py", "import torch\n", "imports only the standard library"),
        ("node/cli/fake.py", "from ...bench import codecs\n", "not a module of the package"),
        ("bench/fake.py", "import grpc\n", "grpc belongs in"),
    ],
)
def test_rules_catch_violations(rel: str, source: str, fragment: str) -> None:
    assert any(fragment in p for p in violations(Path(rel), source)), violations(Path(rel), source)


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        (
            "protocol/algorithms/fake.py",
            "import math\nimport torch\nfrom torch import Tensor\nimport numpy as np\n",
        ),
        (
            "protocol/algorithms/fake.py",
            "from __future__ import annotations\nfrom .outer import outer_step\n",
        ),
        ("protocol/transport/fake.py", "import hivemind\nimport pydantic\nfrom ..algorithms import codecs\n"),
        ("node/swarm/fake.py", "from ..training.peer import Peer\nfrom ...protocol.transport import dht\n"),
        (
            "node/training/fake.py",
            "from ...errors import UserError\nfrom ...protocol.algorithms import outer\n",
        ),
        ("node/cli/fake.py", "from ..swarm.node import SwarmNode\nfrom ...settings import parse_settings\n"),
        (
            "bench/fake.py",
            "from adloco.node.sim.engine import Simulator\nfrom adloco.protocol.algorithms import codecs\n",
        ),
        # adloco-bench's sections are modules of adloco.bench, which only bench itself imports.
        ("bench/fake.py", "from adloco.bench.simruns import SimRun\nfrom . import comm\n"),
        ("bench/fake.py", "from hivemind.averaging import DecentralizedAverager\n"),
    ],
)
def test_rules_allow_legal_imports(rel: str, source: str) -> None:
    assert violations(Path(rel), source) == []
