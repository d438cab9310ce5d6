"""The machine's live processes from /proc (Linux), for finding p2pd and reaping process groups;
no hivemind here, so the swarm launcher imports it without loading the networking stack."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessInfo:
    """A live process: its pid, command name, parent pid and process group."""

    pid: int
    name: str
    parent: int
    group: int


def live_processes() -> list[ProcessInfo]:
    """The live (non-zombie) processes of this machine, from /proc (none where there is no /proc)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":  # state, ppid, pgrp, ...
            found.append(ProcessInfo(int(entry.name), name, int(fields[1]), int(fields[2])))
    return found
