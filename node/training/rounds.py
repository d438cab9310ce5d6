"""The records of a round: the local result, what contributing it decided, and the applied round.

`LocalRound` is a peer's local phase (Δ, tokens, statistics) before it is contributed;
`ContributionInfo` what `Peer.contribute` decided about it (staleness, weight, HeLoCo, bytes). A
`RoundRecord` is an applied round as one observer saw it: a node (training alone or in a swarm)
describes its own round, the simulator its whole group's. The solo trainer and the simulator return
records; a swarm node writes each as a `round` event of its status file (`to_dict`), which
`adloco-swarm` reads back (`from_dict`) for its progress view and summary. `format_round` is the
`[peer round=N] ...` line all of them print (STYLE 11: one compact summary line per round).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from ...protocol.algorithms.heloco import CorrectionReport
from ...protocol.algorithms.report import PeerReport


@dataclass
class LocalRound:
    """A peer's local result for one round, before compression."""

    base_round: int
    delta: Sequence[torch.Tensor]  # a `PseudoGradient` for one instance: see `Instance.run_round`
    tokens: int
    samples: int
    mean_loss: float
    report: PeerReport
    compute_s: float
    accum_steps: int
    inner_steps: int
    # Forward and backward passes by micro-batch size, over every instance (the simulator's compute
    # model; the instances of a peer train one after the other on its device).
    passes: Mapping[int, int] = field(default_factory=dict)
    # Tokens trained and seconds of compute by device (`Peer.device_labels`): a node's devices train
    # at once, and `compute_s` is the busiest device's.
    by_device: Mapping[str, tuple[int, float]] = field(default_factory=dict)

    def report_time(self, compute_s: float) -> None:
        """Report this round as having taken `compute_s` seconds of compute (the simulator's modelled
        time, or a slowed-down node's): the step time DyLU compares and the round time of the byte
        budget, as the group sees them. `compute_s` itself stays what was measured."""
        steps = max(self.inner_steps, 1)
        self.report = replace(self.report, step_time_s=compute_s / steps, round_compute_s=compute_s)


@dataclass
class ContributionInfo:
    """What `contribute` decided, for metrics and the simulator's records."""

    staleness: int
    weight: float
    correction: CorrectionReport | None
    wire_bytes: int
    codec: str
    dropped: bool = False


@dataclass
class RoundRecord:
    """An applied round. Scope of the counts: a node's own, or (simulator) the whole group's.

    round: the round reached (θ_round). tokens: trained in this round; tokens_total: so far.
    staleness: τ of this node's contribution (simulator: the largest in the group). bytes_sent /
    bytes_received: every byte on the wire so far (framing included), round_bytes: sent in this
    round; payload_*: the encoded tensors alone so far; checks_*: of the wire bytes, the answers'
    checks so far (signed statements, reveals, projections). round_s: time since the previous applied
    round (simulator: simulated seconds), wait_s: the part of it spent idle waiting for the group
    and its transfer, compute_s: local training. heloco: how HeLoCo treated a late Δ's tensors.
    The simulator also fills sim_time_s (its clock), staleness_mean, the late_* counts, comm_s (the
    exchange), catch_up_bytes and wall_s (real seconds since the run started).
    """

    round: int
    val_loss: float
    inner_loss: float
    theta_hash: str
    tokens: int
    tokens_total: int
    tokens_per_s: float
    batch_sizes: list[int]
    accum_steps: int
    instances: int
    inner_steps: int
    codec: str
    group_size: int
    staleness: int
    bytes_sent: int
    bytes_received: int
    round_bytes: int
    round_s: float
    wait_s: float
    compute_s: float
    contribution_bytes: int = 0
    payload_sent: int = 0
    payload_received: int = 0
    checks_sent: int = 0
    checks_received: int = 0
    heloco: dict[str, int] | None = None
    dropped: int = 0
    rejected_parts: int = 0
    malformed_reports: int = 0
    sim_time_s: float | None = None
    staleness_mean: float = 0.0
    late_contributions: int = 0
    late_corrected: int = 0
    corrected_tensors: int = 0
    late_dropped: int = 0
    comm_s: float = 0.0
    catch_up_bytes: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (a status-file event, a results.json entry)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundRecord:
        """Inverse of `to_dict`; fields it does not know go to `extra`. KeyError/TypeError when one
        it needs is missing or malformed."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        record = cls(**known, extra=extra)
        if not isinstance(record.round, int) or not isinstance(record.theta_hash, str):
            raise TypeError("round must be an int and theta_hash a string")
        return record


def format_round(tag: str, r: RoundRecord) -> str:
    """`[tag round=N] val 3.210 inner 3.400 2450 tok/s b=[8, 8] a=1 K=2 int8 Δ 627.70kB group=3 τ=0
    sent 1.20MB recv 1.10MB 3.1s (waited 0.8s) θ=0a1b2c3d`, plus the simulated time where there is
    one (Δ: the encoded pseudo-gradient; the simulator's is its first member's)."""
    line = (
        f"[{tag} round={r.round}] val {r.val_loss:.3f} inner {r.inner_loss:.3f} {r.tokens_per_s:.0f} tok/s"
        f" b={list(r.batch_sizes)} a={r.accum_steps} K={r.instances}"
        f" {r.codec} Δ {format_bytes(r.contribution_bytes)} group={r.group_size}"
        f" τ={r.staleness} sent {format_bytes(r.bytes_sent)} recv {format_bytes(r.bytes_received)}"
        f" {r.round_s:.1f}s (waited {r.wait_s:.1f}s) θ={r.theta_hash[:8]}"
    )
    if r.sim_time_s is not None:
        line += f" t_sim={r.sim_time_s:.1f}s"
    return line


def format_bytes(value: float) -> str:
    """1234567 -> '1.23MB' (decimal units, as the byte counters are)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}B"
