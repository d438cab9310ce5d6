"""The swarm round loop's retry rule, with a scripted averager and a scripted swarm (no network).

A try that returned None here may still complete for the others: this peer came late to their
group (its registration after their window), or was dropped from it. Issue 12's fork was the loop
opening the next try of the same round at once: alone, it averaged that round apart from them. So
after a failed try the loop must wait until the swarm publishes a later round (then catch up and
contribute late, join-only) or until the failed try's calls have certainly ended, and only then may
it open a new try: a peer that really is alone still trains.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest

from adloco.node.data.corpus import Corpus
from adloco.node.operations.metrics import NodeMetrics
from adloco.node.swarm.loop import ROUND_ID_STRIDE, LoopConfig, RoundLoop
from adloco.node.swarm.ops import NodeOps, StatusLog
from adloco.node.swarm.sync import SwarmHead
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.replica import Update
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.claims import ClaimBounds
from adloco.protocol.algorithms.codecs import Codec
from adloco.protocol.transport.averager import MemberResult, NotOpened, Traffic

pytestmark = pytest.mark.timeout(60)

CFG = TrainConfig(seq_len=32, batch_size=4, instances=1, inner_steps=1, b_max=4, max_corpus_mb=1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(corpus: Corpus, peer_id: str, overlap: str = "off") -> Peer:
    cfg = dataclasses.replace(CFG, overlap=overlap)  # type: ignore[arg-type]
    return Peer(peer_id=peer_id, index=0, num_peers=2, cfg=cfg, corpus=corpus, vocab_size=256)


@dataclass(frozen=True)
class Call:
    round_id: int
    join_only: bool
    at: float
    join_wait_s: float | None = None
    patience_s: float = 0.0


class ScriptedAverager:
    """Answers call i with `answers[i]`: "late" (None at once, as for a registration after the
    window), "not_opened" (`NotOpened`, as a join-only call no peer opened a round for) or "alone"
    (the caller's contribution averaged as a group of one); late once they run out."""

    matchmaking_s = 0.0

    def __init__(self, peer_id: str, answers: list[str], on_late: Callable[[], None] = lambda: None) -> None:
        self.peer_id = peer_id
        self.answers = answers
        self.on_late = on_late
        self.calls: list[Call] = []

    def average(
        self,
        contribution: Contribution,
        *,
        round: int,
        codec: Codec,
        timeout: float,
        join_only: bool = False,
        join_wait_s: float | None = None,
        bounds: ClaimBounds | None = None,
        patience_s: float = 0.0,
    ) -> MemberResult | None:
        self.calls.append(Call(round, join_only, time.monotonic(), join_wait_s, patience_s))
        answer = self.answers.pop(0) if self.answers else "late"
        if answer == "not_opened":
            raise NotOpened(f"round {round}: scripted")
        if answer == "late":
            self.on_late()
            return None
        group = reduce_group([contribution], codec=codec)
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
        return MemberResult(**fields, peer_id=self.peer_id, traffic=Traffic(0, 0, 0, 0))

    def shutdown(self) -> None:
        pass


class ScriptedSwarm:
    """The other peers, as `SwarmSync` shows them to the loop: the round they published (after
    `others_apply`) and the update that got them there, which `sync` replays."""

    def __init__(self, peer: Peer, update: Update) -> None:
        self.peer, self.update = peer, update
        self.published = 0
        self.published_at: float | None = None
        self.behind = False  # `sync` always catches up
        self.solo_rounds = 0  # rounds applied alone since the last with company, as `vouch` counts
        self.level: list[str] = []  # the peers at our round and θ, standing by it

    def others_apply(self) -> None:
        self.published, self.published_at = 1, time.monotonic()

    def holders_stand(self, head: SwarmHead) -> bool:
        return True

    def level_peers(self, theta_hash: str) -> list[str]:
        """The peers at our round and θ: `level` until they publish round 1."""
        return list(self.level) if self.published == 0 else []

    def head(self, *, trusted: bool = True) -> SwarmHead | None:
        return SwarmHead(self.published, "", ["others"], Counter())

    def sync(self) -> int:
        if self.published > self.peer.state.round:
            self.peer.catch_up([self.update])
            return 1
        return 0

    def vouch(self, members: Sequence[str], work: Mapping[str, float]) -> None:
        company = [m for m in members if m != self.peer.peer_id]
        self.solo_rounds = 0 if company else self.solo_rounds + 1

    def publish(self, *, wait: bool = True) -> None:
        pass


def _others_round_zero(corpus: Corpus) -> Update:
    """Round 0 as the others averaged it (without our peer): what they publish as round 1."""
    other = _peer(corpus, "other")
    contribution, _ = other.contribute(other.train_round())
    assert contribution is not None
    return other.apply_round(reduce_group([contribution], codec=other.downlink_codec("int8")))


def _loop(peer: Peer, averager: ScriptedAverager, swarm: ScriptedSwarm, *, timeout_s: float) -> RoundLoop:
    lock = threading.Lock()
    ops = NodeOps(
        peer=peer,
        lock=lock,
        status=StatusLog(None),
        run_id="r",
        checkpoint_dir=None,
        checkpoint_every=0,
        data_shard=0,
    )
    return RoundLoop(
        peer=peer,
        lock=lock,
        averager=averager,
        sync=swarm,  # type: ignore[arg-type]  # duck-typed: head, sync, publish
        ops=ops,
        metrics=NodeMetrics(),
        cfg=LoopConfig(rounds=0, part_timeout_s=1.0, average_timeout_s=timeout_s),
    )


@pytest.mark.parametrize("overlap", ["off", "rebase"])
def test_a_late_try_is_not_retried_alone_while_the_others_complete_the_round(
    corpus: Corpus, overlap: str
) -> None:
    peer = _peer(corpus, "me", overlap)
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    # The others' group finishes the round a moment after our late registration failed.
    averager = ScriptedAverager(
        "me", ["late", "alone"], on_late=lambda: threading.Timer(0.5, swarm.others_apply).start()
    )
    loop = _loop(peer, averager, swarm, timeout_s=30.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)

    first, second = averager.calls
    assert (first.round_id, first.join_only) == (0, False)
    # Not round 0's next try (id 1), which nobody else would join: the others' round 1, join-only,
    # with our Δ of round 0 late by one, after their round 0 was published.
    assert (second.round_id, second.join_only) == (1 * ROUND_ID_STRIDE, True)
    assert swarm.published_at is not None and second.at >= swarm.published_at
    assert peer.state.round == 2


class LaggingSwarm(ScriptedSwarm):
    """The others' records of round 1 come in over a moment: the first one (`head(trusted=False)`)
    at once, enough of the peers this node vouches for to move `head()` and `sync` `lag_s` later."""

    def __init__(self, peer: Peer, update: Update, lag_s: float) -> None:
        super().__init__(peer, update)
        self.lag_s = lag_s

    def _vouched(self) -> int:
        at = self.published_at
        return self.published if at is not None and time.monotonic() - at >= self.lag_s else 0

    def head(self, *, trusted: bool = True) -> SwarmHead | None:
        return SwarmHead(self._vouched() if trusted else self.published, "", ["others"], Counter())

    def sync(self) -> int:
        if self._vouched() > self.peer.state.round:
            self.peer.catch_up([self.update])
            return 1
        return 0


@pytest.mark.parametrize("overlap", ["off", "rebase"])
def test_a_failed_try_waits_for_the_vouched_peers_records_of_the_round_the_others_completed(
    corpus: Corpus, overlap: str
) -> None:
    """Our try failed while the others completed the round (an owner left our contribution out,
    stop 54). The first record of the next round ends the wait for the failed try; the records of
    the peers we vouch for, which the catch-up goes by, come a moment later. We catch up to them and
    join their round late: we do not try the finished round again alone (there, our registration
    held it open for the patience while our peers moved on)."""
    peer = _peer(corpus, "me", overlap)
    swarm = LaggingSwarm(peer, _others_round_zero(corpus), lag_s=0.6)
    averager = ScriptedAverager("me", ["late", "alone"], on_late=swarm.others_apply)
    averager.matchmaking_s = 2.0  # the window and grace: the longest wait
    loop = _loop(peer, averager, swarm, timeout_s=30.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)

    first, second = averager.calls
    assert (first.round_id, first.join_only) == (0, False)
    assert (second.round_id, second.join_only) == (1 * ROUND_ID_STRIDE, True)
    assert swarm.published_at is not None and second.at - swarm.published_at >= 0.6


def test_a_peer_that_really_is_alone_retries_once_the_failed_try_is_over(corpus: Corpus) -> None:
    peer = _peer(corpus, "me")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))  # nobody ever publishes
    averager = ScriptedAverager("me", ["late", "alone"])
    loop = _loop(peer, averager, swarm, timeout_s=1.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)

    first, second = averager.calls
    assert (second.round_id, second.join_only) == (1, False)  # round 0's next try, opened by us
    assert second.at - first.at >= 1.0  # ... once every call of the failed try must have returned
    assert peer.state.round == 1


