"""The simulator: N virtual peers in one process, running the real peer code over an in-memory transport.

Each virtual peer is a `Peer`, exactly what a swarm node runs, and averages through an `Averager`
as a swarm node does (the in-process `MemoryAverager`, with the reduction of the network all-reduce
and each part encoded by its owner's codec); catch-up, DyLU and the adaptive codec's byte budget are
the swarm's code too. What is simulated is time: compute time comes from a per-peer cost model
(seconds per sample × the peer's slowdown), communication time from the exact wire bytes each
member sends and receives over its modelled link. Training itself is real.

Modes:
- sync: every round waits for every peer (DiLoCo / AdLoCo).
- async: a round closes `window` simulated seconds after the first peer is ready; peers still
  training contribute to a later round with staleness τ, after replaying the updates they missed,
  HeLoCo-corrected against the momentum and weighted by ρ(τ) (unless correction is off).

With one-step-delay overlap (`TrainConfig.overlap`) a member starts its next local round as soon as
it has contributed, and the round's update lands at the first inner step that ends after the
transfer has (in simulated time); a member that finishes its local round first waits for it.
`RoundRecord.wait_s` is the members' mean time idle, waiting for the group and its transfer.

Scoring (`TrainConfig.score`, issue 10 §3): the hub judges each contribution's whole Δ at the close
of its round on a batch of training data drawn from a stream of the simulator's own, seeded apart
from every peer's (no peer can choose it), from the round's θ; the excluded contributors are left out
of the round (`RoundRecord.group_size` shows it) and take its update as listeners.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ...protocol.algorithms.adaptive import predicted_wire_bytes
from ...protocol.algorithms.allreduce import Contribution
from ...protocol.algorithms.claims import ClaimBounds
from ...protocol.algorithms.codecs import decode, make_codec, sum_payload
from ...protocol.algorithms.parts import Aggregate
from ...protocol.algorithms.scoring import SCORE_SEED_OFFSET, SCORE_SEQUENCES, RoundScorer, Score
from ...protocol.algorithms.trust import WorkLedger
from ...protocol.transport.averager import MemberResult
from ...protocol.transport.memory import MemoryAverager, MemoryHub
from ...protocol.transport.wire import (
    EXCHANGE_SLACK,
    PART_FLOOR_S,
    REDUCE_FLOOR_S,
    exchange_budget_s,
    late_answer_s,
)
from ..data.corpus import Corpus
from ..data.sampling import TokenSampler, corpus_stream, evaluate
from ..model.devices import resolve_device
from ..training.catchup import catch_up
from ..training.config import TrainConfig
from ..training.peer import Peer, overlap_this_round
from ..training.replica import PeerState, Update
from ..training.rounds import ContributionInfo, LocalRound, RoundRecord
from .compute import StepCurve

logger = logging.getLogger(__name__)

# In process a round's averaging is a few reductions: far below this, unless something is wrong.
AVERAGE_TIMEOUT_S = 600.0
# What a hostile virtual peer sends in place of its Δ (issue 10 §3), each tensor encoded in int8:
# flip1000: −1000 Δ; flip: −Δ, claiming the most tokens and weight the schedule allows (flip3: −3 Δ
# so); random: a fresh Gaussian direction each round at Δ's norm; constant: one fixed direction at Δ's norm.
# stall (issue 25 §2, sync mode): the liveness attack, modelled in simulated time (`Simulator._stalls`).
ATTACKS = ("none", "flip1000", "flip", "flip3", "random", "constant", "stall")


def forge(honest: Contribution, attack: str, *, seed: int, bounds: ClaimBounds) -> Contribution:
    """The contribution a hostile peer sends instead of `honest` (int8-coded, as honest ones):
    flip1000: −1000 Δ; flip: −Δ at normal norm, claiming the most tokens and weight the round's
    bounds allow; flip3: −3 Δ with that claim (well under the norm screening's factor); random:
    Gaussian noise at Δ's norm (new each call, from `seed`); constant: the same noise direction
    every round, at Δ's norm. Shared by the simulator and bench/robust_swarm.py."""
    codec = make_codec("int8")
    payloads: dict[str, bytes] = {}
    for n, (key, payload) in enumerate(honest.payloads.items()):
        delta = decode(payload)
        if attack == "flip1000":
            forged = delta * -1000.0
        elif attack == "flip":
            forged = -delta
        elif attack == "flip3":
            forged = -3.0 * delta
        else:
            generator = torch.Generator().manual_seed(n if attack == "constant" else seed + n)
            forged = torch.randn(delta.shape, generator=generator)
            forged *= torch.linalg.vector_norm(delta) / torch.linalg.vector_norm(forged).clamp_min(1e-30)
        payloads[key] = codec.encode(key, forged)
    weight, tokens = honest.weight, honest.tokens
    if attack in ("flip", "flip3"):
        tokens = bounds.max_tokens if bounds.max_tokens is not None else tokens * 1e6
        weight = tokens * (bounds.max_weight_per_token or 1.0)
    return replace(honest, payloads=payloads, weight=weight, tokens=tokens)


def sum_bomb(size: int, shape: tuple[int, ...]) -> bytes:
    """A valid `sum` payload of exactly `size` bytes and this shape, of as many tiny sparse parts as
    fit, each decoding to a whole tensor of the shape (issue 25's sum bomb: unbounded work from
    small bytes). Used by tests/test_averager_contract.py and bench/hostile_node.py."""
    numel = math.prod(shape)
    lengths: dict[int, bytes] = {}
    for k in range(1, 200):
        part = make_codec(f"sparse:{k}/{numel}:1").encode("x", torch.ones(*shape))
        lengths.setdefault(len(part), part)
    tiny = min(lengths.items())[1]
    empty = len(sum_payload([tiny], [1.0])) - len(tiny) - 8  # header and count
    for count in range((size - empty) // (len(tiny) + 8), 0, -1):
        left = size - empty - count * (len(tiny) + 8) - 8
        if left in lengths:
            parts = [tiny] * count + [lengths[left]]
            return sum_payload(parts, [1.0] * len(parts))
    raise ValueError(f"no sum payload of {size} bytes and shape {shape}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated swarm.

    slowdown: per-peer step-time multipliers (cycled over the peers), e.g. (1, 1, 1, 5) for one peer
        five times slower. sec_per_sample: modelled compute seconds for one training sample (one
        sequence) at slowdown 1; 0.004 matches the tiny default model on this 2-core machine.
    step_curve: a measured step time per batch size (`compute.StepCurve`, `--step-curve`): a round
        then takes its passes at the curve's times (times the slowdown) instead of sec_per_sample.
    bandwidth_mbps / latency_s: each peer's symmetric link. window_s: async matchmaking window in
        simulated seconds (None: a quarter of the fastest peer's first round). DyLU is
        `train.dylu`, as on a node.
    """

    peers: int = 4
    rounds: int = 20
    mode: Literal["sync", "async"] = "sync"
    train: TrainConfig = field(default_factory=TrainConfig)
    slowdown: tuple[float, ...] = (1.0,)
    sec_per_sample: float = 0.004
    step_curve: StepCurve | None = None
    bandwidth_mbps: float = 20.0
    latency_s: float = 0.05
    window_s: float | None = None
    hostile: int = 0
    attack: str = "none"

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
        if not 0 <= self.hostile < self.peers:
            raise ValueError(f"hostile must be >= 0 and below the peers ({self.peers}), got {self.hostile}")
        if self.attack not in ATTACKS:
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {self.attack!r}")
        if (self.hostile > 0) != (self.attack != "none"):
            raise ValueError("hostile peers need an attack, and an attack needs hostile peers")
        if self.attack == "stall" and self.mode != "sync":
            raise ValueError("the stall attack is modelled in sync mode only")

    def slowdown_of(self, index: int) -> float:
        return self.slowdown[index % len(self.slowdown)]

    def is_hostile(self, index: int) -> bool:
        """The last `hostile` peers attack."""
        return index >= self.peers - self.hostile


@dataclass
class _Pending:
    """A virtual peer's local round in flight: ready at `ready_at` simulated seconds."""

    local: LocalRound
    ready_at: float
    idle_s: float = 0.0  # overlap: how long it waited at the end of this round for the last update


@dataclass(frozen=True)
class _Landing:
    """A group's result, arriving at its members at simulated time `at`."""

    result: MemberResult
    at: float


@dataclass(frozen=True)
class _LocalSource:
    """The most advanced virtual peer as a catch-up source (in the swarm: a peer over the network)."""

    peer: Peer

    def updates(self, from_round: int) -> Sequence[Update]:
        return [u for u in self.peer.state.history if u.round >= from_round]

    def state(self) -> PeerState:
        return self.peer.state


@dataclass
class _Exchange:
    """One round's contributions and what averaging them gave."""

    members: list[int]
    infos: list[ContributionInfo]
    result: MemberResult
    catch_up_bytes: dict[int, int]
    comm_s: float


class Simulator:
    """Drives N virtual peers through `rounds` applied rounds; see the module docstring."""

    def __init__(self, cfg: SimConfig, corpus: Corpus, *, vocab_size: int) -> None:
        self.cfg = cfg
        # Simulated peers share one process, and one device: the first of --device (on a machine of
        # several GPUs `auto` would give every simulated peer a worker process per further GPU).
        train = replace(cfg.train, device=str(resolve_device(cfg.train.device)))
        self.peers = [
            Peer(
                peer_id=f"peer{i:03d}",
                index=i,
                num_peers=cfg.peers,
                cfg=train,
                corpus=corpus,
                vocab_size=vocab_size,
            )
            for i in range(cfg.peers)
        ]
        self.scorer = self._scorer(corpus)
        # The simulator decides each group itself (`MemoryHub.expect`); the window only bounds a
        # round that somehow lost a member.
        self.hub = MemoryHub(
            window_s=AVERAGE_TIMEOUT_S,
            aggregate=Aggregate.parse(cfg.train.aggregate),
            outlier_factor=cfg.train.outlier_factor,
            scorer=self.scorer,
        )
        self.averagers = [MemoryAverager(self.hub, peer.peer_id) for peer in self.peers]
        self._pool = ThreadPoolExecutor(max_workers=cfg.peers, thread_name_prefix="adloco-sim")
        self._round_ids = 0
        self.records: list[RoundRecord] = []
        self.bytes_total = 0
        self.tokens_total = 0
        # The stall attack: whom the honest peers leave out (they all see a stall alike), and each
        # staller's rounds of accepted work since it was last caught (`_stalls`).
        self.ledger = WorkLedger()
        self.tries_lost = 0
        self.stalled_s = 0.0

    def _scorer(self, corpus: Corpus) -> RoundScorer | None:
        """The hub's scorer (`TrainConfig.score`): from the most advanced peer's θ (the members'
        after catch-up) on the next batch of a training-data stream seeded apart from every peer's."""
        score = Score.parse(self.cfg.train.score)
        if not score.on:
            return None
        # Its own model: the hub's thread must not swap parameters into a peer's instance.
        model = copy.deepcopy(self.peers[0].home_model)
        train = self.cfg.train
        stream = TokenSampler(
            corpus_stream(corpus, corpus.train), seq_len=train.seq_len, seed=train.seed + SCORE_SEED_OFFSET
        )
        return RoundScorer(
            score,
            theta=lambda: max(self.peers, key=lambda p: p.state.round).named_theta(),
            batch=lambda: stream.next_batch(SCORE_SEQUENCES),
            loss=lambda params, batch: evaluate(model, batch, micro_batch=SCORE_SEQUENCES, parameters=params),
            step=train.outer.lr,
        )

    # ---- time model --------------------------------------------------------------------------

    def compute_time(self, index: int, local: LocalRound) -> float:
        curve = self.cfg.step_curve
        if curve is not None:
            return curve.round_s(local.passes) * self.cfg.slowdown_of(index)
        return local.samples * self.cfg.sec_per_sample * self.cfg.slowdown_of(index)

    def sec_per_sample(self, index: int) -> float:
        """Modelled seconds per training sample of peer `index` now (for where an update lands
        mid-round): the curve's at the peer's current micro-batch, else `sec_per_sample`."""
        curve, peer = self.cfg.step_curve, self.peers[index]
        if curve is None:
            return self.cfg.sec_per_sample * self.cfg.slowdown_of(index)
        micro = min(max(peer.state.schedule.batch), peer.b_max)
        return curve.step_s(micro) / micro * self.cfg.slowdown_of(index)

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
        try:
            while len(self.records) < self.cfg.rounds:
                members, close = self._next_group(pending, window)
                record = self._group_round(members, pending, close)
                record.wall_s = time.perf_counter() - t_start
                self.records.append(record)
                if on_round is not None:
                    on_round(record)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return self.records

    def _next_group(self, pending: dict[int, _Pending], window: float) -> tuple[list[int], float]:
        """The members of the next round and when it closes (simulated seconds)."""
        if self.cfg.mode == "sync":
            close = max(p.ready_at for p in pending.values())
        else:
            # A round opens when the first *fresh* peer is ready and closes `window` later; late
            # peers never open a round alone, they join the next one (and are corrected there).
            latest = max(peer.state.round for peer in self.peers)
            fresh = [p.ready_at for p in pending.values() if p.local.base_round == latest]
            close = min(fresh) + window
        members = sorted(i for i, p in pending.items() if p.ready_at <= close)
        return members, max(pending[i].ready_at for i in members)

    def _start(
        self, index: int, *, at: float, landing: _Landing | None = None, from_theta: bool = False
    ) -> _Pending:
        """Run peer `index`'s next local round from simulated time `at`; with overlap, `landing`
        is applied after the first inner step that ends once it has arrived, or after the last
        (`Peer.train_round`'s `land`: the round then waits for it)."""
        peer = self.peers[index]
        sec_per_sample = self.sec_per_sample(index)
        landed, late = landing is None, False

        def on_step(samples_done: int) -> None:
            nonlocal landed
            if landing is not None and not landed and at + samples_done * sec_per_sample >= landing.at:
                peer.apply_round(landing.result)
                landed = True

        def land(_compute_s: float) -> None:
            nonlocal landed, late
            if landing is not None and not landed:
                peer.apply_round(landing.result)
                landed, late = True, True

        local = peer.train_round(
            on_step=on_step if landing is not None else None,
            from_theta=from_theta,
            land=land if landing is not None else None,
        )
        # What the group sees of this round is the modelled time, not this machine's (DyLU, budget).
        local.report_time(self.compute_time(index, local))
        ready_at = at + self.compute_time(index, local)
        idle = 0.0
        if late:
            # The local round ended first and waited for its update before contributing.
            assert landing is not None
            idle = max(0.0, landing.at - ready_at)
            ready_at += idle
        return _Pending(local=local, ready_at=ready_at, idle_s=idle)

    def _group_round(self, members: list[int], pending: dict[int, _Pending], close: float) -> RoundRecord:
        """Contribute, average and apply one round; the members' next local rounds are started."""
        schedule_used = max(self.peers, key=lambda p: p.state.round).state.schedule
        if self.cfg.attack == "stall":
            members, close = self._stalls(members, close)
        exchange = self._exchange(members, pending)
        if self.cfg.attack == "stall":  # every honest member's ledger alike: the round's work
            fresh = not self.ledger.listed()  # nobody listed anyone: every member owned (a fresh swarm)
            self.ledger.count(dict.fromkeys(exchange.result.members, 1.0))
            if fresh:
                self.ledger.found()  # as the averager: the first round's members are its founders
        done_at = close + exchange.comm_s
        landing = _Landing(result=exchange.result, at=done_at)
        locals_ = [pending[i].local for i in members]
        waits = [self._land_and_restart(i, pending, landing, exchange.comm_s) for i in members]
        hashes = {self.peers[i].state.theta_hash() for i in members}
        if len(hashes) != 1:
            raise AssertionError(f"members of round {schedule_used.round} diverged: {len(hashes)} distinct θ")
        return self._record(exchange, locals_, done_at, hashes.pop(), waits, schedule_used.batch)

    def _stalls(self, members: list[int], close: float) -> tuple[list[int], float]:
        """The stall attack (issue 25 §2) under the swarm's rules, in simulated time: who is left of
        `members` and when their try that completes closes.

        A staller plays its best known strategy: it contributes honestly until the members list it
        (`trust.WorkLedger`: the same code, one ledger for every honest member, which all see the
        same rounds; a founder is listed after the swarm's first round, `found`), so that it owns
        parts; then it takes them and never answers. The try fails once most owners have answered
        and the rest are late (`wire.late_answer_s` of the honest owners' answer time, the link's:
        `transfer_time` of a Δ each way), or where fewer than three own, after the exchange budget
        (`_exchange_budget_s`). The members demote it (`demote`: its
        record ends, and every record needs more rounds before it is listed) and the next try
        completes with it as a member. It never needs a new key here: a late owner is not left out,
        and a fresh key's record starts where a demoted one's does. In a fresh swarm's first round
        every member owns (`trust.eligible_owners`); a staller answers honestly there, since that
        round makes it a founder, listed from the next (stalling in the first instead, as
        robust_swarm's founder does with `owner-stall`, fails that try, and the round that completes
        without its work makes it no founder)."""
        while True:
            listed = set(self.ledger.listed())
            owners = [i for i in members if self.peers[i].peer_id in listed]
            stalling = [i for i in owners if self.cfg.is_hostile(i)]
            if not stalling:
                return members, close
            if len(owners) >= 3:
                peer = self.peers[members[0]]
                theta = dict(zip(peer.names, peer.state.theta, strict=True))
                delta = predicted_wire_bytes(peer.state.schedule.codec, theta)
                cost = late_answer_s(self.transfer_time(delta, delta))
            else:
                cost = self._exchange_budget_s(members)
            close += cost
            self.tries_lost += 1
            self.stalled_s += cost
            for i in stalling:
                self.ledger.demote(self.peers[i].peer_id)

    def _exchange_budget_s(self, members: list[int]) -> float:
        """How long a member waits for every answer (`wire.exchange_budget_s`, as the averager, at
        adloco-node's default floors and slack), for the most bytes one member moves: about twice a
        Δ (its Δ up, the averages of its parts back) at the link's rate."""
        peer = self.peers[members[0]]
        theta = dict(zip(peer.names, peer.state.theta, strict=True))
        moved = 2 * predicted_wire_bytes(peer.state.schedule.codec, theta)
        return exchange_budget_s(
            moved,
            self.cfg.bandwidth_mbps * 1e6 / 8,
            slack=EXCHANGE_SLACK,
            part_floor_s=PART_FLOOR_S,
            reduce_floor_s=REDUCE_FLOOR_S,
        )

    def _exchange(self, members: list[int], pending: dict[int, _Pending]) -> _Exchange:
        """Catch the members up, average their contributions through their averagers, time it."""
        leader = max(self.peers, key=lambda p: p.state.round)
        source, expected = _LocalSource(leader), leader.state.theta_hash()
        catch_up_bytes = {
            i: catch_up(self.peers[i], source, expected_hash=expected).bytes
            if self.peers[i].state.round < leader.state.round
            else 0
            for i in members
        }
        offers = [
            self.peers[i].contribute(pending[i].local, bandwidth_bps=self.cfg.bandwidth_mbps * 1e6)
            for i in members
        ]
        infos = [info for _, info in offers]
        contributing = [
            (i, self._attack(i, c) if self.cfg.is_hostile(i) and self.cfg.attack != "stall" else c)
            for i, (c, _) in zip(members, offers, strict=True)
            if c is not None
        ]
        if not contributing:
            raise RuntimeError("every contribution of the round was dropped as too stale")
        result = self._average(contributing)
        for i in members:
            if self.peers[i].peer_id not in result.members:
                # Dropped as too stale: it takes the round's update as a listener (a replay of it).
                catch_up_bytes[i] += sum(len(p) for p in result.averaged.values())
        # Replaying missed updates (or downloading the state) costs the late member link time too.
        comm = max(
            self.transfer_time(
                result.sent_bytes.get(self.peers[i].peer_id, 0),
                result.received_bytes.get(self.peers[i].peer_id, 0) + catch_up_bytes[i],
            )
            for i in members
        )
        return _Exchange(members, infos, result, catch_up_bytes, comm)

    def _attack(self, index: int, honest: Contribution) -> Contribution:
        """What hostile peer `index` sends instead of `honest` (`ATTACKS`)."""
        seed = (self._round_ids << 20) + (index << 10)
        return forge(honest, self.cfg.attack, seed=seed, bounds=self.peers[index].claim_bounds())

    def _average(self, contributing: Sequence[tuple[int, Contribution]]) -> MemberResult:
        """Every contributor calls its averager on its own thread, as a swarm node would; returns the
        (identical) result they get."""
        round_id = self._round_ids
        self._round_ids += 1
        self.hub.expect("", round_id, [c.peer_id for _, c in contributing])
        calls = [
            self._pool.submit(
                self.averagers[i].average,
                c,
                round=round_id,
                codec=self.peers[i].downlink_codec(self.peers[i].state.schedule.codec),
                timeout=AVERAGE_TIMEOUT_S,
                bounds=self.peers[i].claim_bounds(),
            )
            for i, c in contributing
        ]
        results = [call.result() for call in calls]
        first = next((r for r in results if r is not None), None)
        # Only a contribution the scorer excluded gets None (it takes the update as a listener).
        if first is None or any(
            r is None and c.peer_id in first.members for r, (_, c) in zip(results, contributing, strict=True)
        ):
            raise RuntimeError(f"round {round_id}: a virtual peer got no result from the in-process averager")
        return first

    def _land_and_restart(
        self, i: int, pending: dict[int, _Pending], landing: _Landing, comm_s: float
    ) -> float:
        """Apply the round to member `i` (mid-round under overlap) and start its next local round;
        returns how long it sat idle waiting for the update."""
        # The exchange is known exactly here; a real node judges by its last one.
        compute = self.compute_time(i, pending[i].local)
        if overlap_this_round(self.cfg.train.overlap, comm_s=comm_s, compute_s=compute):
            # The member trains on from the moment it contributed; the update lands mid-round.
            pending[i] = self._start(i, at=pending[i].ready_at, landing=landing)
            return pending[i].idle_s
        self.peers[i].apply_round(landing.result)
        wait = landing.at - pending[i].ready_at
        pending[i] = self._start(i, at=landing.at, from_theta=True)
        return wait

    def _record(
        self,
        exchange: _Exchange,
        locals_: list[LocalRound],
        done_at: float,
        theta_hash: str,
        waits: list[float],
        batch: tuple[int, ...],
    ) -> RoundRecord:
        peer = self.peers[exchange.members[0]]
        state = peer.state
        result, infos = exchange.result, exchange.infos
        catch_up_bytes = sum(exchange.catch_up_bytes.values())
        sent = sum(result.sent_bytes.values()) + catch_up_bytes
        self.bytes_total += sent
        tokens = sum(loc.tokens for loc, info in zip(locals_, infos, strict=True) if not info.dropped)
        self.tokens_total += tokens
        staleness = [info.staleness for info in infos]
        corrections = [info.correction for info in infos if info.correction is not None]
        previous = self.records[-1].sim_time_s if self.records else None
        round_s = done_at - (previous or 0.0)
        return RoundRecord(
            round=state.round,
            val_loss=peer.validation_loss(),
            inner_loss=statistics.fmean(loc.mean_loss for loc in locals_),
            theta_hash=theta_hash,
            tokens=tokens,
            tokens_total=self.tokens_total,
            tokens_per_s=tokens / max(round_s, 1e-9),
            batch_sizes=list(batch),
            accum_steps=max(loc.accum_steps for loc in locals_),
            instances=len(batch),
            inner_steps=max(loc.inner_steps for loc in locals_),
            codec=infos[0].codec,
            group_size=len(result.members),
            staleness=max(staleness),
            # Every byte one member sends another receives; catch-up bytes are received from a peer.
            bytes_sent=self.bytes_total,
            bytes_received=self.bytes_total,
            round_bytes=sent,
            round_s=round_s,
            wait_s=statistics.fmean(waits),
            compute_s=statistics.fmean(loc.report.round_compute_s for loc in locals_),
            contribution_bytes=infos[0].wire_bytes,
            rejected_parts=sum(result.rejected.values()),
            malformed_reports=len(result.malformed),
            sim_time_s=done_at,
            staleness_mean=statistics.fmean(staleness),
            late_contributions=sum(1 for info in infos if info.staleness > 0 and not info.dropped),
            late_corrected=sum(1 for c in corrections if c.shrink + c.rotate),
            corrected_tensors=sum(c.shrink + c.rotate for c in corrections),
            late_dropped=sum(1 for info in infos if info.dropped),
            comm_s=exchange.comm_s,
            catch_up_bytes=catch_up_bytes,
        )


def initial_val_loss(sim: Simulator) -> float:
    """Validation loss of θ_0 (identical on every peer)."""
    with torch.no_grad():
        return sim.peers[0].validation_loss()


def records_as_dicts(records: list[RoundRecord]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]
