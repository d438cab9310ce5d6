"""The simulator: N virtual peers in one process, running the real peer code over an in-memory transport.

Each virtual peer is a `adloco.node.peer.Peer`, exactly what a swarm node runs; the group reduction is
`adloco.protocol.allreduce.reduce_group`, exactly the semantics of the network all-reduce. What is
simulated is time: compute time comes from a per-peer cost model (seconds per sample × the peer's
slowdown), communication time from the exact wire bytes each member sends and receives over its
modelled link. Training itself is real.

Modes:
- sync: every round waits for every peer (DiLoCo / AdLoCo).
- async: a round closes `window` simulated seconds after the first peer is ready; peers still
  training contribute to a later round with staleness τ, after replaying the updates they missed,
  HeLoCo-corrected against the momentum and weighted by ρ(τ) (unless correction is off).

With one-step-delay overlap (`TrainConfig.overlap`) a member starts its next local round as soon as
it has contributed, and the round's update lands at the first inner step that ends after the
transfer has (in simulated time); a member that finishes its local round first waits for it.
`RoundRecord.wait_s` is the members' mean time idle, waiting for the group and its transfer.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from ...protocol.algorithms.allreduce import Contribution, GroupResult, reduce_group
from ..training.config import TrainConfig
from ..training.corpus import Corpus
from ..training.peer import ContributionInfo, LocalRound, Peer, overlap_byte_budget, overlap_this_round

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimConfig:
    """The simulated swarm.

    slowdown: per-peer step-time multipliers (cycled over the peers), e.g. (1, 1, 1, 5) for one peer
        five times slower. sec_per_sample: modelled compute seconds for one training sample (one
        sequence) at slowdown 1; 0.004 matches the tiny default model on this 2-core machine.
    bandwidth_mbps / latency_s: each peer's symmetric link. window_s: async matchmaking window in
        simulated seconds (None: a quarter of the fastest peer's first round). dylu: slow peers
        shorten H in proportion to their speed (Async DiLoCo DyLU).
    """

    peers: int = 4
    rounds: int = 20
    mode: Literal["sync", "async"] = "sync"
    train: TrainConfig = field(default_factory=TrainConfig)
    slowdown: tuple[float, ...] = (1.0,)
    sec_per_sample: float = 0.004
    bandwidth_mbps: float = 20.0
    latency_s: float = 0.05
    window_s: float | None = None
    dylu: bool = False

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not self.slowdown or not all(math.isfinite(s) and s > 0 for s in self.slowdown):
            raise ValueError(f"slowdown factors must be finite and > 0, got {self.slowdown}")
        if not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError(f"bandwidth_mbps must be finite and > 0, got {self.bandwidth_mbps}")
        for name in ("sec_per_sample", "latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.window_s is not None and not (math.isfinite(self.window_s) and self.window_s >= 0):
            raise ValueError(f"window_s must be finite and >= 0, got {self.window_s}")

    def slowdown_of(self, index: int) -> float:
        return self.slowdown[index % len(self.slowdown)]


@dataclass
class RoundRecord:
    """One applied round of the simulated swarm (one line of results.json)."""

    round: int
    sim_time_s: float
    tokens: int
    wire_bytes: int
    wire_bytes_total: int
    val_loss: float
    inner_loss: float
    batch_size: int
    batch_sizes: list[int]
    accum_steps: int
    instances: int
    inner_steps: int
    codec: str
    group_size: int
    staleness_mean: float
    staleness_max: int
    late_contributions: int
    late_corrected: int
    corrected_tensors: int
    late_dropped: int
    comm_s: float
    wait_s: float
    catch_up_bytes: int
    theta_hash: str
    wall_s: float


@dataclass
class _Pending:
    """A virtual peer's local round in flight: ready at `ready_at` simulated seconds."""

    local: LocalRound
    ready_at: float
    idle_s: float = 0.0  # overlap: how long it waited at the end of this round for the last update


@dataclass(frozen=True)
class _Landing:
    """A group's result, arriving at its members at simulated time `at`."""

    result: GroupResult
    byte_budget: float | None
    at: float


class Simulator:
    """Drives N virtual peers through `rounds` applied rounds; see the module docstring."""

    def __init__(self, cfg: SimConfig, corpus: Corpus, *, vocab_size: int) -> None:
        self.cfg = cfg
        self.peers = [
            Peer(
                peer_id=f"peer{i:03d}",
                index=i,
                num_peers=cfg.peers,
                cfg=cfg.train,
                corpus=corpus,
                vocab_size=vocab_size,
            )
            for i in range(cfg.peers)
        ]
        fastest = min(cfg.slowdown_of(i) for i in range(cfg.peers))
        if cfg.dylu:
            for i, peer in enumerate(self.peers):
                peer.dylu_speed_ratio = fastest / cfg.slowdown_of(i)
        self.records: list[RoundRecord] = []
        self.wire_total = 0
        self.tokens_total = 0

    # ---- time model --------------------------------------------------------------------------

    def compute_time(self, index: int, local: LocalRound) -> float:
        return local.samples * self.cfg.sec_per_sample * self.cfg.slowdown_of(index)

    def transfer_time(self, sent: int, received: int) -> float:
        bytes_per_s = self.cfg.bandwidth_mbps * 1e6 / 8
        # Two phases (parts to their owners, averages back), each paying the latency once.
        return 2 * self.cfg.latency_s + max(sent, received) / bytes_per_s

    # ---- main loop ---------------------------------------------------------------------------

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> list[RoundRecord]:
        """Run until `rounds` rounds are applied; returns the per-round records."""
        pending = {i: self._start(i, at=0.0) for i in range(self.cfg.peers)}
        window = self.cfg.window_s
        if window is None:
            window = 0.25 * min(p.ready_at for p in pending.values())
        t_start = time.perf_counter()
        while len(self.records) < self.cfg.rounds:
            if self.cfg.mode == "sync":
                close = max(p.ready_at for p in pending.values())
            else:
                # A round opens when the first *fresh* peer is ready and closes `window` later; late
                # peers never open a round alone, they join the next one (and are corrected there).
                latest = max(peer.state.round for peer in self.peers)
                fresh = [p.ready_at for p in pending.values() if p.local.base_round == latest]
                close = min(fresh) + window
            members = sorted(i for i, p in pending.items() if p.ready_at <= close)
            close = max(pending[i].ready_at for i in members)
            record = self._group_round(members, pending, close)
            record.wall_s = time.perf_counter() - t_start
            self.records.append(record)
            if on_round is not None:
                on_round(record)
        return self.records

    def _start(
        self, index: int, *, at: float, landing: _Landing | None = None, from_theta: bool = False
    ) -> _Pending:
        """Run peer `index`'s next local round from simulated time `at`; with overlap, `landing`
        is applied after the first inner step that ends once it has arrived."""
        peer = self.peers[index]
        sec_per_sample = self.cfg.sec_per_sample * self.cfg.slowdown_of(index)
        landed = landing is None

        def on_step(samples_done: int) -> None:
            nonlocal landed
            if landing is not None and not landed and at + samples_done * sec_per_sample >= landing.at:
                self._land(index, landing)
                landed = True

        local = peer.train_round(on_step=on_step if landing is not None else None, from_theta=from_theta)
        ready_at = at + self.compute_time(index, local)
        idle = 0.0
        if landing is not None and not landed:
            # The local round ended first: wait for the update, apply it, then contribute.
            self._land(index, landing)
            local.base_round = peer.phase_round
            idle = max(0.0, landing.at - ready_at)
            ready_at += idle
        return _Pending(local=local, ready_at=ready_at, idle_s=idle)

    def _land(self, index: int, landing: _Landing) -> None:
        self.peers[index].apply_round(landing.result, byte_budget=landing.byte_budget)

    def _group_round(self, members: list[int], pending: dict[int, _Pending], close: float) -> RoundRecord:
        """Contribute, reduce and apply one round; the members' next local rounds are started."""
        # The most advanced peer holds the swarm's latest state (in the swarm: what the DHT publishes).
        leader = max(range(len(self.peers)), key=lambda i: (self.peers[i].state.round, -i))
        current = self.peers[leader].state
        schedule_used = current.schedule
        contributions: list[Contribution] = []
        infos: list[ContributionInfo] = []
        catch_up_bytes: dict[int, int] = {}
        for i in members:
            peer = self.peers[i]
            catch_up_bytes[i] = self._catch_up(peer, leader)
            local = pending[i].local
            extra = {
                "bandwidth_bps": self.cfg.bandwidth_mbps * 1e6,
                "round_compute_s": self.compute_time(i, local),
            }
            contribution, info = peer.contribute(local, extra=extra)
            infos.append(info)
            if contribution is not None:
                contributions.append(contribution)
        if not contributions:
            raise RuntimeError("every contribution of the round was dropped as too stale")
        codec = self.peers[leader].downlink_codec(current.schedule.codec)
        result = reduce_group(contributions, codec=codec)
        budget = overlap_byte_budget([c.metadata for c in contributions], group_size=len(contributions))
        # A member dropped as too stale takes the round's update as a listener (a replay of it).
        listeners = [i for i in members if self.peers[i].peer_id not in result.members]
        for i in listeners:
            catch_up_bytes[i] += sum(len(p) for p in result.averaged.values())
        # Replaying missed updates (or downloading the state) costs the late member link time too.
        comm = max(
            self.transfer_time(
                result.sent_bytes.get(self.peers[i].peer_id, 0),
                result.received_bytes.get(self.peers[i].peer_id, 0) + catch_up_bytes[i],
            )
            for i in members
        )
        done_at = close + comm
        locals_ = [pending[i].local for i in members]
        landing = _Landing(result=result, byte_budget=budget, at=done_at)
        waits = []
        for i in members:
            # The exchange is known exactly here; a real node judges by its last one.
            compute = self.compute_time(i, pending[i].local)
            if overlap_this_round(self.cfg.train.overlap, comm_s=comm, compute_s=compute):
                # The member trains on from the moment it contributed; the update lands mid-round.
                pending[i] = self._start(i, at=pending[i].ready_at, landing=landing)
                waits.append(pending[i].idle_s)
            else:
                self._land(i, landing)
                waits.append(done_at - pending[i].ready_at)
                pending[i] = self._start(i, at=done_at, from_theta=True)
        hashes = {self.peers[i].state.theta_hash() for i in members}
        if len(hashes) != 1:
            raise AssertionError(f"members of round {current.round} diverged: {len(hashes)} distinct θ")
        record = self._record(members, locals_, infos, result, comm, done_at, hashes.pop())
        record.wait_s = statistics.fmean(waits)
        record.catch_up_bytes = sum(catch_up_bytes.values())
        record.wire_bytes += record.catch_up_bytes
        record.wire_bytes_total += record.catch_up_bytes
        self.wire_total += record.catch_up_bytes
        record.batch_sizes = list(schedule_used.batch)
        record.batch_size = max(schedule_used.batch)
        record.instances = schedule_used.instances
        record.inner_steps = schedule_used.inner_steps
        return record

    def _catch_up(self, peer: Peer, leader: int) -> int:
        """Bring `peer` to the leader's round; returns the bytes that took (updates or full state)."""
        source = self.peers[leader].state
        if peer.state.round == source.round:
            return 0
        missed = [u for u in source.history if u.round >= peer.state.round]
        if missed and missed[0].round == peer.state.round:
            peer.catch_up(missed)
            return sum(len(p) for u in missed for p in u.averaged.values())
        peer.adopt_state(source)
        return sum(2 * t.numel() * t.element_size() for t in source.theta)  # θ and m

    def _record(
        self,
        members: list[int],
        locals_: list[LocalRound],
        infos: list[ContributionInfo],
        result: GroupResult,
        comm: float,
        done_at: float,
        theta_hash: str,
    ) -> RoundRecord:
        peer = self.peers[members[0]]
        state = peer.state
        wire = sum(result.sent_bytes.values())
        self.wire_total += wire
        self.tokens_total += sum(
            loc.tokens for loc, info in zip(locals_, infos, strict=True) if not info.dropped
        )
        staleness = [info.staleness for info in infos]
        return RoundRecord(
            round=state.round,
            sim_time_s=done_at,
            tokens=self.tokens_total,
            wire_bytes=wire,
            wire_bytes_total=self.wire_total,
            val_loss=peer.validation_loss(),
            inner_loss=statistics.fmean(loc.mean_loss for loc in locals_),
            batch_size=max(state.schedule.batch),
            batch_sizes=list(state.schedule.batch),
            accum_steps=max(loc.accum_steps for loc in locals_),
            instances=state.schedule.instances,
            inner_steps=state.schedule.inner_steps,
            codec=infos[0].codec,
            group_size=len(result.members),
            staleness_mean=statistics.fmean(staleness),
            staleness_max=max(staleness),
            late_contributions=sum(1 for info in infos if info.staleness > 0 and not info.dropped),
            late_corrected=sum(
                1
                for info in infos
                if info.correction is not None and info.correction.shrink + info.correction.rotate
            ),
            corrected_tensors=sum(
                info.correction.shrink + info.correction.rotate
                for info in infos
                if info.correction is not None
            ),
            late_dropped=sum(1 for info in infos if info.dropped),
            comm_s=comm,
            wait_s=0.0,
            catch_up_bytes=0,
            theta_hash=theta_hash,
            wall_s=0.0,
        )


def initial_val_loss(sim: Simulator) -> float:
    """Validation loss of θ_0 (identical on every peer)."""
    with torch.no_grad():
        return sim.peers[0].validation_loss()


def records_as_dicts(records: list[RoundRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