def test_a_peer_left_behind_the_head_by_a_failed_catch_up_only_joins(corpus: Corpus) -> None:
    """Its catch-up failed (the donors had moved on), so its Δ is fresh by its own round but the
    swarm finished that round long ago: it never opens the round (alone, a fork) but joins one a
    fresh peer opened, and its Δ is dropped when none did."""
    peer = _peer(corpus, "me")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    swarm.behind = True
    averager = ScriptedAverager("me", ["not_opened", "alone"])
    loop = _loop(peer, averager, swarm, timeout_s=1.0)
    loop.run(lambda: len(averager.calls) >= 2)
    assert [c.join_only for c in averager.calls] == [True, True]
    assert loop.ops.counters.dropped == 1 and loop.ops.counters.applied == 1


class FailureAwareAverager(ScriptedAverager):
    """A scripted averager whose failed tries become known over everywhere `over_after_s` after
    they failed here (as when every member of the group said so)."""

    def __init__(self, peer_id: str, answers: list[str], over_after_s: float) -> None:
        super().__init__(peer_id, answers)
        self.over_after_s = over_after_s
        self.asked: list[int] = []

    def failed_everywhere(self, round: int) -> bool:
        self.asked.append(round)
        return time.monotonic() - self.calls[-1].at >= self.over_after_s


