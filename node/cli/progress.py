"""What `adloco-swarm` shows of its nodes: their status files as they grow, and the run's summary.

For node/cli/launcher.py. Each node appends one JSON object per line to DIR/node{i}/status.jsonl;
`StatusTail` reads what was appended since the last look (a line counts once its newline is written)
and `NodeView` folds the records into what the node has done so far and the lines to print: each
round event parsed into a `RoundRecord` and shown as the line every driver prints (`format_round`).
At the end, `build_summary` makes summary.json (per node: rounds, final validation loss, the θ hash
of every round, bytes; per round: whether all θ hashes agree), `print_summary` says it in a few
lines, and `swarm_succeeded` decides the exit status.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..training.rounds import RoundRecord, format_bytes, format_round
from .processes import describe_pids

# ---- status files --------------------------------------------------------------------------------


def parse_status_lines(data: bytes) -> tuple[list[dict[str, Any]], list[str], bytes]:
    """Split appended bytes into (records, malformed lines, unterminated rest to keep for next time)."""
    *lines, rest = data.split(b"\n")
    records: list[dict[str, Any]] = []
    bad: list[str] = []
    for raw in lines:
        if not raw.strip():
            continue
        record = _decode(raw)
        if record is None:
            bad.append(raw.decode(errors="replace"))
        else:
            records.append(record)
    return records, bad, rest


def _decode(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class StatusTail:
    """Reads a growing JSON-lines file incrementally; a line counts only once its newline is written."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def read(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Records and malformed lines appended since the last call (none while the file is missing)."""
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated or replaced: start over
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return [], []
        self.offset += len(data)
        records, bad, self.partial = parse_status_lines(self.partial + data)
        return records, bad

    def finish(self) -> tuple[list[dict[str, Any]], list[str]]:
        """After the writer exited: also take an unterminated last line if it is a whole record."""
        records, bad = self.read()
        if self.partial.strip():
            record = _decode(self.partial)
            if record is None:
                bad.append(self.partial.decode(errors="replace"))
            else:
                records.append(record)
        self.partial = b""
        return records, bad


@dataclass
class NodeView:
    """What the status file of one node has said so far."""

    name: str
    peer_id: str | None = None
    rounds: list[RoundRecord] = field(default_factory=list)
    done_rounds: int | None = None
    exit_code: int | None = None

    def apply(self, records: Sequence[dict[str, Any]]) -> list[str]:
        """Fold new records in; returns the progress lines they call for (at most one round line)."""
        lines = []
        new_rounds = []
        for rec in records:
            event = rec.get("event")
            if event == "start":
                self.peer_id = str(rec.get("peer_id"))
                lines.append(f"[{self.name}] started as {self.peer_id}")
            elif event == "round":
                try:
                    record = RoundRecord.from_dict(rec)
                except (KeyError, TypeError) as e:
                    lines.append(f"[{self.name}] unreadable round record ({type(e).__name__}: {e})")
                    continue
                self.rounds.append(record)
                new_rounds.append(record)
            elif event == "done":
                self.done_rounds = _int(rec.get("rounds"))
            elif event in ("catch_up", "state_download"):
                lines.append(f"[{self.name}] {event} to round {rec.get('round')} from {rec.get('source')}")
        if new_rounds:
            lines.append(format_round(self.name, new_rounds[-1]))
        if self.done_rounds is not None and any(r.get("event") == "done" for r in records):
            lines.append(f"[{self.name}] done after {self.done_rounds} rounds")
        return lines

    @property
    def rounds_done(self) -> int:
        return self.done_rounds if self.done_rounds is not None else len(self.rounds)

    def reached(self, rounds: int) -> bool:
        return self.done_rounds is not None or len(self.rounds) >= rounds


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fmt(value: float | None, spec: str) -> str:
    return "?" if value is None else format(value, spec)


# ---- summary -------------------------------------------------------------------------------------


def hashes_agree(views: Sequence[NodeView]) -> dict[int, bool]:
    """Per round number: whether every node that applied that round reported the same θ hash."""
    seen: dict[int, set[str]] = {}
    for view in views:
        for rec in view.rounds:
            seen.setdefault(rec.round, set()).add(rec.theta_hash)
    return {number: len(hashes) == 1 for number, hashes in sorted(seen.items())}


def node_summary(view: NodeView, *, pid: int | None) -> dict[str, Any]:
    """One node's entry; bytes are the node's cumulative counters as of its last round."""
    last = view.rounds[-1] if view.rounds else None
    return {
        "name": view.name,
        "peer_id": view.peer_id,
        "rounds_done": view.rounds_done,
        "final_val_loss": None if last is None or not math.isfinite(last.val_loss) else last.val_loss,
        "theta_hashes": [rec.theta_hash for rec in view.rounds],
        "bytes_sent": 0 if last is None else last.bytes_sent,
        "bytes_received": 0 if last is None else last.bytes_received,
        "exit_code": view.exit_code,
        "pid": pid,
    }


def build_summary(
    *,
    run_id: str,
    views: Sequence[NodeView],
    pids: Sequence[int | None],
    wall_s: float,
    bootstrap: dict[str, Any],
    survivors: Sequence[int],
) -> dict[str, Any]:
    """summary.json; `all_hashes_agree_per_round` keys are round numbers (strings once in JSON)."""
    return {
        "run_id": run_id,
        "nodes": [node_summary(view, pid=pid) for view, pid in zip(views, pids, strict=True)],
        "all_hashes_agree_per_round": hashes_agree(views),
        "wall_s": round(wall_s, 3),
        "bootstrap": bootstrap,
        "survivors": list(survivors),
    }


def swarm_succeeded(views: Sequence[NodeView], rounds: int, survivors: Sequence[int]) -> bool:
    """Every node applied `rounds` rounds and exited 0, and no process outlived its group's stop."""
    return not survivors and all(v.rounds_done >= rounds and v.exit_code == 0 for v in views)


class Say(Protocol):
    """Prints one line of the launcher's output (err: to stderr)."""

    def __call__(self, line: str, *, err: bool = False) -> None: ...


def print_summary(summary: dict[str, Any], path: Path, say: Say) -> None:
    """The summary written to `path` in a few lines: per node, whether θ agreed, what survived."""
    for node in summary["nodes"]:
        val = _fmt(node["final_val_loss"], ".3f")
        say(
            f"[swarm] {node['name']}: {node['rounds_done']} rounds, val {val}, sent"
            f" {format_bytes(node['bytes_sent'])} recv {format_bytes(node['bytes_received'])},"
            f" exit {node['exit_code']}"
        )
    agree = summary["all_hashes_agree_per_round"]
    disagree = [number for number, ok in agree.items() if not ok]
    if not agree:
        say("[swarm] no round was applied")
    elif disagree:
        say(f"[swarm] θ hashes DISAGREE in rounds {disagree}")
    else:
        say(f"[swarm] θ hashes agree in all {len(agree)} rounds")
    if summary["survivors"]:
        say(
            f"[swarm] ERROR: survived the SIGKILL of their group: {describe_pids(summary['survivors'])}",
            err=True,
        )
    say(f"[swarm] wrote {path} ({summary['wall_s']:.1f}s)")
