"""The node in a swarm: the same `Peer` round as the simulator, averaged over hivemind.

Per round: train locally, catch up if the swarm moved on meanwhile (replay of the updates peers
keep, or a verified full state download), contribute (HeLoCo-corrected and staleness-weighted when
late), average with the peers ready within the matchmaking window (`HivemindAverager`), apply the
outer step, publish (round, θ hash, schedule) in the DHT. Joiners adopt the published state first.

Everything a run shares is namespaced by its prefix: run id + a fingerprint of the protocol version
and the model's parameter shapes, so a node of another run or another model never averages with us.
The corpus is not in the fingerprint: its train/validation split is by file-path hash, the same on
every Python version, so volunteers on different Pythons train together (their files differ a bit).

With one-step-delay overlap (DiLoCoX, `--overlap`; auto by default) the averaging of round r runs on a
background thread while the instances train round r+1; the update is applied between two inner steps
as soon as it lands (or, if the local round ends first, after waiting for it), and the instances'
progress is moved onto the new θ (mix by default). Under auto a round overlaps only while the last
averaging call took no longer than the last local round; otherwise it waits for the update first.
Each round's status line says how long the node sat idle waiting for communication (`wait_s`).

DyLU (`--dylu`, Async DiLoCo): a node shortens its H to its speed relative to the fastest member of
its last group (from the gathered step times), so a slow node finishes with the others.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...protocol.algorithms.allreduce import Contribution, GroupResult
from ...protocol.algorithms.pseudograd import tensors_hash
from ...protocol.algorithms.schedule import Schedule, accumulation_for
from ...protocol.transport.dht import NetworkConfig, start_dht, visible_maddrs
from ...protocol.transport.hivemind_averager import HivemindAverager
from ...protocol.transport.records import BeaconRecord, RunRecords, StateRecord, dht_time, run_prefix
from ...protocol.transport.state_transfer import StateServer, StateSnapshot, UpdateRecord
from ..operations.checkpoint import load_checkpoint, peek_checkpoint, save_checkpoint
from ..operations.control import AveragingInfo, NodeStatus, ScheduleInfo
from ..operations.metrics import NodeMetrics
from ..training.config import TrainConfig
from ..training.model import model_fingerprint
from ..training.peer import ContributionInfo, LocalRound, Peer, PeerState, Update, overlap_this_round
from ..training.runtime import load_data

logger = logging.getLogger(__name__)

RECORD_TTL_S = 600.0
MAX_ATTEMPTS = 3
# Averager round ids are single-use: id = round × stride + the number of earlier tries at that round.
# Peers that reach a round meet at its first id; after a round failed everywhere they meet at the next.
ROUND_ID_STRIDE = 1000


@dataclass(frozen=True)
class SwarmConfig:
    """The swarm side of a node.

    run_id: swarms with different run ids never mix. window_s: the matchmaking window: how long a
        round waits for more ready peers after the first (raise it if groups often miss peers that
        finish a little later; it never waits for the slowest peer). part_timeout_s: how long an
        owner waits for parts before dropping a silent member. data_shard / data_shards: which part
        of the corpus this node trains on (default: random). simulate_slowdown: a test and benchmark
        knob that makes this node F× slower (it idles (F−1)× its compute time after each local
        phase), to study heterogeneous swarms on one machine. dylu: shorten H to this node's speed
        relative to the fastest member of its last group.
    """

    run_id: str = "default"
    rounds: int = 0
    window_s: float = 3.0
    part_timeout_s: float = 15.0
    status_file: Path | None = None
    data_shard: int | None = None
    data_shards: int = 16
    simulate_slowdown: float = 1.0
    dylu: bool = False
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10


@dataclass
class _InFlight:
    """A contribution being averaged on the background thread while the instances train on."""

    local: LocalRound
    info: ContributionInfo
    future: Future[GroupResult | None]


class StatusLog:
    """One JSON object per line, appended and flushed: what `adloco-swarm` and operators read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


