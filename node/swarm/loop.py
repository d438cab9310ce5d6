"""A swarm node's round loop: train, contribute, average through the `Averager`, apply, report.

Without overlap a round is: train locally, catch up if the swarm moved on meanwhile, contribute
(HeLoCo-corrected and staleness-weighted when late), average with the peers ready within the
matchmaking window, apply, publish; a failed round is retried (late) a few times after catching up.
A try that failed here may still complete for the others (this node came late to their group, or
was dropped from it), so the node never opens another try of that round until the failed one is
over: it waits until the swarm publishes a later round (it then catches up and contributes late),
until every member of that try's group said it failed there, or until that try's calls have
certainly ended (`average_timeout_s`); opening one earlier would average the same round apart from
them, a fork.
With one-step-delay overlap (DiLoCoX, `--overlap`; auto by default) the averaging of round r runs on a
background thread while the instances train round r+1; the update is applied between two inner steps
as soon as it lands (or, if the local round ends first, after waiting for it), and the instances'
progress is moved onto the new θ. Under auto a round overlaps only while the last averaging call
took no longer than the last local round; otherwise it waits for the update first. Each round's
record says how long the node sat idle waiting for communication (`wait_s`).

Over 500 lines, one idea: `RoundLoop`, the swarm round from the node's side (contribute, average,
check the head, apply, checkpoint), steps that share the loop's state and read in order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from ...protocol.algorithms.allreduce import Contribution
from ...protocol.algorithms.pseudograd import PseudoGradient
from ...protocol.transport.averager import (
    Averager,
    FailureAware,
    MemberResult,
    NotOpened,
    Policing,
    RoundReader,
)
from ..operations.control import AveragingInfo
from ..operations.metrics import NodeMetrics
from ..training.peer import Peer, overlap_this_round
from ..training.rounds import ContributionInfo, LocalRound, RoundRecord
from ..training.runtime import give_back_free_memory
from .ops import NodeOps
from .sync import SwarmSync

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# How often a node waiting for the outcome of a failed try reads the swarm's head.
SETTLE_POLL_S = 0.25
DEFER_POLL_S = 0.5  # how often a node that averaged alone looks whether the peers level with it finished
WAIT_POLL_S = 0.25  # how often a wait for an averaging call looks whether the node is stopping
# Averager round ids are single-use: id = round × stride + the number of earlier tries at that round.
# Peers that reach a round meet at its first id; after a round failed everywhere they meet at the next.
ROUND_ID_STRIDE = 1000
# A late contribution waits this many of its own local rounds (at least JOIN_WAIT_MIN_S) for a fresh
# peer to open the round it joins: fresh peers began that round's local training when its state was
# published, which this peer has just caught up to. If none opens, no fresh peer is left (the ones
# it caught up from finished, or every peer is late) and the late Δ is dropped, so this peer trains
# afresh and opens the next round itself instead of waiting out the whole exchange budget.
JOIN_WAIT_LOCAL_ROUNDS = 2.0
JOIN_WAIT_MIN_S = 10.0


@dataclass(frozen=True)
class LoopConfig:
    """The loop's knobs (from `SwarmConfig`): rounds to apply (0: until stopped), the averaging
    part timeout, and the test knob that makes this node `simulate_slowdown`× slower."""

    rounds: int
    part_timeout_s: float
    average_timeout_s: float
    simulate_slowdown: float = 1.0


@dataclass
class _InFlight:
    """A contribution being averaged on the background thread while the instances train on."""

    local: LocalRound
    info: ContributionInfo
    future: Future[MemberResult | None]


class RoundLoop:
    """Drives one node's rounds (see the module docstring)."""

    def __init__(
        self,
        *,
        peer: Peer,
        lock: threading.Lock,
        averager: Averager,
        sync: SwarmSync,
        ops: NodeOps,
        metrics: NodeMetrics,
        cfg: LoopConfig,
    ) -> None:
        self.peer, self.lock, self.averager, self.sync = peer, lock, averager, sync
        self.ops, self.metrics, self.cfg = ops, metrics, cfg
        self.on_round: Callable[[RoundRecord], None] | None = None
        self._tries = (-1, 0)  # (round, tries at it so far): a round this node returns to starts over
        # (round, monotonic time, averager round id) of the last failed try
        self._failed: tuple[int, float, int] | None = None
        self._inflight: _InFlight | None = None
        self._last_comm_s: float | None = None  # the last averaging call, start to result
        self._last_compute_s: float | None = None  # the last local round (simulated slowdown included)
        self._link_bps = 0.0  # this node's link as its last exchange measured it (0: not yet)
        self._last: tuple[ContributionInfo, MemberResult] | None = None
        self._violations_seen = 0  # the averager's rule-break count already in the metrics
        self._last_report = time.perf_counter()
        self._should_stop: Callable[[], bool] = lambda: False
        # Why the node's network is gone (the DHT process or p2pd died), None while it is up.
        self.network_lost: Callable[[], str | None] = lambda: None

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Apply rounds until `cfg.rounds` are done (0: never) or `should_stop()`."""
        self._last_report = time.perf_counter()
        self._should_stop = should_stop
        pool = ThreadPoolExecutor(1, thread_name_prefix="adloco-averaging")
        try:
            if self.peer.overlap:
                self._run_overlapped(should_stop, pool)
            else:
                self._run_in_order(should_stop, pool)
        finally:
            # An averaging call still running is ended by `shutdown` (it stops the averager).
            pool.shutdown(wait=False, cancel_futures=True)

    def _await(self, future: Future[MemberResult | None], *, stopping: bool = False) -> None:
        """Wait for an averaging call, but once the node is told to stop (`stopping`: it is), at most
        the part timeout more, and not at all once its network is gone (p2pd or the DHT process
        died, as when SIGTERM goes to the whole process group); TimeoutError then: the round is
        abandoned, `shutdown` ends it."""
        deadline = time.monotonic() + self.cfg.part_timeout_s if stopping else None
        while not future.done():
            if deadline is None and self._should_stop():
                deadline = time.monotonic() + self.cfg.part_timeout_s
            if deadline is not None and (time.monotonic() >= deadline or self.network_lost()):
                raise TimeoutError("the node is stopping: the round in flight is abandoned")
            try:
                future.result(timeout=WAIT_POLL_S)
            except Exception:  # not done yet, or failed: the loop looks again
                continue

    def _enough(self, should_stop: Callable[[], bool]) -> bool:
        planned = self.ops.counters.applied + (self._inflight is not None)
        return should_stop() or (self.cfg.rounds > 0 and planned >= self.cfg.rounds)

    # ---- without overlap ---------------------------------------------------------------------

    def _run_in_order(self, should_stop: Callable[[], bool], pool: ThreadPoolExecutor) -> None:
        while not self._enough(should_stop):
            local = self._local_round()
            t0 = time.perf_counter()
            self.ops.phase = "averaging"
            if self._contribute_until_applied(local, should_stop, pool):
                self._report(local, wait_s=time.perf_counter() - t0)
            else:
                self._count_dropped(self.peer.state.round - local.base_round)
            self.ops.between_rounds()

    def _contribute_until_applied(
        self, local: LocalRound, should_stop: Callable[[], bool], pool: ThreadPoolExecutor
    ) -> bool:
        """Average `local` in the current round; on failure catch up and retry it (late) a few times."""
        for attempt in range(MAX_ATTEMPTS):
            if not self._settle(should_stop):
                return False  # stopped while waiting for a failed try's outcome
            self.sync.sync()
            contribution, info = self.peer.contribute(local, bandwidth_bps=self._link_bps)
            if contribution is None:
                return False  # too stale: dropped, counted by the caller
            round_id = self._next_round_id()
            future = pool.submit(self._average, contribution, info, round_id)
            try:
                self._await(future)
                result = future.result()
            except NotOpened as e:
                logger.info("[%s round=%d] late Δ dropped: %s", *self._tag(), e)
                return False
            except TimeoutError as e:
                logger.warning("[%s round=%d] %s", *self._tag(), e)
                return False
            if result is None:
                logger.info("[%s round=%d] no group this time (attempt %d)", *self._tag(), attempt)
                continue
            self._applied(result, info)
            return True
        return False

    def _went_on_without_us(self, result: MemberResult, round_id: int) -> bool:
        """Whether a round this node averaged alone, where it had company last time, is one the
        peers it was level with finish without it; then it does not apply its own (a fork) but
        catches up to theirs (its Δ goes in late, or under overlap is dropped). Records of theirs
        may have come in while it averaged, or a pause kept it from reading them; they count while
        their writers stand by them (`SwarmSync.holders_stand`: a node thawed after its peers left
        must not give way to their records). While peers at its round and θ stand by their state
        and either have not registered for the round yet or make a group of their own there, it
        waits for theirs, at most the averaging timeout: a node whose local round is seconds
        shorter than theirs, or one back from a restart without the checkpoint they were writing,
        closed its round before they came. Peers that have gone
        (they no longer answer) leave it theirs to finish alone; so do registrations that make
        this node a member of the round (its round is the round: those that came later follow it).
        Runs on the averaging thread: under overlap, training goes on meanwhile."""
        if tuple(result.members) != (self.peer.peer_id,) or self.sync.solo_rounds:
            return False
        start = self.peer.state.round
        deadline = time.monotonic() + self.cfg.average_timeout_s
        theta_hash, waited = None, False
        while True:
            theta_hash = theta_hash or self.peer.theta_hash()
            pending = self._averaging_without_us(round_id, theta_hash)
            # The head after the level peers: peers that left our level between the two reads have
            # published their round by the second (read the other way round, they fell between).
            head = self.sync.head()
            if head is not None and head.round > start and self.sync.holders_stand(head):
                logger.info(
                    "[%s round=%d] the peers level with it finished round %d without it: it takes theirs",
                    *self._tag(),
                    start,
                )
                return True
            if pending and time.monotonic() >= deadline:
                logger.warning(
                    "[%s round=%d] %d peers level with it neither joined nor finished round %d within"
                    " %.0f s: it applies its own",
                    *self._tag(),
                    len(pending),
                    start,
                    self.cfg.average_timeout_s,
                )
            if not pending or time.monotonic() >= deadline or self._should_stop():
                return False
            if not waited:
                logger.info(
                    "[%s round=%d] averaged round %d alone while %d peers at its θ do: awaiting theirs",
                    *self._tag(),
                    start,
                    len(pending),
                )
                waited = True
            time.sleep(DEFER_POLL_S)

    def _averaging_without_us(self, round_id: int, theta_hash: str) -> list[str]:
        """The peers at this node's round and θ (and standing by it) that have yet to register for
        try `round_id` (a round they open now cannot have this node, which averaged it already),
        or that are members of the group the registrations make where this node is not; [] also
        when the averager cannot say (`RoundReader`)."""
        if not isinstance(self.averager, RoundReader):
            return []
        level = self.sync.level_peers(theta_hash)
        view = self.averager.round_view(round_id) if level else None
        if view is None:
            return []
        registered, members = view
        apart = self.peer.peer_id not in members
        return [p for p in level if p not in registered or (apart and p in members)]

    # ---- one-step-delay overlap --------------------------------------------------------------

    def _run_overlapped(self, should_stop: Callable[[], bool], pool: ThreadPoolExecutor) -> None:
        """Contribute round r, train round r+1 while it is averaged, apply r when it lands; a last
        round that fails in flight is trained and contributed again, as any other."""
        while True:
            self._overlapped_rounds(should_stop, pool)
            done = self.cfg.rounds > 0 and self.ops.counters.applied >= self.cfg.rounds
            if done or should_stop() or self.cfg.rounds == 0:
                return

    def _overlapped_rounds(self, should_stop: Callable[[], bool], pool: ThreadPoolExecutor) -> None:
        while not self._enough(should_stop):
            from_theta = False
            if self._inflight is not None and not overlap_this_round(
                self.peer.cfg.overlap, comm_s=self._comm_estimate(), compute_s=self._last_compute_s
            ):
                # auto: the exchange outlasts a local round, so this round waits for the update.
                self._wait_and_land(stopping=False)
                from_theta = True
            # A round that ends before its update lands waits for it at its end, inside the round:
            # its Δ is then measured from the new θ, as if the update had landed after its last step.
            local = self._local_round(on_step=self._land_if_done, from_theta=from_theta, land_late=True)
            self.ops.between_rounds()
            if should_stop() or not self._settle(should_stop):
                break
            self.sync.sync()
            self._inflight = self._launch(local, pool)
        if self._inflight is not None:
            # A drain finishes the round; SIGTERM may abandon it to exit in time.
            self._wait_and_land(stopping=should_stop() and not self.ops.draining.is_set())

    def _comm_estimate(self) -> float | None:
        """How long an averaging call takes from contribution to result, for `auto` overlap.

        At least the averager's matchmaking time: the last peer to register waits less than that,
        but judged by its own short wait it would overlap while the others wait, and the swarm's
        contributions would drift apart in time (we saw a round split that way). With the floor,
        every member judges the exchange alike.
        """
        if self._last_comm_s is None:
            return None
        return max(self._last_comm_s, self.averager.matchmaking_s)

    def _launch(self, local: LocalRound, pool: ThreadPoolExecutor) -> _InFlight | None:
        contribution, info = self.peer.contribute(local, bandwidth_bps=self._link_bps)
        # Encoded, Δ is not read again: under overlap a failed round's Δ is dropped, not contributed
        # again. Released now, the next round's start does not compute it whole (`settle_delta`),
        # which held 4 B/param through the whole overlapped round.
        if isinstance(local.delta, PseudoGradient):
            local.delta.release()
        if contribution is None:
            self._count_dropped(info.staleness)  # too stale
            return None
        return _InFlight(local, info, pool.submit(self._average, contribution, info, self._next_round_id()))

    def _wait_and_land(self, *, stopping: bool) -> None:
        """Block until the update in flight lands (the time counts as idle), then apply it."""
        inflight = self._inflight
        assert inflight is not None
        t0 = time.perf_counter()
        self.ops.phase = "waiting"
        try:
            # When stopping, a round not done within the part timeout is abandoned (shutdown ends it),
            # and a wait begun before the node was told to stop ends the same way (`_await`).
            self._await(inflight.future, stopping=stopping)
        except Exception as e:
            logger.warning("[%s] averaging did not finish: %r", self.peer.peer_id[-6:], e)
        self._land(inflight, wait_s=time.perf_counter() - t0)

    def _land_if_done(self, _samples: int) -> None:
        """`train_round`'s per-step hook: apply the update in flight if it has landed."""
        if self._inflight is not None and self._inflight.future.done():
            self._land(self._inflight, wait_s=0.0)

    def _land(self, inflight: _InFlight, *, wait_s: float) -> None:
        """Apply the update in flight (rebasing the instances), or give its Δ up if it failed; then
        the memory the round's exchange and landing freed goes back to the system."""
        try:
            self._land_update(inflight, wait_s=wait_s)
        finally:
            give_back_free_memory()

    def _land_update(self, inflight: _InFlight, *, wait_s: float) -> None:
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
        self._applied(result, inflight.info)
        self._report(inflight.local, wait_s=wait_s)

    # ---- one round's steps -------------------------------------------------------------------

    def _local_round(
        self,
        on_step: Callable[[int], None] | None = None,
        *,
        from_theta: bool = False,
        land_late: bool = False,
    ) -> LocalRound:
        """One local round (`Peer.train_round`); with `land_late` an update still in flight when its
        last step ends is waited for and applied then, after the simulated slowdown's sleep."""
        last = time.perf_counter()
        slowed = False

        def step_done(samples: int) -> None:
            nonlocal last
            now = time.perf_counter()
            self.metrics.inner_step.observe(now - last)
            last = now
            if on_step is not None:
                on_step(samples)

        def land(compute_s: float) -> None:
            nonlocal slowed
            self._slow_down(compute_s)
            slowed = True
            if self._inflight is not None:
                self._wait_and_land(stopping=False)

        self.ops.phase = "training"
        at_end = land if land_late and self._inflight is not None else None
        local = self.peer.train_round(on_step=step_done, from_theta=from_theta, land=at_end)
        self.ops.counters.tokens_total += local.tokens
        self.metrics.tokens.inc(local.tokens)
        self.metrics.samples.inc(local.samples)
        slowdown = self.cfg.simulate_slowdown
        if not slowed:
            self._slow_down(local.compute_s)
        if slowdown > 1:
            # Others see this node as slow as it is made to be (DyLU compares step times).
            local.report_time(local.compute_s * slowdown)
        self._last_compute_s = local.compute_s * slowdown
        return local

    def _slow_down(self, compute_s: float) -> None:
        """The test knob: make the round last `simulate_slowdown` times its compute."""
        if self.cfg.simulate_slowdown > 1:
            time.sleep((self.cfg.simulate_slowdown - 1) * compute_s)

    def _settle(self, should_stop: Callable[[], bool]) -> bool:
        """Before another try at a round whose last try failed here, wait until that try is over.

        Over means: some peer published a later round (sync then catches up, and this node's Δ goes
        in late, joining a round others open), or every member of that try's group said it failed
        there (`FailureAware`), or `average_timeout_s` has passed since the failure, by when every
        call of that try has returned (they all began before it failed here). Only then may a new
        try of the round open: alone it is a round nobody else is averaging any more.
        Returns False when `should_stop` ended the wait.
        """
        if self._failed is None or self._failed[0] != self.peer.state.round:
            return True
        failed_round, failed_at, round_id = self._failed
        aware = self.averager if isinstance(self.averager, FailureAware) else None
        deadline = failed_at + self.cfg.average_timeout_s
        while time.monotonic() < deadline:
            if should_stop():
                return False
            # Any record will do here, up to one round past where most peers are: a peer past the
            # failed round only ends this wait (a forged one at worst opens the next try early);
            # what the node adopts comes from the vouched head.
            head = self.sync.head(trusted=False)
            if head is not None and head.round > failed_round:
                self._await_vouched_head(failed_round, deadline, should_stop)
                return True
            if aware is not None and aware.failed_everywhere(round_id):
                logger.info(
                    "round %d: the try failed for every member (known %.1f s after it failed here);"
                    " trying again now",
                    failed_round,
                    time.monotonic() - failed_at,
                )
                return True
            time.sleep(SETTLE_POLL_S)
        logger.warning(
            "round %d: its try %d not known over anywhere after %.0f s (the averaging timeout); trying again",
            failed_round,
            round_id,
            self.cfg.average_timeout_s,
        )
        return True

    def _await_vouched_head(
        self, failed_round: int, deadline: float, should_stop: Callable[[], bool]
    ) -> None:
        """A later round's first record ended the wait for a failed try. The head `sync` catches up
        to counts only the peers this node vouches for, and their records come in over a moment:
        give them up to a matchmaking time (window and grace) to show the later round too. Read a
        moment too early, the head was still the failed round, and the node tried that round again
        alone, holding it open for the patience while its peers had moved on (the victim of a
        founder's owner-omit, stop 54)."""
        until = min(deadline, time.monotonic() + self.averager.matchmaking_s)
        while time.monotonic() < until and not should_stop():
            head = self.sync.head()
            if head is not None and head.round > failed_round:
                return
            time.sleep(SETTLE_POLL_S)

    def _next_round_id(self) -> int:
        """The averager's id for the next try at the current round (called on the loop's thread)."""
        current = self.peer.state.round
        # Counted for the current round only: a node that healed back to a round it had tried alone
        # meets the others at that round's first id, where they are.
        tries = self._tries[1] if self._tries[0] == current else 0
        self._tries = (current, tries + 1)
        return current * ROUND_ID_STRIDE + tries

    def _average(
        self, contribution: Contribution, info: ContributionInfo, round_id: int
    ) -> MemberResult | None:
        """One averaging call (on the averaging thread under overlap), accounted for."""
        t0 = time.perf_counter()
        result, error, registered = None, "", True
        # Behind the swarm's head (a catch-up that failed) is late too: the round this node would
        # open is one the others finished long ago, and it would average it alone (a fork).
        late = info.staleness > 0 or self.sync.behind
        try:
            result = self.averager.average(
                contribution,
                round=round_id,
                codec=self.peer.downlink_codec(info.codec),
                timeout=self.cfg.average_timeout_s,
                # A late contribution joins a round fresh peers opened; it never opens one alone.
                join_only=late,
                join_wait_s=self._join_wait_s() if late else None,
                bounds=self.peer.claim_bounds(),
                # A round this node opens waits up to a local round for the peers it last averaged
                # with: their local rounds end up to that much later (under overlap nothing pulls
                # the peers back into step), and a window of seconds would let it average alone.
                patience_s=0.0 if late else (self._last_compute_s or 0.0),
            )
            if result is not None and self._went_on_without_us(result, round_id):
                # Not applied: as after a failed try, the next sync catches up to theirs.
                result, error = None, "averaged alone while the peers level with it averaged without it"
            else:
                error = "" if result is not None else "no complete group this round"
            return result
        except NotOpened as e:
            error, registered = f"late, dropped: {e}", False
            raise
        except Exception as e:
            error = repr(e)
            raise
        finally:
            if result is None and registered:  # a try others may still be running
                self._failed = (round_id // ROUND_ID_STRIDE, time.monotonic(), round_id)
            self._averaged(round_id // ROUND_ID_STRIDE, info, result, time.perf_counter() - t0, error)

    def _join_wait_s(self) -> float:
        """How long a late contribution waits for a fresh peer to open its round."""
        return max(JOIN_WAIT_MIN_S, JOIN_WAIT_LOCAL_ROUNDS * (self._last_compute_s or 0.0))

    def _averaged(
        self, round: int, info: ContributionInfo, result: MemberResult | None, seconds: float, error: str
    ) -> None:
        """Account for an averaging call: its time, the link it measured, what `ctl status` shows."""
        self._last_comm_s = seconds
        self.metrics.averaging.observe(seconds)
        traffic = None if result is None else result.traffic
        if traffic is not None and traffic.exchange_s > 0:
            moved = max(traffic.wire_sent, traffic.wire_received)
            if moved > 0:
                self._link_bps = 8 * moved / traffic.exchange_s
        self.ops.last_averaging = AveragingInfo(
            round=round,
            ok=result is not None,
            group_size=0 if result is None else len(result.members),
            staleness=info.staleness,
            bytes_sent=0 if traffic is None else traffic.wire_sent,
            bytes_received=0 if traffic is None else traffic.wire_received,
            codec=info.codec,
            seconds=seconds,
            error=error,
        )

    def _applied(self, result: MemberResult, info: ContributionInfo) -> None:
        """Apply a group's result and account for it: traffic, rejections, late outcome, publish."""
        with self.lock:
            self.peer.apply_round(result)
        counters = self.ops.counters
        counters.applied += 1
        rejected = sum(result.rejected.values())
        counters.rejected_parts += rejected
        counters.malformed_reports += len(result.malformed)
        self.metrics.rejected.inc(rejected)
        self.metrics.malformed.inc(len(result.malformed))
        if isinstance(self.averager, Policing):
            caught = self.averager.misconduct()
            self.metrics.violations.inc(caught.violations - self._violations_seen)
            self.metrics.banned.set(caught.banned)
            self._violations_seen = caught.violations
        if info.staleness > 0:
            c = info.correction
            corrected = c is not None and c.shrink + c.rotate > 0
            self.metrics.late.labels("corrected" if corrected else "applied").inc()
        traffic = result.traffic
        counters.bytes_sent += traffic.wire_sent
        counters.bytes_received += traffic.wire_received
        counters.payload_sent += traffic.payload_sent
        counters.payload_received += traffic.payload_received
        counters.checks_sent += traffic.checks_sent
        counters.checks_received += traffic.checks_received
        self.metrics.sent.inc(traffic.wire_sent)
        self.metrics.received.inc(traffic.wire_received)
        # For the round's record, which reads no payload: the kept update holds them (on disk).
        self._last = (info, replace(result, averaged={}))
        self.sync.vouch(result.members, result.work)
        # Not waited for: under overlap this runs between two inner steps, and a store toward peers
        # that went silent (a cut link) waits out their RPC timeouts.
        self.sync.publish(wait=False)

    def _count_dropped(self, staleness: int) -> None:
        self.ops.counters.dropped += 1
        if staleness > 0:
            self.metrics.late.labels("dropped").inc()

    def _report(self, local: LocalRound, *, wait_s: float) -> None:
        """The applied round's record: status event, metrics, the `on_round` callback (CLI line).

        round_s is the time since the previous applied round; wait_s the part of it this node sat
        idle waiting for the group and its transfer (without overlap: the whole averaging call).
        """
        assert self._last is not None
        now = time.perf_counter()
        round_s, self._last_report = now - self._last_report, now
        self.ops.counters.tokens_per_s = local.tokens / max(round_s, 1e-9)
        record = self._record(local, *self._last, round_s=round_s, wait_s=wait_s)
        self.ops.last_record = record
        self.ops.status.write("round", **record.to_dict())
        batch = self.peer.state.schedule.batch
        self.metrics.round_applied(record.to_dict(), batch=batch, raw_bytes=self._raw_bytes())
        peer = self.peer
        for device, (tokens, compute_s) in (
            local.by_device or {str(peer.device): (local.tokens, local.compute_s)}
        ).items():
            self.metrics.compute(
                device,
                tokens=tokens,
                compute_s=compute_s,
                flops_per_token=peer.flops_per_token,
                peak=peer.peak_flops,
            )
        if self.on_round is not None:
            self.on_round(record)

    def _record(
        self,
        local: LocalRound,
        info: ContributionInfo,
        result: MemberResult,
        *,
        round_s: float,
        wait_s: float,
    ) -> RoundRecord:
        counters = self.ops.counters
        state = self.peer.state
        c = info.correction
        return RoundRecord(
            round=state.round,
            val_loss=self.peer.validation_loss(),
            inner_loss=local.mean_loss,
            theta_hash=self.peer.theta_hash(),
            tokens=local.tokens,
            tokens_total=counters.tokens_total,
            tokens_per_s=counters.tokens_per_s,
            batch_sizes=list(state.schedule.batch),
            accum_steps=local.accum_steps,
            instances=state.schedule.instances,
            inner_steps=local.inner_steps,
            codec=info.codec,
            group_size=len(result.members),
            staleness=info.staleness,
            bytes_sent=counters.bytes_sent,
            bytes_received=counters.bytes_received,
            round_bytes=result.traffic.wire_sent,
            round_s=round_s,
            wait_s=wait_s,
            compute_s=local.compute_s,
            contribution_bytes=info.wire_bytes,
            payload_sent=counters.payload_sent,
            payload_received=counters.payload_received,
            checks_sent=counters.checks_sent,
            checks_received=counters.checks_received,
            heloco=None
            if c is None
            else {"keep": c.keep, "shrink": c.shrink, "rotate": c.rotate, "skip": c.skip},
            dropped=counters.dropped,
            rejected_parts=counters.rejected_parts,
            malformed_reports=counters.malformed_reports,
        )

    def _raw_bytes(self) -> int:
        return 4 * sum(t.numel() for t in self.peer.state.theta)

    def _tag(self) -> tuple[str, int]:
        return self.peer.peer_id[-6:], self.peer.state.round