def test_a_try_known_failed_everywhere_is_retried_without_waiting_out_the_bound(corpus: Corpus) -> None:
    peer = _peer(corpus, "me")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))  # nobody ever publishes
    averager = FailureAwareAverager("me", ["late", "alone"], over_after_s=0.5)
    loop = _loop(peer, averager, swarm, timeout_s=60.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)

    first, second = averager.calls
    assert set(averager.asked) == {first.round_id}  # it asked about the try that failed
    assert (second.round_id, second.join_only) == (1, False)  # round 0's next try, opened by us
    assert 0.5 <= second.at - first.at < 10.0  # once known over, long before the 60 s bound
    assert peer.state.round == 1


def test_under_overlap_a_last_round_that_fails_in_flight_is_done_again(corpus: Corpus) -> None:
    """--rounds 2 under overlap: round 1's averaging fails while round 2 trains; the node must not
    count it as done and exit with one round fewer."""
    peer = _peer(corpus, "me", "rebase")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))  # nobody ever publishes
    averager = FailureAwareAverager("me", ["alone", "late", "alone"], over_after_s=0.0)
    loop = _loop(peer, averager, swarm, timeout_s=60.0)
    loop.cfg = dataclasses.replace(loop.cfg, rounds=2)
    loop.run(lambda: False)
    assert loop.ops.counters.applied == 2 and peer.state.round == 2
    assert [c.round_id for c in averager.calls] == [0, 1 * ROUND_ID_STRIDE, 1 * ROUND_ID_STRIDE + 1]


def test_a_stop_ends_the_wait_for_a_failed_try(corpus: Corpus) -> None:
    peer = _peer(corpus, "me")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    stop = threading.Event()
    averager = ScriptedAverager("me", ["late"], on_late=lambda: threading.Timer(0.3, stop.set).start())
    loop = _loop(peer, averager, swarm, timeout_s=60.0)
    t0 = time.monotonic()
    loop.run(stop.is_set)
    assert time.monotonic() - t0 < 10.0  # SIGTERM and drain are not held up by the wait
    assert len(averager.calls) == 1 and peer.state.round == 0