class SwarmNode:
    """A volunteer node: joins the DHT, trains, averages, publishes; see the module docstring."""

    def __init__(
        self, cfg: TrainConfig, net: NetworkConfig, swarm: SwarmConfig, metrics: NodeMetrics | None = None
    ) -> None:
        self.cfg, self.net, self.swarm = cfg, net, swarm
        self.metrics = metrics or NodeMetrics()
        self.status = StatusLog(swarm.status_file)
        self.lock = threading.Lock()  # guards peer.state against the state server's thread
        # Everything that can fail on bad input happens before the DHT (and its p2pd) starts.
        corpus, tokenizer = load_data(cfg)
        shard = swarm.data_shard
        if shard is None and swarm.checkpoint_dir is not None:
            # A resumed node keeps the shard its instances' data streams came from.
            info = peek_checkpoint(swarm.checkpoint_dir)
            saved = None if info is None else info.extra.get("data_shard")
            shard = saved if isinstance(saved, int) and 0 <= saved < swarm.data_shards else None
        if shard is None:
            shard = _random_shard(swarm.data_shards)
        self.data_shard = shard
        self.peer = Peer(
            peer_id="",
            index=shard,
            num_peers=swarm.data_shards,
            cfg=cfg,
            corpus=corpus,
            vocab_size=tokenizer.vocab_size,
        )
        self.prefix = run_prefix(swarm.run_id, model_fingerprint(self.peer.eval_model))
        self.dht = start_dht(net)
        try:
            self.peer_id = self.peer.peer_id = self.dht.peer_id.to_base58()
            self.records = RunRecords(self.dht, prefix=self.prefix, run_id=swarm.run_id, ttl_s=RECORD_TTL_S)
            self.averager = HivemindAverager(
                self.dht, prefix=self.prefix, window_s=swarm.window_s, part_timeout_s=swarm.part_timeout_s
            )
            self.server = StateServer(
                self.dht, prefix=self.prefix, snapshot=self._snapshot, updates=self._updates
            )
        except BaseException:
            self.dht.shutdown()
            raise
        self.bytes_sent = 0
        self.bytes_received = 0
        self.payload_sent = 0  # encoded tensor bytes only; bytes_* include the protocol's framing
        self.payload_received = 0
        self.last_group_size = 0
        self.last_staleness = 0
        self.last_heloco: dict[str, int] | None = None
        self.dropped = 0  # contributions that never made it into an applied round
        self.rejected_parts = 0  # parts of group members the owners screened out (non-finite, outlier)
        self.on_round: Callable[[dict[str, Any]], None] | None = None
        self._tries: dict[int, int] = {}
        self._inflight: _InFlight | None = None
        self._last_info: ContributionInfo | None = None
        self._last_comm_s: float | None = None  # the last averaging call, start to result
        self._last_compute_s: float | None = None  # the last local round (simulated slowdown included)
        self.tokens_total = 0
        self.tokens_per_s = 0.0
        self._raw_bytes = 4 * sum(t.numel() for t in self.peer.state.theta)
        self._applied = 0
        self._last_report = time.perf_counter()
        # Operations (the control plane reads these from its own threads).
        self.phase = "starting"
        self.draining = threading.Event()
        self.last_averaging: AveragingInfo | None = None
        self.last_checkpoint: tuple[int, str] | None = None
        self.peers_visible = 0
        self._report_fields: dict[str, Any] = {}
        self._started = time.monotonic()
        self._saved_at = -1
        self._requests_lock = threading.Lock()
        self._checkpoint_requests: list[Future[tuple[int, str]]] = []

    @property
    def maddrs(self) -> list[str]:
        return visible_maddrs(self.dht)

    # ---- state published in the DHT -------------------------------------------------------------

    def publish(self) -> None:
        """Announce (round, θ hash, schedule), signed, so joiners and laggards know where the swarm is."""
        state = self.peer.state
        record = StateRecord(
            peer_id=self.peer_id,
            round=state.round,
            theta_hash=state.theta_hash(),
            schedule=json.dumps(state.schedule.to_dict(), sort_keys=True),
        )
        self.records.publish_state(record)
        beacon = BeaconRecord(
            round=state.round,
            tokens=self.tokens_total,
            tokens_per_s=float(self.tokens_per_s),
            updated=dht_time(),
        )
        self.records.publish_beacon(beacon)

    def swarm_head(self) -> tuple[int, str, list[str], Counter[str]] | None:
        """The latest round any peer published, the other peers' majority θ hash at it, those
        holding it, and how many others hold each hash there (None: no records yet)."""
        records = self.records.states()
        self.peers_visible = len({r.peer_id for r in records})
        self.metrics.peers.set(self.peers_visible)
        if not records:
            return None
        top = max(r.round for r in records)
        hashes = Counter(r.theta_hash for r in records if r.round == top and r.peer_id != self.peer_id)
        if not hashes:
            return top, "", [], hashes
        best = hashes.most_common(1)[0][0]
        holders = sorted({r.peer_id for r in records if r.round == top and r.theta_hash == best})
        return top, best, [p for p in holders if p != self.peer_id], hashes

    # ---- serving state (called on the state server's thread) ---------------------------------------

    def _snapshot(self) -> StateSnapshot:
        with self.lock:
            state = self.peer.state
            names = self.peer.names
            return StateSnapshot(
                round=state.round,
                schedule=state.schedule.to_dict(),
                theta={n: t.detach().cpu().clone() for n, t in zip(names, state.theta, strict=True)},
                momentum={n: t.detach().cpu().clone() for n, t in zip(names, state.momentum, strict=True)},
                theta_hash=state.theta_hash(),
            )

    def _updates(self, from_round: int) -> list[UpdateRecord]:
        with self.lock:
            return [
                UpdateRecord(u.round, dict(u.averaged), u.schedule.to_dict(), u.merge)
                for u in self.peer.state.history
                if u.round >= from_round
            ]

    # ---- catching up ------------------------------------------------------------------------------

    def sync_with_swarm(self) -> int:
        """Reach the swarm's published round: replay kept updates, else download the state.

        Also heals a fork: if this node holds the swarm's round with another θ than most peers (it
        averaged that round in a group apart from theirs, e.g. a joiner whose fresh DHT view missed
        their registrations), it downloads the majority's state.
        """
        head = self.swarm_head()
        if head is None:
            return 0
        top, expected, holders, others = head
        behind = top - self.peer.state.round
        if not holders:
            return 0
        if behind <= 0:
            mine = self.peer.state.theta_hash()
            if behind < 0 or expected == mine or others[expected] <= others[mine] + 1:
                return 0
            return self._heal_fork(holders, expected)
        for holder in holders:
            try:
                if self._replay_from(holder, expected) or self._download_from(holder, expected):
                    self.status.write("catch_up", round=self.peer.state.round, behind=behind, source=holder)
                    return behind
            except Exception as e:  # a holder that left or answered badly: try the next one
                logger.warning("[%s round=%d] catch-up from %s failed: %s", *self._tag(), holder[-6:], e)
        return 0

    def _heal_fork(self, holders: list[str], expected: str) -> int:
        logger.warning(
            "[%s round=%d] θ differs from %d peers' at the same round: taking theirs",
            *self._tag(),
            len(holders),
        )
        for holder in holders:
            try:
                if self._download_from(holder, expected):
                    self.status.write("fork_healed", round=self.peer.state.round, source=holder)
                    return 0
            except Exception as e:
                logger.warning("[%s round=%d] fork repair from %s failed: %s", *self._tag(), holder[-6:], e)
        return 0

    def _replay_from(self, holder: str, expected_hash: str) -> bool:
        records = self.server.fetch_updates(holder, from_round=self.peer.state.round)
        if not records or records[0].round != self.peer.state.round:
            return False
        updates = [Update(r.round, r.averaged, Schedule.from_dict(r.schedule), r.merge) for r in records]
        with self.lock:
            self.peer.catch_up(updates)
            ok = self.peer.state.theta_hash() == expected_hash
        if ok:
            self.metrics.replays.inc()
        if not ok:
            logger.warning("replayed θ does not match the published hash; downloading the state instead")
        return ok

    def _download_from(self, holder: str, expected_hash: str) -> bool:
        snap = self.server.fetch_state(holder)
        theta = [snap.theta[n].to(self.peer.device) for n in self.peer.names]
        if snap.theta_hash != expected_hash or tensors_hash(theta) != expected_hash:
            raise ValueError("downloaded θ does not match the hash the swarm published")
        state = PeerState(
            theta=theta,
            momentum=[snap.momentum[n].to(self.peer.device) for n in self.peer.names],
            round=snap.round,
            schedule=Schedule.from_dict(snap.schedule),
        )
        with self.lock:
            self.peer.adopt_state(state)
        self.metrics.downloads.inc()
        self.status.write("state_download", round=snap.round, source=holder)
        return True

    # ---- the round --------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Train until `swarm.rounds` rounds are applied (0: until stopped or drained); returns the
        rounds applied. Checkpoints: resumed from at start, written every `checkpoint_every` rounds,
        on request between rounds, and at the end."""
        stop = lambda: should_stop() or self.draining.is_set()  # noqa: E731
        self.status.write("start", peer_id=self.peer_id, maddrs=self.maddrs, prefix=self.prefix)
        self.resume()
        self.sync_with_swarm()
        self.publish()
        self._last_report = time.perf_counter()
        try:
            if self.peer.overlap:
                self._run_overlapped(stop)
            else:
                while not self._enough(stop):
                    local = self._local_round()
                    t0 = time.perf_counter()
                    self.phase = "averaging"
                    if self.contribute_until_applied(local):
                        self._applied += 1
                        self.report(local, wait_s=time.perf_counter() - t0)
                    else:
                        self._count_dropped(self.peer.state.round - local.base_round)
                    self._between_rounds()
            try:
                self.save(final=True)
            except OSError as e:
                logger.warning("[%s round=%d] final checkpoint failed: %s", *self._tag(), e)
        finally:
            self.phase = "stopped"
            self._fail_checkpoint_requests("the node stopped")
        self.status.write("done", rounds=self._applied)
        return self._applied

    def _enough(self, should_stop: Callable[[], bool]) -> bool:
        planned = self._applied + (self._inflight is not None)
        return should_stop() or (self.swarm.rounds > 0 and planned >= self.swarm.rounds)

    # ---- operations: checkpoints, drain, status ---------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest usable checkpoint in --checkpoint-dir, if there is one."""
        if self.swarm.checkpoint_dir is None:
            return
        with self.lock:
            extra = load_checkpoint(self.swarm.checkpoint_dir, self.peer.load_state_dict)
        if extra is None:
            return
        self.tokens_total = int(extra.get("tokens_total", 0))
        self.last_checkpoint = (self.peer.state.round, str(self.swarm.checkpoint_dir))
        logger.warning(
            "[%s] resumed from the checkpoint of round %d", self.peer_id[-6:], self.peer.state.round
        )
        self.status.write("resumed", round=self.peer.state.round, theta_hash=self.peer.state.theta_hash())

    def save(self, *, final: bool = False) -> tuple[int, str] | None:
        """Write a checkpoint now (call between rounds, on the training thread)."""
        if self.swarm.checkpoint_dir is None:
            return None
        with self.lock:
            path = save_checkpoint(
                self.swarm.checkpoint_dir,
                self.peer.state_dict(),
                extra={"tokens_total": self.tokens_total, "data_shard": self.data_shard},
            )
        self.last_checkpoint = (self.peer.state.round, str(path))
        self.status.write("checkpoint", round=self.peer.state.round, path=str(path), final=final)
        return self.last_checkpoint

    def _between_rounds(self) -> None:
        """The round boundary: periodic checkpoints and the ones operators asked for."""
        every = self.swarm.checkpoint_every
        due = (
            every > 0 and self._applied > 0 and self._applied % every == 0 and self._saved_at != self._applied
        )
        with self._requests_lock:
            requests, self._checkpoint_requests = self._checkpoint_requests, []
        if not (due or requests):
            return
        try:
            written = self.save()
            self._saved_at = self._applied
        except OSError as e:  # disk full, volume gone: keep training, say so, retry next time
            logger.warning("[%s round=%d] checkpoint failed: %s", *self._tag(), e)
            self.status.write("checkpoint_failed", round=self.peer.state.round, error=str(e))
            for request in requests:
                request.set_exception(UserError(f"checkpoint failed: {e}"))
            return
        for request in requests:
            request.set_result(written or (self.peer.state.round, ""))

    def _fail_checkpoint_requests(self, why: str) -> None:
        with self._requests_lock:
            requests, self._checkpoint_requests = self._checkpoint_requests, []
        for request in requests:
            request.set_exception(UserError(f"checkpoint: {why}"))

    def request_checkpoint(self, timeout: float | None = None) -> tuple[int, str]:
        """Control plane: a checkpoint at the next round boundary; blocks until it is written."""
        if self.swarm.checkpoint_dir is None:
            raise UserError("checkpoint: --checkpoint-dir is not set")
        if self.phase == "stopped":
            raise UserError("checkpoint: the node has stopped")
        with self._requests_lock:
            if not self._checkpoint_requests:
                self._checkpoint_requests.append(Future())
            request = self._checkpoint_requests[0]
        return request.result(timeout)

    def request_drain(self) -> str:
        """Control plane: finish the round, checkpoint, leave."""
        if self.phase in ("draining", "stopped"):
            raise UserError(f"drain: the node is already {self.phase}")
        self.draining.set()
        return f"draining: finishing round {self.peer.state.round + 1}, then checkpoint and leave"

    def node_status(self) -> NodeStatus:
        """Control plane: what the node is doing (cheap; read without the training thread's help)."""
        state = self.peer.state
        schedule = state.schedule
        last = self._report_fields
        checkpoint_round, checkpoint_path = self.last_checkpoint or (None, "")
        return NodeStatus(
            peer_id=self.peer_id,
            run_id=self.swarm.run_id,
            round=state.round,
            phase="draining" if self.draining.is_set() and self.phase != "stopped" else self.phase,
            peers_visible=self.peers_visible,
            last_averaging=self.last_averaging,
            schedule=ScheduleInfo(
                batch_sizes=schedule.batch,
                inner_steps=schedule.inner_steps,
                accumulation=tuple(p.accum for p in accumulation_for(schedule, self.peer.b_max)),
                codec=schedule.codec,
            ),
            val_loss=last.get("val_loss"),
            inner_loss=last.get("inner_loss"),
            tokens_per_s=float(last.get("tokens_per_s", 0.0)),
            uptime_s=time.monotonic() - self._started,
            last_checkpoint_round=checkpoint_round,
            last_checkpoint_path=checkpoint_path,
        )

    def _local_round(
        self, on_step: Callable[[int], None] | None = None, *, from_theta: bool = False
    ) -> LocalRound:
        last = time.perf_counter()

        def step_done(samples: int) -> None:
            nonlocal last
            now = time.perf_counter()
            self.metrics.inner_step.observe(now - last)
            last = now
            if on_step is not None:
                on_step(samples)

        self.phase = "training"
        local = self.peer.train_round(on_step=step_done, from_theta=from_theta)
        self.tokens_total += local.tokens
        self.metrics.tokens.inc(local.tokens)
        self.metrics.samples.inc(local.samples)
        slowdown = self.swarm.simulate_slowdown
        if slowdown > 1:
            time.sleep((slowdown - 1) * local.compute_s)
        self._last_compute_s = local.compute_s * slowdown
        if slowdown > 1:
            # Report the step time others see (DyLU compares it), slowdown included.
            local.report = replace(local.report, step_time_s=local.report.step_time_s * slowdown)
        return local

    # ---- one-step-delay overlap ------------------------------------------------------------------

    def _run_overlapped(self, should_stop: Callable[[], bool]) -> None:
        """Contribute round r, train round r+1 while it is averaged, apply r when it lands."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="adloco-averaging")
        try:
            while not self._enough(should_stop):
                from_theta = False
                if self._inflight is not None and not overlap_this_round(
                    self.cfg.overlap, comm_s=self._comm_estimate(), compute_s=self._last_compute_s
                ):
                    # auto: the exchange outlasts a local round, so this round waits for the update.
                    self._wait_and_land(stopping=False)
                    from_theta = True
                local = self._local_round(on_step=self._land_if_done, from_theta=from_theta)
                if self._inflight is not None:
                    self._wait_and_land(stopping=False)
                    # Δ is measured from the θ the instances were rebased onto.
                    local.base_round = self.peer.phase_round
                self._between_rounds()
                if should_stop():
                    break
                self.sync_with_swarm()
                self._inflight = self._launch(local, pool)
            if self._inflight is not None:
                # A drain finishes the round; SIGTERM may abandon it to exit in time.
                self._wait_and_land(stopping=should_stop() and not self.draining.is_set())
        finally:
            # An averaging call still running is ended by `shutdown` (it stops the averager).
            pool.shutdown(wait=False, cancel_futures=True)

    def _comm_estimate(self) -> float | None:
        """How long an averaging call takes from contribution to result, for `auto` overlap.

        At least the matchmaking window and grace: the last peer to register waits less than that,
        but judged by its own short wait it would overlap while the others wait, and the swarm's
        contributions would drift apart in time (we saw a round split that way). With the floor,
        every member judges the exchange alike.
        """
        if self._last_comm_s is None:
            return None
        return max(self._last_comm_s, self.swarm.window_s + self.averager.grace_s)

    def _wait_and_land(self, *, stopping: bool) -> None:
        """Block until the update in flight lands (the time counts as idle), then apply it."""
        inflight = self._inflight
        assert inflight is not None
        t0 = time.perf_counter()
        self.phase = "waiting"
        try:
            # When stopping, a round not done within the part timeout is abandoned (shutdown ends it).
            inflight.future.result(timeout=self.swarm.part_timeout_s if stopping else None)
        except Exception as e:
            logger.warning("[%s] averaging did not finish: %r", self.peer_id[-6:], e)
        self._land(inflight, wait_s=time.perf_counter() - t0)

    def _land_if_done(self, _samples: int) -> None:
        """`train_round`'s per-step hook: apply the update in flight if it has landed."""
        if self._inflight is not None and self._inflight.future.done():
            self._land(self._inflight, wait_s=0.0)

    def _launch(self, local: LocalRound, pool: ThreadPoolExecutor) -> _InFlight | None:
        current = self.peer.state.round
        tries = self._tries.get(current, 0)
        self._tries[current] = tries + 1
        contribution, info = self.peer.contribute(local)
        if contribution is None:
            self._count_dropped(info.staleness)  # too stale
            return None
        future = pool.submit(
            self._average,
            contribution,
            round=current * ROUND_ID_STRIDE + tries,
            codec=self.peer.downlink_codec(self.peer.state.schedule.codec),
            timeout=self._average_timeout(),
            join_only=info.staleness > 0,
        )
        return _InFlight(local, info, future)

    def _land(self, inflight: _InFlight, *, wait_s: float) -> None:
        """Apply the update in flight (rebasing the instances), or give its Δ up if it failed."""
        self._inflight = None
        result = None
        if inflight.future.done() and inflight.future.exception() is None:
            result = inflight.future.result()
        if result is None:
            logger.info("[%s round=%d] no group for this round; its Δ is dropped", *self._tag())
            self._count_dropped(inflight.info.staleness)
            with self.lock:
                self.peer.rebase_instances()  # onto the θ we hold; catch-up follows the local round
            return
        self._applied_result(result, inflight.info, inflight.local)
        self._applied += 1
        self.report(inflight.local, wait_s=wait_s)

    # ---- without overlap ---------------------------------------------------------------------------

    def contribute_until_applied(self, local: LocalRound) -> bool:
        """Average `local` in the current round; on failure catch up and retry it (late) a few times."""
        for attempt in range(MAX_ATTEMPTS):
            self.sync_with_swarm()
            current = self.peer.state.round
            tries = self._tries.get(current, 0)
            self._tries[current] = tries + 1
            contribution, info = self.peer.contribute(local)
            if contribution is None:
                return False  # too stale: dropped, counted in the report
            result = self._average(
                contribution,
                round=current * ROUND_ID_STRIDE + tries,
                codec=self.peer.downlink_codec(self.peer.state.schedule.codec),
                timeout=self._average_timeout(),
                # A late contribution joins a round fresh peers opened; it never opens one alone.
                join_only=info.staleness > 0,
            )
            if result is None:
                logger.info("[%s round=%d] no group this time (attempt %d)", *self._tag(), attempt)
                continue
            self._applied_result(result, info, local)
            return True
        return False

    def _average(self, contribution: Contribution, **kwargs: Any) -> GroupResult | None:
        t0 = time.perf_counter()
        result, error = None, ""
        spec = self.peer.state.schedule.codec
        try:
            result = self.averager.average(contribution, **kwargs)
            if result is None:
                error = "no complete group this round"
            return result
        except Exception as e:
            error = repr(e)
            raise
        finally:
            seconds = time.perf_counter() - t0
            self._last_comm_s = seconds
            self.metrics.averaging.observe(seconds)
            self.last_averaging = AveragingInfo(
                round=int(kwargs["round"]) // ROUND_ID_STRIDE,
                ok=result is not None,
                group_size=len(result.members) if result is not None else 0,
                staleness=int(contribution.metadata.get("report", {}).get("staleness", 0)),
                bytes_sent=result.sent_bytes.get(self.peer_id, 0) if result is not None else 0,
                bytes_received=result.received_bytes.get(self.peer_id, 0) if result is not None else 0,
                codec=spec,
                seconds=seconds,
                error=error,
            )

    def _count_dropped(self, staleness: int) -> None:
        self.dropped += 1
        if staleness > 0:
            self.metrics.late.labels("dropped").inc()

    def _average_timeout(self) -> float:
        return self.swarm.window_s + 2 * self.swarm.part_timeout_s + 30

    def _tag(self) -> tuple[str, int]:
        return self.peer_id[-6:], self.peer.state.round

    def _applied_result(self, result: GroupResult, info: ContributionInfo, local: LocalRound) -> None:
        """Apply a group's result and account for it: traffic, staleness, DyLU, publish."""
        with self.lock:
            self.peer.apply_round(result)
        self.last_group_size = len(result.members)
        self.last_staleness = info.staleness
        report = info.correction
        self.last_heloco = (
            {"keep": report.keep, "shrink": report.shrink, "rotate": report.rotate, "skip": report.skip}
            if report is not None
            else None
        )
        self._last_info = info
        rejected = sum(result.rejected.values())
        self.rejected_parts += rejected
        self.metrics.rejected.inc(rejected)
        if info.staleness > 0:
            corrected = report is not None and report.shrink + report.rotate > 0
            self.metrics.late.labels("corrected" if corrected else "applied").inc()
        sent = result.sent_bytes.get(self.peer_id, 0)
        received = result.received_bytes.get(self.peer_id, 0)
        self.metrics.sent.inc(sent)
        self.metrics.received.inc(received)
        self.bytes_sent += sent
        self.bytes_received += received
        traffic = getattr(result, "traffic", None)
        if traffic is not None:
            self.payload_sent += traffic.payload_sent
            self.payload_received += traffic.payload_received
        if self.swarm.dylu:
            self.peer.dylu_speed_ratio = dylu_ratio(result.gathered, local.report.step_time_s)
        self.publish()

    def report(self, local: LocalRound, *, wait_s: float) -> None:
        """The round's figures: one status line, and the `on_round` callback (the CLI prints it).

        round_s is the time since the previous applied round; wait_s the part of it this node sat
        idle waiting for the group and its transfer (without overlap: the whole averaging call).
        """
        now = time.perf_counter()
        round_s, self._last_report = now - self._last_report, now
        self.tokens_per_s = local.tokens / max(round_s, 1e-9)
        state = self.peer.state
        fields = {
            "round": state.round,
            "val_loss": self.peer.validation_loss(),
            "inner_loss": local.mean_loss,
            "tokens": local.tokens,
            "tokens_per_s": local.tokens / max(round_s, 1e-9),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "payload_sent": self.payload_sent,
            "payload_received": self.payload_received,
            "theta_hash": state.theta_hash(),
            "group_size": self.last_group_size,
            "staleness": self.last_staleness,
            "round_s": round_s,
            "wait_s": wait_s,
            "compute_s": local.compute_s,
            "inner_steps": local.inner_steps,
            "dropped": self.dropped,
            "rejected_parts": self.rejected_parts,
            "accum_steps": local.accum_steps,
            "codec": info.codec if (info := self._last_info) else state.schedule.codec,
            "contribution_bytes": info.wire_bytes if info else 0,
            "heloco": self.last_heloco,
            "batch_sizes": list(state.schedule.batch),
        }
        self._report_fields = fields
        self.status.write("round", **fields)
        self.metrics.round_applied(fields, batch=state.schedule.batch, raw_bytes=self._raw_bytes)
        if self.on_round is not None:
            self.on_round(fields)

    def shutdown(self) -> None:
        """Leave the swarm: stop serving, stop averaging, stop the DHT (and its p2pd)."""
        for part in (self.server, self.averager):
            try:
                part.shutdown()
            except Exception as e:
                logger.debug("shutdown: %r", e)
        self.dht.shutdown()


