"""What a peer tells its group about its round: one typed record, checked once where it enters.

Every member of an averaging group attaches a `PeerReport` to its contribution (AdLoCo's batch-test
statistics per instance slot, its b_max, tokens, staleness τ, step time for DyLU, the round its Δ
was measured from, and the figures DiLoCoX's byte budget needs). It travels as bytes
(`PeerReport.encode`, compact JSON) and comes back, gathered from the whole group, as bytes that
another peer produced: `parse_reports` decodes each entry with the bounds below and keeps the
entries that pass, naming the reason for each one it drops. Every member parses the same gathered
bytes with the same function, so every member keeps and drops the same entries: a malformed report
costs its sender its say in the schedule, never the round of the others. Everything downstream
(schedule consensus, DyLU, the codec budget) reads the typed records only.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .batchtest import GradStats

__all__ = [
    "MAX_REPORT_BYTES",
    "PeerReport",
    "dylu_ratio",
    "hiding_inner_steps",
    "overlap_byte_budget",
    "parse_reports",
]

# Bounds on what a peer may claim; a report outside them is dropped. Generous for honest peers.
MAX_REPORT_BYTES = 64 << 10
MAX_SLOTS = 256  # MIT instance slots
MAX_PEER_ID_CHARS = 128
MAX_INT = 2**53  # integers a JSON double holds exactly (b_max, tokens, rounds, staleness)
MAX_SECONDS = 1e7  # step or round time (about 4 months)
MAX_BANDWIDTH_BPS = 1e13  # 10 Tbit/s

_REQUIRED = {"peer_id", "slot_stats", "b_max", "tokens"}
_OPTIONAL = {"staleness", "step_time_s", "base_round", "bandwidth_bps", "round_compute_s"}


@dataclass(frozen=True, kw_only=True)
class PeerReport:
    """One peer's end-of-round metadata, gathered by every member of the averaging group.

    slot_stats: batch-test statistics per instance slot of the schedule the peer ran (None where it
    has none, e.g. only one gradient). b_max: its largest micro-batch. tokens: tokens it trained on
    this round. staleness: τ, rounds its contribution is behind. step_time_s: seconds per inner step
    (as others should see it: DyLU compares them). base_round: the round its Δ was measured from.
    bandwidth_bps / round_compute_s: its measured link and the length of its local round, from which
    the group derives the byte budget of an overlapped exchange (0 / 0.0: unknown).
    """

    peer_id: str
    slot_stats: tuple[GradStats | None, ...]
    b_max: int
    tokens: int
    staleness: int = 0
    step_time_s: float = 0.0
    base_round: int = 0
    bandwidth_bps: float = 0.0
    round_compute_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "slot_stats", tuple(self.slot_stats))
        if not isinstance(self.peer_id, str) or not 0 < len(self.peer_id) <= MAX_PEER_ID_CHARS:
            raise ValueError(f"PeerReport.peer_id must be a string of 1..{MAX_PEER_ID_CHARS} characters")
        if len(self.slot_stats) > MAX_SLOTS:
            raise ValueError(f"PeerReport.slot_stats has {len(self.slot_stats)} slots (at most {MAX_SLOTS})")
        for s in self.slot_stats:
            if s is not None and not isinstance(s, GradStats):
                raise ValueError(f"PeerReport.slot_stats entries must be GradStats or None, got {s!r}")
        _require_int("PeerReport.b_max", self.b_max, minimum=1)
        _require_int("PeerReport.tokens", self.tokens, minimum=0)
        _require_int("PeerReport.staleness", self.staleness, minimum=0)
        _require_int("PeerReport.base_round", self.base_round, minimum=0)
        for name, bound in (
            ("step_time_s", MAX_SECONDS),
            ("round_compute_s", MAX_SECONDS),
            ("bandwidth_bps", MAX_BANDWIDTH_BPS),
        ):
            object.__setattr__(self, name, _require_float(f"PeerReport.{name}", getattr(self, name), bound))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON and msgpack safe)."""
        return {
            "peer_id": self.peer_id,
            "slot_stats": [None if s is None else s.to_dict() for s in self.slot_stats],
            "b_max": self.b_max,
            "tokens": self.tokens,
            "staleness": self.staleness,
            "step_time_s": self.step_time_s,
            "base_round": self.base_round,
            "bandwidth_bps": self.bandwidth_bps,
            "round_compute_s": self.round_compute_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeerReport:
        """Inverse of `to_dict`; raises ValueError on missing, unknown or invalid fields."""
        if not isinstance(data, Mapping):
            raise ValueError(f"PeerReport must be an object, got {type(data).__name__}")
        missing, unknown = _REQUIRED - data.keys(), data.keys() - _REQUIRED - _OPTIONAL
        if missing or unknown:
            raise ValueError(f"PeerReport: missing {sorted(missing)}, unknown {sorted(unknown)} fields")
        raw = data["slot_stats"]
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"PeerReport.slot_stats must be a list, got {type(raw).__name__}")
        if len(raw) > MAX_SLOTS:
            raise ValueError(f"PeerReport.slot_stats has {len(raw)} slots (at most {MAX_SLOTS})")
        for s in raw:
            if s is not None and not isinstance(s, Mapping):
                raise ValueError(f"PeerReport.slot_stats entries must be objects or null, got {s!r}")
        stats = tuple(None if s is None else _grad_stats(s) for s in raw)
        return cls(**{**data, "slot_stats": stats})

    def encode(self) -> bytes:
        """The report as it travels: compact, key-sorted JSON (deterministic bytes)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> PeerReport:
        """Parse bytes another peer sent; raises ValueError naming what is wrong."""
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"a report must be bytes, got {type(data).__name__}")
        if len(data) > MAX_REPORT_BYTES:
            raise ValueError(f"report of {len(data)} bytes (at most {MAX_REPORT_BYTES})")
        try:
            value = json.loads(bytes(data), parse_constant=_reject_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON report: {e}") from None
        return cls.from_dict(value)


def parse_reports(
    members: Sequence[str], raw: Sequence[bytes]
) -> tuple[tuple[PeerReport, ...], dict[str, str]]:
    """Decode the group's gathered reports, `raw[i]` sent by `members[i]`.

    Returns the valid reports (in member order) and, for every member whose entry was dropped, why:
    undecodable, out of bounds, or claiming another peer's id. Deterministic in its input, so every
    member that received the same bytes keeps the same reports.
    """
    if len(members) != len(raw):
        raise ValueError(f"{len(raw)} reports for {len(members)} members")
    reports: list[PeerReport] = []
    malformed: dict[str, str] = {}
    for member, data in zip(members, raw, strict=True):
        try:
            report = PeerReport.decode(data)
        except (ValueError, TypeError) as e:
            malformed[member] = str(e)[:200]
            continue
        if report.peer_id != member:
            malformed[member] = f"report claims peer id {report.peer_id[:16]!r}"
            continue
        reports.append(report)
    return tuple(reports), malformed


def _grad_stats(data: Mapping[str, Any]) -> GradStats:
    stats = GradStats.from_dict(data)
    for name in ("num_grads", "samples_per_grad", "num_groups"):
        _require_int(f"GradStats.{name}", getattr(stats, name), minimum=1)
    return stats


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a report may carry")


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise ValueError(f"{name} must be an int in [{minimum}, 2^53], got {value!r}")


def _require_float(name: str, value: object, bound: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not 0 <= value <= bound:
        raise ValueError(f"{name} must be in [0, {bound:g}], got {value!r}")
    return float(value)


DYLU_MAX_SPEEDUP = 20.0
"""How much faster than the group's median step time DyLU's reference may be: a report is one
member's word, and one forged step time of a microsecond set every member's H to 1. The widest
heterogeneity the simulator runs (speeds 1 and 1/15) stays within it."""
BUDGET_MAX_SHORTFALL = 10.0
"""How far below the group's median budget the byte budget may go: one report claiming a near-zero
link forced the harshest codec on everyone."""


def dylu_ratio(reports: Sequence[PeerReport], peer_id: str) -> float | None:
    """DyLU (Async DiLoCo): `peer_id`'s speed relative to the fastest member that reported a step
    time, in (0, 1]; None when its own report or every other member's step time is missing. The fastest counts
    at most `DYLU_MAX_SPEEDUP` times faster than the median: one report moves every member's H by a
    bounded factor."""
    own = next((r.step_time_s for r in reports if r.peer_id == peer_id), 0.0)
    times = [r.step_time_s for r in reports if r.step_time_s > 0]
    others = [r for r in reports if r.peer_id != peer_id and r.step_time_s > 0]
    if not others or own <= 0:
        # A round averaged alone says nothing of the others' speed: it must not reset the ratio to 1
        # (a slow node that once averaged alone went back to the full H, seen in tests/test_swarm.py).
        return None
    fastest = max(min(times), statistics.median(times) / DYLU_MAX_SPEEDUP)
    return min(1.0, fastest / own)


def overlap_byte_budget(reports: Sequence[PeerReport], *, group_size: int) -> float | None:
    """The payload bytes each member may send so one round's transfer fits in the overlap window.

    DiLoCoX: T_comm ≤ H·t_step. Each member sends about 2(n−1)/n of its payload (its parts to their
    owners, then the averaged parts it owns), so the payload budget is the slowest member's
    bandwidth × its round compute time divided by that factor, the slowest counted at most
    `BUDGET_MAX_SHORTFALL` below the median (one report moves the choice by a bounded amount). None
    when no member reported both figures, or alone (nothing to send).
    """
    budgets = [
        r.bandwidth_bps / 8 * r.round_compute_s for r in reports if r.bandwidth_bps and r.round_compute_s
    ]
    if not budgets or group_size < 2:
        return None
    slowest = max(min(budgets), statistics.median(budgets) / BUDGET_MAX_SHORTFALL)
    return slowest / (2 * (group_size - 1) / group_size)


HIDE_MARGIN = 1.25
"""H·t_step must exceed the exchange's payload time by this factor (`hiding_inner_steps`): the
bandwidth and step times are last round's measurements, and the exchange pays latency, matchmaking
and the reports' and checks' bytes besides. At 1.1 the simulator's 124M exchange at 1 Gbit/s (1.5 s
of int8 payload, 0.1 s of latency) did not fit, the overlap stayed off and utilization fell to 50 %
(bench/hide_comm.py)."""
HIDE_MAX_SPREAD = 10.0
"""How far above the group's median ratio of exchange time to step time the worst member's may count:
one report of a near-zero link or a microsecond step sent every member's H to its maximum."""


def hiding_inner_steps(
    reports: Sequence[PeerReport], *, payload_bytes: float, group_size: int, min_steps: int, max_steps: int
) -> int | None:
    """The H whose local round hides the next exchange of `payload_bytes` per member (DiLoCoX's
    condition T_comm ≤ H·t_step, with the margin `HIDE_MARGIN`), for every member that reported its
    link and step time: each sends about 2(n−1)/n of its payload's size (its parts to their owners,
    then the averages it owns to the others), so its exchange takes that over its bandwidth, and its
    round H × its step time. The member with the largest ratio sets
    H, counted at most `HIDE_MAX_SPREAD` times the median ratio, and H stays within [min_steps,
    max_steps]. None when no member reported both figures, or alone (nothing to exchange)."""
    if group_size < 2:
        return None
    factor = 2 * (group_size - 1) / group_size
    ratios = [
        payload_bytes * factor / (r.bandwidth_bps / 8) / r.step_time_s
        for r in reports
        if r.bandwidth_bps > 0 and r.step_time_s > 0
    ]
    if not ratios:
        return None
    worst = min(max(ratios), statistics.median(ratios) * HIDE_MAX_SPREAD)
    return max(min_steps, min(max_steps, math.ceil(worst * HIDE_MARGIN)))