@pytest.mark.parametrize("overlap", ["off", "rebase"])
def test_a_late_delta_no_fresh_peer_takes_is_dropped_and_the_peer_opens_the_next_round_at_once(
    corpus: Corpus, overlap: str
) -> None:
    """Every fresh peer left (or all are late): the late, join-only call finds no round opened
    within its bounded wait. Its Δ is dropped and the peer trains afresh and opens the round itself
    at once: it never registered, so there is no failed try to wait out (the exchange budget, here
    30 s; at GPT-2 124M's default rate hours, which stalled a benchmark swarm)."""
    peer = _peer(corpus, "me", overlap)
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    averager = ScriptedAverager("me", ["late", "not_opened", "alone"], on_late=swarm.others_apply)
    loop = _loop(peer, averager, swarm, timeout_s=30.0)
    t0 = time.monotonic()
    loop.run(lambda: loop.ops.counters.applied >= 1)
    assert time.monotonic() - t0 < 15.0

    _, late, fresh = averager.calls
    assert (late.round_id, late.join_only) == (1 * ROUND_ID_STRIDE, True)
    assert late.join_wait_s is not None and late.join_wait_s < 30.0
    assert (fresh.round_id, fresh.join_only, fresh.join_wait_s) == (1 * ROUND_ID_STRIDE + 1, False, None)
    # A round the peer may open waits for the others up to a local round of its own; a late Δ
    # opens none.
    assert late.patience_s == 0.0 and fresh.patience_s > 0
    # Without overlap round 0's Δ went in late and was dropped; with it, round 0's failed try is
    # dropped too, and the next local round's Δ went in late.
    assert loop.ops.counters.dropped == (1 if overlap == "off" else 2)
    assert peer.state.round == 2


class ReadingAverager(ScriptedAverager):
    """A scripted averager that says who registered for a try and the group they make
    (`RoundReader`): `others` register at the `register_at`-th read after the call, a group of
    their own that publishes its round (`publish`) at the `publish_at`-th; or, `member`, they
    registered in time for ours (their reads missed us, say) and the group they make has us."""

    def __init__(
        self,
        answers: list[str],
        others: list[str],
        *,
        register_at: int = 0,
        publish: Callable[[], None] = lambda: None,
        publish_at: int = 0,
        member: bool = False,
    ) -> None:
        super().__init__("me", answers)
        self.others, self.register_at, self.member = others, register_at, member
        self.publish, self.publish_at = publish, publish_at
        self.reads = 0

    def round_view(self, round: int) -> tuple[frozenset[str], tuple[str, ...]] | None:
        self.reads += 1
        if self.reads == self.publish_at:
            self.publish()
        if self.member:
            return frozenset(["me", *self.others]), tuple(sorted(["me", *self.others]))
        if self.reads < self.register_at:
            return frozenset(["me"]), ("me",)
        return frozenset(["me", *self.others]), tuple(sorted(self.others))


@pytest.mark.parametrize("overlap", ["off", "rebase"])
def test_a_round_averaged_alone_while_the_peers_level_with_it_had_yet_to_register_gives_way_to_theirs(
    corpus: Corpus, overlap: str
) -> None:
    """Our node closed its round alone before the peers at its round and θ registered (their local
    rounds end seconds later, or they were writing the checkpoint ours skipped after a restart):
    the round they open cannot have it. It does not apply its own (a fork, as CI saw after a
    restart), but waits for theirs and takes it; its Δ goes in late (without overlap)."""
    peer = _peer(corpus, "me", overlap)
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    swarm.level = ["other"]
    averager = ReadingAverager(
        ["alone", "alone"], ["other"], register_at=3, publish=swarm.others_apply, publish_at=5
    )
    loop = _loop(peer, averager, swarm, timeout_s=30.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)

    assert averager.reads >= 5  # it waited for their round, through their registration
    assert swarm.published_at is not None
    first, second = averager.calls
    assert (first.round_id, first.join_only) == (0, False)
    # Not round 0's next try, nor its own round 0: their round 1, after they published round 0.
    assert (second.round_id, second.join_only) == (1 * ROUND_ID_STRIDE, True)
    assert second.at >= swarm.published_at
    assert loop.ops.counters.applied == 1 and peer.state.round == 2


def test_a_round_alone_is_applied_when_the_others_registrations_make_it_a_member(corpus: Corpus) -> None:
    """The peers level with it registered in time for its round (their reads missed its record,
    or they came as it closed): by the registrations it is a member of their round, which fails
    without it, and they follow it. It applies its own at once, as before."""
    peer = _peer(corpus, "me")
    swarm = ScriptedSwarm(peer, _others_round_zero(corpus))
    swarm.level = ["other"]
    averager = ReadingAverager(["alone"], ["other"], member=True)
    loop = _loop(peer, averager, swarm, timeout_s=30.0)
    loop.run(lambda: loop.ops.counters.applied >= 1)
    assert averager.reads == 1 and len(averager.calls) == 1
    assert peer.state.round == 1 and swarm.published == 0