def format_round(peer_id: str, f: dict[str, Any]) -> str:
    """One compact `[peer round=N]` summary line of a swarm round."""
    return (
        f"[{peer_id[-6:]} round={f['round']}] val {f['val_loss']:.3f} inner {f['inner_loss']:.3f}"
        f" {f['tokens_per_s']:.0f} tok/s group={f['group_size']} τ={f['staleness']}"
        f" sent {f['bytes_sent'] / 1e6:.2f}MB recv {f['bytes_received'] / 1e6:.2f}MB"
        f" {f['round_s']:.1f}s (waited {f['wait_s']:.1f}s)"
    )


def dylu_ratio(gathered: Sequence[Mapping[str, Any]], step_time_s: float) -> float | None:
    """DyLU: this node's speed relative to the fastest member of its group (step times gathered)."""
    times = [m["report"].get("step_time_s", 0.0) for m in gathered if isinstance(m.get("report"), dict)]
    fastest = min((t for t in times if t > 0), default=0.0)
    if fastest <= 0 or step_time_s <= 0:
        return None
    return min(1.0, fastest / step_time_s)


def _random_shard(shards: int) -> int:
    """A data shard for a node that was not given one (peers pick independently, like volunteers)."""
    return int.from_bytes(hashlib.sha256(str(time.time_ns()).encode()).digest()[:4], "big") % shards
