"""The README's two commands are what CI runs and what the quick start promises."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in quick.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_starts_with_the_two_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    main, test = commands
    assert "-c constraints.txt" in main and "adloco-swarm --nodes 3 --rounds 20" in main
    assert "-c constraints.txt" in test and "'.[test]'" in test and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    test = _readme_commands()[1]
    assert test in ci.splitlines()


def test_constraints_pin_the_fragile_packages() -> None:
    pins = {
        m[1]: m[2]
        for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    }
    assert pins["torch"] == "2.13.0"
    assert pins["hivemind"] == "1.1.12"
    assert "protobuf" in pins and "numpy" in pins
