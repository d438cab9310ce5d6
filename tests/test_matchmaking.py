"""When a round opens and closes, and what a registration dated in the past can still do.

A registration's time is its writer's word; the round opens at the `OPEN_QUORUM`-th earliest
(`matchmaking.close_and_members`), and a registration that nobody followed within a window and a
grace closed a round of its own. The real-DHT test has one member date its registration 100 s in
the past, which under a round opened by the earliest registration alone left every honest member
late, every round; now it is in no group at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
from hivemind.utils import get_dht_time
from test_averager_contract import (
    GRACE_S,
    PART_TIMEOUT_S,
    SLACK_S,
    WINDOW_S,
    Swarm,
    _assert_matches_reduce_group,
    _average_together,
    _contributions,
    no_p2pd_left_behind,  # noqa: F401 (an autouse fixture: no p2pd of this module survives a test)
)

from adloco.protocol.algorithms.allreduce import reduce_group
from adloco.protocol.algorithms.codecs import make_codec
from adloco.protocol.transport.dht import DHT_STALL_S
from adloco.protocol.transport.matchmaking import (
    MAX_PATIENCE_S,
    MOST_EARLY_TRIED,
    OPEN_QUORUM,
    Registrations,
    close_and_members,
    expectation,
    join_deadline,
    joining,
    matchmaking_bound_s,
)
from adloco.protocol.transport.wire import PROTOCOL_VERSION, Meter, read_frame, write_frame

from procs import wait_for

pytestmark = pytest.mark.timeout(60)


def _approx(expected: float) -> float:
    """`pytest.approx(expected)` typed as the float it stands for inside a tuple compared with ==."""
    return cast(float, pytest.approx(expected))


def test_the_round_opens_at_the_second_registration_and_closes_a_window_later() -> None:
    assert OPEN_QUORUM == 2
    # One registration dated 100 s in the past neither closes the round before the others nor is
    # in their group: nobody followed it in time, so it closed a round of its own.
    close, members = close_and_members({"x": -100.0, "a": 0.0, "b": 0.4, "c": 0.9}, 1.0, 0.3)
    assert close == pytest.approx(1.4) and members == ("a", "b", "c")
    # Honest registrations: the window runs from the second; a third 1.1 s after the first is in.
    close, members = close_and_members({"a": 0.0, "b": 0.3, "c": 1.1, "late": 1.4}, 1.0, 0.3)
    assert close == pytest.approx(1.3) and members == ("a", "b", "c")
    # Alone, a peer's round closes a window after its own registration.
    assert close_and_members({"a": 5.0}, 1.0, 0.3) == (6.0, ("a",))


def test_a_registration_nobody_followed_within_window_and_grace_closed_a_round_of_its_own() -> None:
    """A node cut off from the others registers and averages alone; once its link is back the DHT
    hands its record to the others when they reach that round. Read at the first registrant's own
    read (window + grace after it), a second registration still joins; one after that does not, and
    the later peers form the round without it."""
    cut = {"cut": 0.0}
    close, members = close_and_members({**cut, "a": 1.29, "b": 1.5}, 1.0, 0.3)
    assert close == pytest.approx(2.29) and members == ("a", "b", "cut")
    close, members = close_and_members({**cut, "a": 60.0, "b": 60.4}, 1.0, 0.3)
    assert close == pytest.approx(61.4) and members == ("a", "b")
    # Alone after the gap too: a round of its own for the one that registered after it.
    assert close_and_members({**cut, "a": 60.0}, 1.0, 0.3) == (61.0, ("a",))


def test_a_round_closes_once_the_group_its_registrants_expect_is_complete() -> None:
    """Registrations that all expect the group they turn out to be close the round at the last of
    them, not a window later; anyone else registering in between keeps the window."""
    group = ("a", "b", "c")
    expects = dict.fromkeys(group, expectation(group))
    times = {"a": 0.0, "b": 0.1, "c": 0.2}
    assert close_and_members(times, 1.0, 0.3, expects=expects) == (0.2, group)
    # Not complete yet: the window, as before.
    assert close_and_members({"a": 0.0, "b": 0.1}, 1.0, 0.3, expects=expects) == (1.1, ("a", "b"))
    # A joiner (no expectation) before the group was complete: the window, and the joiner is in.
    joined = close_and_members({**times, "d": 0.15}, 1.0, 0.3, expects={**expects, "d": ""})
    assert joined == (_approx(1.1), ("a", "b", "c", "d"))
    # One after it: the round had closed, it is late.
    assert close_and_members({**times, "d": 0.3}, 1.0, 0.3, expects={**expects, "d": ""}) == (0.2, group)
    # Registrants that expect different groups, one of them with a peer that has not come: the window.
    split = {**expects, "a": expectation(("a", "b", "d"))}
    assert close_and_members(times, 1.0, 0.3, expects=split)[0] == pytest.approx(1.1)
    # One that expects the group less a peer that came (it saw that one leave a round since, or does
    # not list it as an owner yet): every peer any of them expects is in, so the round closes there.
    # With the second opener in, the first's group less it was complete, yet the second's was not.
    fewer = {**expects, "a": expectation(("a", "b"))}
    assert close_and_members(times, 1.0, 0.3, expects=fewer) == (0.2, group)
    assert close_and_members({"a": 0.0, "b": 0.1}, 1.0, 0.3, expects=fewer)[0] == pytest.approx(1.1)
    # Alone, expecting itself: no early close (the quorum), its round closes a window later.
    assert close_and_members({"a": 5.0}, 1.0, 0.3, expects={"a": expectation(["a"])}) == (6.0, ("a",))


def test_a_join_only_registrant_the_group_expects_completes_it_when_it_registers() -> None:
    """Peers that completed a round expect, with each other, a peer that came after its close (one
    round behind, catching up: record 059). Its join-only registration completes the group they
    expect: the round closes there, not at the patience, and it is a member. While it has not come,
    the round keeps its patience; after it, as late as the patience, it is no member."""
    group = ("a", "b", "c")
    expects = {"a": expectation(group), "b": expectation(group), "c": joining(20.0)}
    patience = {"a": 6.0, "b": 6.0}
    opened = {"a": 5.0, "b": 5.1}
    came = close_and_members({**opened, "c": 5.6}, 1.0, 0.3, expects=expects, patience=patience)
    assert came == (5.6, group)
    assert close_and_members(opened, 1.0, 0.3, expects=expects, patience=patience) == (11.0, ("a", "b"))
    late = close_and_members({**opened, "c": 11.2}, 1.0, 0.3, expects=expects, patience=patience)
    assert late == (11.0, ("a", "b"))
    # A join-only registrant nobody expects, registered before the group was complete, is a member
    # of the round that closes then (it used to hold it open a window longer).
    pair = {"a": expectation(("a", "b")), "b": expectation(("a", "b")), "c": joining(20.0)}
    assert close_and_members({**opened, "c": 5.05}, 1.0, 0.3, expects=pair, patience=patience) == (5.1, group)


def test_a_join_only_registration_opens_nothing_and_is_a_member_of_the_round_that_closes_while_it_waits() -> (
    None
):
    """A late contribution registers at once, marked join-only until it gives up: alone it opens no
    round; while it waits, it is a member of the fresh peers' round, which closes when it would
    without it; once it gave up, or if it came after the round closed, it is no member."""
    group = ("f1", "f2")
    fresh = {"f1": 5.0, "f2": 5.1}
    expects = dict.fromkeys(group, expectation(group))
    assert close_and_members({"j": 0.0}, 1.0, 0.3, expects={"j": joining(10.0)}) == (float("-inf"), ())
    waiting = close_and_members({**fresh, "j": 0.0}, 1.0, 0.3, expects={**expects, "j": joining(10.0)})
    assert waiting == (5.1, ("f1", "f2", "j"))
    # Patient registrations (the floor, 6 s): the group they expect is complete at 5.1, and the
    # round closes there with the waiting one, not at the patience (which was for the group).
    patient = close_and_members(
        {**fresh, "j": 0.0},
        1.0,
        0.3,
        expects={**expects, "j": joining(10.0)},
        patience=dict.fromkeys(group, 6.0),
    )
    assert patient == (5.1, ("f1", "f2", "j"))
    gave_up = close_and_members({**fresh, "j": 0.0}, 1.0, 0.3, expects={**expects, "j": joining(4.0)})
    assert gave_up == (5.1, group)
    after = close_and_members({**fresh, "j": 5.2}, 1.0, 0.3, expects={**expects, "j": joining(20.0)})
    assert after == (5.1, group)
    # It neither opens a round nor counts toward the quorum: one fresh peer and it, a window later.
    assert close_and_members({"f1": 5.0, "j": 0.0}, 1.0, 0.3, expects={"j": joining(10.0)}) == (
        6.0,
        ("f1", "j"),
    )
    assert join_deadline(joining(12.5)) == 12.5 and join_deadline("join:nan") is None
    assert join_deadline(expectation(group)) is None


def test_a_quorum_of_records_dated_in_the_past_still_closes_the_round_early() -> None:
    """The limit, stated: OPEN_QUORUM identities that date their records in the past close the round
    before honest peers register (which is why a public run's identities are only as scarce as
    live p2pd instances, and a private run's are credentialed)."""
    close, members = close_and_members({"x": -100.0, "y": -100.0, "a": 0.0}, 1.0, 0.3)
    assert close == -99.0 and members == ("x", "y")


@pytest.mark.parametrize(("records", "quorum"), [({}, 2), ({"a": 0.0}, 0)])
def test_misuse_is_refused(records: dict[str, float], quorum: int) -> None:
    with pytest.raises(ValueError):
        close_and_members(records, 1.0, 0.3, quorum)


def test_a_registrant_waits_at_most_two_windows_and_graces_after_the_first_ones_patience() -> None:
    assert matchmaking_bound_s(1.0, 0.3, patience_s=0.0) == pytest.approx(2.6)
    assert matchmaking_bound_s(1.0, 0.3) == pytest.approx(2.6 + MAX_PATIENCE_S)


def test_a_patient_registration_keeps_its_round_open_for_the_group_it_expects() -> None:
    """Peers whose local rounds drifted apart: the first registers 8 s before the second. With a
    window of 1 s it opens a round alone and the second another (a fork); with a patience of 10 s
    its round stays open 10 s, takes both, and closes at the patience or a window after the
    quorum, the later; early once the group it expects is complete."""
    times = {"a": 0.0, "b": 8.0}
    assert close_and_members(times, 1.0, 0.3) == (9.0, ("b",))  # a's round was its own
    patient = {"a": 10.0, "b": 10.0}
    assert close_and_members(times, 1.0, 0.3, patience=patient) == (10.0, ("a", "b"))
    assert close_and_members({**times, "c": 9.9}, 1.0, 0.3, patience=patient) == (10.0, ("a", "b", "c"))
    assert close_and_members({**times, "c": 10.1}, 1.0, 0.3, patience=patient) == (10.0, ("a", "b"))
    # The second in 9.8 s: the quorum's window runs past the patience.
    assert close_and_members({"a": 0.0, "b": 9.8}, 1.0, 0.3, patience=patient) == (
        _approx(10.8),
        ("a", "b"),
    )
    # The group a expects is complete at c's registration: the round closes there.
    group = ("a", "b", "c")
    expects = dict.fromkeys(group, expectation(group))
    early = close_and_members({**times, "c": 9.0}, 1.0, 0.3, expects=expects, patience=patient)
    assert early == (9.0, group)
    # Only the first registration's patience holds the round: b's own is of no account here.
    assert close_and_members(times, 1.0, 0.3, patience={"b": 10.0})[1] == ("b",)
    # Alone, a patient registration closes its round of its own at its patience.
    assert close_and_members({"a": 5.0}, 1.0, 0.3, patience={"a": 10.0}) == (15.0, ("a",))
    # Nobody followed within patience and grace: a round of its own, as with the window.
    late = close_and_members({"a": 0.0, "b": 10.4, "c": 10.5}, 1.0, 0.3, patience={"a": 10.0})
    assert late == (_approx(11.5), ("b", "c"))


def test_registrants_a_dht_stall_held_apart_meet_in_one_round_however_short_their_local_rounds(
    hivemind_swarm: Swarm,
) -> None:
    """Two averagers complete a round together, so each expects the other. At the next round one
    calls 4 s after the other (more than window and grace, less than `DHT_STALL_S`: what a store
    waiting on a frozen peer costs), and neither claims any patience (local rounds of a fraction of
    a second, as the tests' nodes). Without the floor on patience the first opened a round of its
    own and the second another, a fork (CI of stop 39, record 056). They are one group, with
    reduce_group's bytes; and it closes as soon as the second registered, not at the patience."""
    assert WINDOW_S + GRACE_S < 4.0 < DHT_STALL_S
    swarm = hivemind_swarm
    swarm.add_nodes(2)
    averagers = [swarm.averager(i) for i in range(2)]
    first = _contributions(averagers, "int8", seed=15)
    _assert_matches_reduce_group(_average_together(averagers, first, round=1, spec="int8"), first, "int8")
    second = _contributions(averagers, "int8", seed=16)
    outcomes = _average_together(averagers, second, round=2, spec="int8", delays=[0.0, 4.0], patience_s=0.0)
    _assert_matches_reduce_group(outcomes, second, "int8")
    waited = outcomes[0].elapsed_s
    assert waited < DHT_STALL_S, waited  # the group it expected was complete at 4 s
    print(f"\nthe first registrant waited {waited:.2f} s for the second (called 4 s later)")


def test_fresh_peers_whose_first_calls_come_seconds_apart_average_their_first_round_together(
    hivemind_swarm: Swarm,
) -> None:
    """Two averagers that have averaged with nobody yet (nodes just started) call their first round
    4 s apart (one node's start was slower), each asking for the patience of its short local round
    (0.5 s), as a node does. A first registration that asks for any waits at least `DHT_STALL_S`,
    group or not: they are one group, with
    reduce_group's bytes. Without that, the first opened a round of its own after a window and the
    second another, each alone: in CI's run three nodes started together so made three lineages
    of one, which no majority heals (record 066)."""
    assert WINDOW_S + GRACE_S < 4.0 < DHT_STALL_S
    swarm = hivemind_swarm
    swarm.add_nodes(2)
    averagers = [swarm.averager(i) for i in range(2)]
    first = _contributions(averagers, "int8", seed=17)
    outcomes = _average_together(averagers, first, round=1, spec="int8", delays=[0.0, 4.0], patience_s=0.5)
    _assert_matches_reduce_group(outcomes, first, "int8")
    waited = outcomes[0].elapsed_s
    # No group expected: the round waits out the patience rather than closing when the second came.
    assert waited >= DHT_STALL_S, waited
    print(f"\nthe first registrant waited {waited:.2f} s for the second (called 4 s later)")


@pytest.fixture
def hivemind_swarm() -> Iterator[Swarm]:
    swarm = Swarm("hivemind")
    try:
        yield swarm
    finally:
        swarm.close()


def test_a_member_dating_its_registration_in_the_past_cannot_make_the_others_late(
    hivemind_swarm: Swarm,
) -> None:
    swarm = hivemind_swarm
    swarm.add_nodes(4)
    averagers = [swarm.averager(i) for i in range(4)]
    _date_records_back(averagers[3], 100.0)
    contributions = _contributions(averagers, "int8", seed=11)
    began = time.monotonic()
    outcomes = _average_together(averagers, contributions, round=2, spec="int8")
    # The honest three form the round and hold reduce_group's bytes over their contributions; the
    # backdater's record, which nobody followed within a window and a grace, is in no group (its
    # own call gets None: it is late to the round the others opened).
    _assert_matches_reduce_group(outcomes[:3], contributions[:3], "int8")
    assert outcomes[3].result is None
    bound = matchmaking_bound_s(WINDOW_S, GRACE_S, patience_s=0.0) + SLACK_S  # nobody was patient
    assert all(o.elapsed_s < bound for o in outcomes), [o.elapsed_s for o in outcomes]
    print(f"\nthree members despite a registration dated 100 s back, in {time.monotonic() - began:.2f} s")


def _date_records_back(averager: Any, seconds: float) -> None:
    """From now on `averager` stores the record a peer that chooses its own time would: signed,
    bound, true in all but its time, `seconds` back (and it believes that time itself)."""
    matchmaker = averager._matchmaker

    async def register_back(
        key: str,
        round: int,
        expect: str,
        patience: float,
        excluded: tuple[str, ...],
        workers: tuple[str, ...],
    ) -> float:
        now: float = get_dht_time()
        await matchmaker.dht.store(
            key,
            (now - seconds, matchmaker.peer_id, expect, patience, list(excluded), list(workers)),
            expiration_time=now + matchmaker.record_ttl_s,
            subkey=matchmaker.dht.identity.subkey,
            return_future=True,
        )
        return now - seconds

    matchmaker._register = register_back


def test_one_vote_seen_first_does_not_leave_an_honest_registrant_out(hivemind_swarm: Swarm) -> None:
    """A key dates its record 30 s back and asks the others to leave the first honest registrant out
    (`robust_swarm.py --attacks backdate`: its views differ from the others', so it catches honest
    owners as refusing). That registrant read the key right after it registered, saw only its own
    record and the hostile one, one vote of one, and gave up; the two honest others, reading all
    the records, counted it in (one vote of three) and took its refusal for an owner that gave no
    answer: it was left out of the round and the next (the backdate runs of stop 52). It now decides
    on the records the others decide on, and the three complete the round."""
    swarm = hivemind_swarm
    swarm.add_nodes(4)
    averagers = [swarm.averager(i) for i in range(4)]
    victim, hostile = averagers[0], averagers[3]
    _date_records_back(hostile, 30.0)
    cast(Any, hostile)._matchmaker.excluded = lambda: [victim.peer_id]
    contributions = _contributions(averagers, "int8", seed=17)
    delays = [0.1, 0.5, 0.5, 0.0]
    outcomes = _average_together(averagers, contributions, round=2, spec="int8", delays=delays)
    _assert_matches_reduce_group(outcomes[:3], contributions[:3], "int8")


def test_a_member_of_the_group_that_dates_its_next_registration_back_holds_nobody_up(
    hivemind_swarm: Swarm,
) -> None:
    """Four complete round 1; at round 2 one of them dates its record 30 s back (bench/hostile_node.py
    `backdate`, which cost the honest swarm up to +197 % wall time: every round that expected it
    waited the 6 s patience floor). The three others close round 2 as soon as they are all in, with
    reduce_group's bytes, in less than a window; the backdater is in no group."""
    swarm = hivemind_swarm
    swarm.add_nodes(4)
    averagers = [swarm.averager(i) for i in range(4)]
    first = _contributions(averagers, "int8", seed=15)
    _assert_matches_reduce_group(_average_together(averagers, first, round=1, spec="int8"), first, "int8")
    _date_records_back(averagers[3], 30.0)
    second = _contributions(averagers, "int8", seed=16)
    outcomes = _average_together(averagers, second, round=2, spec="int8")
    _assert_matches_reduce_group(outcomes[:3], second[:3], "int8")
    assert outcomes[3].result is None
    elapsed = [o.elapsed_s for o in outcomes[:3]]
    assert max(elapsed) < WINDOW_S < DHT_STALL_S, elapsed
    print(f"\nthe honest three closed round 2 in {max(elapsed):.2f} s (patience floor {DHT_STALL_S} s)")


def test_a_registration_dated_before_the_start_of_the_round_that_expects_it_is_not_waited_for() -> None:
    """The pure rule of the test above: the expected group less the peers whose registrations are
    dated before the round's start (each a round of its own, or a key dating its records back) is
    complete. A peer dated within its wait of the others is no such peer: a member, as before."""
    group = ("a", "b", "c", "d")
    expects = dict.fromkeys(group, expectation(group))
    patience = dict.fromkeys(group, 6.0)
    honest = {"a": 5.0, "b": 5.1, "c": 5.2}
    back = close_and_members({**honest, "d": -25.0}, 1.0, 0.3, expects=expects, patience=patience)
    assert back == (5.2, ("a", "b", "c"))
    # Dated back within its wait: it opens the round, and is waited for (it is in the group).
    near = close_and_members({**honest, "d": 1.0}, 1.0, 0.3, expects=expects, patience=patience)
    assert near == (5.2, group)
    # A peer the group does not expect, dated back: nothing to do with the group; closes at 5.2 too.
    other = close_and_members(
        {**honest, "d": -25.0, "x": -40.0},
        1.0,
        0.3,
        expects={**expects, "x": expectation(("x",))},
        patience=patience,
    )
    assert other == (5.2, ("a", "b", "c"))
    # A registrant that is no opener (no record the openers' work lists share) dated back: the same.
    outside = close_and_members(
        {**honest, "d": -25.0}, 1.0, 0.3, expects=expects, patience=patience, openers=("a", "b", "c")
    )
    assert outside == (5.2, ("a", "b", "c"))
    # A join-only registration dated back is a late contribution waiting: a member, and no wait.
    joins = close_and_members(
        {**honest, "d": -25.0}, 1.0, 0.3, expects={**expects, "d": joining(30.0)}, patience=patience
    )
    assert joins == (5.2, group)


def test_a_registration_dated_back_is_not_waited_for_whatever_group_it_expects() -> None:
    """A key in the last group that dates its registration back expecting another group than the
    others (backdate, stop 53: it held the round after the one it was in open for the patience):
    the round still closes once the rest of the expected group is in. So does one whose key was not
    in the group and that copies the others' expectation, next to an absent member dated back.
    With more keys dated back than `MOST_EARLY_TRIED`, the patience holds, as before."""
    group = ("a", "b", "c", "d")
    expects = dict.fromkeys(group, expectation(group))
    patience = dict.fromkeys(group, 6.0)
    honest = {"a": 5.0, "b": 5.1, "c": 5.2}
    lying = {**expects, "d": expectation(("d", "e"))}
    assert close_and_members({**honest, "d": -25.0}, 1.0, 0.3, expects=lying, patience=patience) == (
        5.2,
        ("a", "b", "c"),
    )
    # Not in the group, copying its expectation, dated back, next to the absent member "d".
    copied = {**lying, "x": expectation(group)}
    at = close_and_members({**honest, "d": -25.0, "x": -30.0}, 1.0, 0.3, expects=copied, patience=patience)
    assert at == (5.2, ("a", "b", "c"))
    # Without "d" dated back, the group is not complete: the round waits for it (the patience).
    waits = close_and_members({**honest, "x": -30.0}, 1.0, 0.3, expects=copied, patience=patience)
    assert waits == (11.0, ("a", "b", "c"))
    # Many keys dated back: only those expecting the group are tried, all together (the patience).
    many = {f"k{i}": -100.0 - 10 * i for i in range(MOST_EARLY_TRIED)}  # each a round of its own
    crowd = {**lying, **dict.fromkeys(many, expectation(("k",)))}
    held = close_and_members({**honest, "d": -25.0, **many}, 1.0, 0.3, expects=crowd, patience=patience)
    assert held == (11.0, ("a", "b", "c"))


def test_a_peer_that_averaged_a_round_alone_meets_the_others_at_that_round_later(
    hivemind_swarm: Swarm,
) -> None:
    """A node cut off from the others averages round 5 alone, then takes the swarm's state back and
    meets the others at round 5 when they get there: its old record is in no group of theirs, and
    its second call at round 5 is taken (a round averaged alone is not spent): the three complete
    it together with reduce_group's bytes."""
    swarm = hivemind_swarm
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    contributions = _contributions(averagers, "int8", seed=12)
    alone = averagers[0].average(contributions[0], round=5, codec=make_codec("int8"), timeout=30.0)
    assert alone is not None and alone.members == (averagers[0].peer_id,)
    time.sleep(WINDOW_S + GRACE_S)  # the others reach round 5 after its round of its own closed
    outcomes = _average_together(averagers, contributions, round=5, spec="int8")
    _assert_matches_reduce_group(outcomes, contributions, "int8")
    # A round averaged with others is spent.
    with pytest.raises(ValueError, match="single-use"):
        averagers[1].average(contributions[1], round=5, codec=make_codec("int8"), timeout=30.0)


def test_the_second_round_of_a_group_closes_when_all_of_it_has_registered(hivemind_swarm: Swarm) -> None:
    """The first round of three closes a window after its second registration; the next, whose
    registrations all expect the three, closes as soon as the third registers: its calls take less
    than the window. Both hold reduce_group's bytes."""
    swarm = hivemind_swarm
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    first = _contributions(averagers, "int8", seed=13)
    outcomes = _average_together(averagers, first, round=1, spec="int8")
    _assert_matches_reduce_group(outcomes, first, "int8")
    assert max(o.elapsed_s for o in outcomes) >= WINDOW_S
    second = _contributions(averagers, "int8", seed=14)
    outcomes = _average_together(averagers, second, round=2, spec="int8")
    _assert_matches_reduce_group(outcomes, second, "int8")
    elapsed = [o.elapsed_s for o in outcomes]
    assert max(elapsed) < WINDOW_S, elapsed
    print(f"\nfirst round closed a window late; the second in {max(elapsed):.2f} s (window {WINDOW_S} s)")


def _phantom(swarm: Swarm, round: int, refuse_with: str | None) -> str:
    """A DHT peer registered for `round` that is not an averager: no stream to it opens, or (with
    `refuse_with`) it refuses every request with that text. Returns its peer id."""
    phantom = swarm.dhts[-1]
    now = get_dht_time()
    assert phantom.store(
        f"run-a.round{round}",
        (now, phantom.identity.peer_id, "", 0.0, [], []),
        expiration_time=now + 60,
        subkey=phantom.identity.subkey,
    )
    if refuse_with is not None:
        # An averager on it that never calls `average`, its handler swapped for one that refuses.
        server: Any = swarm.averager(len(swarm.dhts) - 1)

        async def refuse(_info: Any, reader: Any, writer: Any) -> None:
            await read_frame(reader, Meter(), max_body=0)
            await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": refuse_with}, [], Meter())
            writer.close()

        server._call(server._p2p.remove_binary_stream_handler(server._handler_name), timeout=10)
        server._call(server._p2p.add_binary_stream_handler(server._handler_name, refuse), timeout=10)
    return str(phantom.identity.peer_id)


def test_the_parts_of_an_owner_nobody_reaches_are_reduced_by_the_next_member_and_the_round_completes(
    hivemind_swarm: Swarm,
) -> None:
    """A registration whose writer serves nothing (a made-up identity, or a member that died after
    registering) owns a part. The members that cannot open a stream to it ask the next member in
    order, which reduces those parts in its place: the round completes for the live members with
    the bytes `reduce_group` gives over their contributions."""
    swarm = hivemind_swarm
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(2)]
    round = 5
    phantom = _phantom(swarm, round, refuse_with=None)
    contributions = _contributions(averagers, "int8", seed=12)
    outcomes = _average_together(averagers, contributions, round=round, spec="int8")
    expected = reduce_group(contributions, codec=make_codec("int8"))
    results = [o.result for o in outcomes]
    assert all(r is not None for r in results)
    for r in results:
        assert r is not None
        assert r.averaged == expected.averaged and r.members == expected.members
        assert r.reports == expected.reports
        assert phantom not in r.owners.values()  # its parts came from a stand-in
    assert results[0].owners == results[1].owners  # type: ignore[union-attr]
    assert all(o.elapsed_s < swarm.round_bound_s + PART_TIMEOUT_S for o in outcomes)


def test_a_try_failed_for_every_live_member_is_known_over_at_once(hivemind_swarm: Swarm) -> None:
    """An owner that refuses every member (alive, so nobody stands in for it) fails the try for
    both real members. Each says so, and each then knows the try is over everywhere (the refusing
    owner, whose exchange broke, aside) instead of waiting out the longest a call may take."""
    swarm = hivemind_swarm
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(2)]
    round = 6
    refuser = _phantom(swarm, round, refuse_with="no")
    contributions = _contributions(averagers, "int8", seed=13)
    outcomes = _average_together(averagers, contributions, round=round, spec="int8")
    assert [o.result for o in outcomes] == [None, None]
    began = time.monotonic()
    # Each says so without waiting for the store to land everywhere: known over within a few reads.
    wait_for(lambda: all(a.failed_everywhere(round) for a in averagers), timeout=5, what="the marks")  # type: ignore[attr-defined]
    print(f"\nthe try is known over everywhere {time.monotonic() - began:.2f} s after the calls returned")
    # The refusing owner never says so; the members' marks name it as gone, which is what ends the
    # wait for it. A member nobody named and that never said so keeps the try open.
    matchmaker: Any = averagers[0]._matchmaker  # type: ignore[attr-defined]
    members = sorted({*(a.peer_id for a in averagers), refuser})
    assert averagers[0]._call(matchmaker.all_left(round, members), timeout=10)  # type: ignore[attr-defined]
    silent = "QmSilentMemberThatNeverSaidItsTryFailed"  # a member id only: nobody named it
    assert not averagers[0]._call(matchmaker.all_left(round, [*members, silent]), timeout=10)  # type: ignore[attr-defined]
    # A round no group formed for is never over by this rule (the caller waits out the bound).
    assert not averagers[0].failed_everywhere(round + 1)  # type: ignore[attr-defined]


def test_a_member_that_never_says_its_try_failed_has_left_once_another_member_names_it_or_it_registered_again(
    hivemind_swarm: Swarm,
) -> None:
    """The wait for a failed try's members (`Matchmaker.all_left`) ends for one that never says so,
    as a dead owner or a peer restarted from its checkpoint never does, once a member that said so
    names it among those it saw leave, or once it registered for the next try (issue 26 in CI: a
    survivor that had read the dead owner's answer waited 110 s for it, and the three peers each
    averaged the round alone). A name from a peer outside the try's members ends nothing."""
    swarm = hivemind_swarm
    swarm.add_nodes(4)
    a, b, outsider = (swarm.averager(i) for i in range(3))
    round = 9
    mm: Any = a._matchmaker  # type: ignore[attr-defined]
    dead = str(swarm.dhts[3].identity.peer_id)

    def left(members: list[str]) -> bool:
        return a._call(mm.all_left(round, members), timeout=10)  # type: ignore[attr-defined,no-any-return]

    def marks() -> set[str]:
        return set(a._call(mm._failures(round), timeout=10))  # type: ignore[attr-defined]

    outsider._matchmaker.mark_failed(round, [dead])  # type: ignore[attr-defined]
    b._matchmaker.mark_failed(round)  # type: ignore[attr-defined]
    wait_for(lambda: marks() == {outsider.peer_id, b.peer_id}, timeout=5, what="the two marks")
    assert not left([b.peer_id, dead])  # the one who named it is no member of this try
    # Its later mark replaces the first.
    b._matchmaker.mark_failed(round, [dead])  # type: ignore[attr-defined]
    wait_for(lambda: left([b.peer_id, dead]), timeout=5, what="a member's mark naming the dead owner")
    # A peer that registered for the next try (round + 1) is in no call of this one.
    assert not left([a.peer_id])
    _phantom(swarm, round + 1, refuse_with=None)  # swarm.dhts[3]: the restarted peer, registering again
    wait_for(lambda: left([dead]), timeout=5, what="the next try's registration")


def test_a_registrant_late_for_a_try_that_failed_knows_it_over_once_its_group_has_left_it(
    hivemind_swarm: Swarm,
) -> None:
    """Two members and an owner that refuses them form a group; a third peer registers after the
    close (late). Once the two have said their try failed, only the refusing owner is still in
    it, which can complete nothing shared: the late one knows the try over and may retry with them
    now, not after the longest a call may take. A late one whose group completed its round, which
    nobody left, keeps waiting (for the head)."""
    swarm = hivemind_swarm
    swarm.add_nodes(4)
    averagers = [swarm.averager(i) for i in range(3)]
    round = 7
    refuser = _phantom(swarm, round, refuse_with="no")
    contributions = _contributions(averagers, "int8", seed=14)
    late_by = WINDOW_S + GRACE_S + 1.0
    outcomes = _average_together(averagers, contributions, round=round, spec="int8", delays=[0, 0, late_by])
    assert [o.result for o in outcomes] == [None, None, None]
    late: Any = averagers[2]
    members, _ = late._call(late._matchmaker.left_try(round), timeout=10)
    assert set(members) == {averagers[0].peer_id, averagers[1].peer_id, refuser}
    wait_for(lambda: late.failed_everywhere(round), timeout=5, what="the late one to know the try over")
    # A group that completed: nobody left it, and the late one waits as before.
    round = 8
    contributions = _contributions(averagers, "int8", seed=15)
    outcomes = _average_together(averagers, contributions, round=round, spec="int8", delays=[0, 0, late_by])
    assert [o.result is not None for o in outcomes] == [True, True, False]
    members, left = late._call(late._matchmaker.left_try(round), timeout=10)
    assert set(members) == {averagers[0].peer_id, averagers[1].peer_id} and not left
    assert not late.failed_everywhere(round)


def test_a_key_without_a_record_among_the_openers_neither_holds_nor_breaks_the_early_close() -> None:
    """Issue 25 §2 (`bench/robust_swarm.py --attacks mute+fresh`): a fresh key each round, registered
    between the openers' registrations and expecting another group (its own), held every round open
    for the patience (rounds of 8 s where the clean ones took 1.2 s). A registrant that is no opener
    is now a member if it came by the early close, and neither holds nor breaks it; another opener
    expecting a group with a peer that has not come still does."""
    group = ("a", "b", "c")
    expects = {**dict.fromkeys(group, expectation(group)), "new": expectation((*group, "new"))}
    patience = dict.fromkeys(group, 6.0)

    def closed(times: dict[str, float], expects: dict[str, str]) -> tuple[float, tuple[str, ...]]:
        return close_and_members(times, 1.0, 0.3, expects=expects, patience=patience, openers=set(group))

    times = {"a": 0.0, "new": 0.1, "b": 0.2, "c": 0.4}
    close, members = closed(times, expects)
    assert close == pytest.approx(0.4) and members == ("a", "b", "c", "new")
    close, members = closed({**times, "new": 0.5}, expects)  # after the early close: not a member
    assert close == pytest.approx(0.4) and members == group
    close, members = closed(times, {**expects, "b": expectation(("a", "b", "d"))})
    assert close == pytest.approx(6.0) and members == ("a", "b", "c", "new")


def test_an_opener_the_group_does_not_expect_that_expects_it_neither_holds_nor_breaks_the_early_close() -> (
    None
):
    """A node that joined the last round late (a member, none of its owners) is back in step and
    registers as an opener, expecting the group the others expect, which it is not in (the last
    round's owners). The round closes as soon as that group is in; the node is a member. Stop 54's
    owner-omit victim held its first round back with the others open for the patience."""
    owners = ("a", "b")
    expects = dict.fromkeys((*owners, "v"), expectation(owners))
    patience = dict.fromkeys((*owners, "v"), 6.0)
    close, members = close_and_members(
        {"a": 0.0, "v": 0.1, "b": 0.2}, 1.0, 0.3, expects=expects, patience=patience
    )
    assert close == _approx(0.2) and members == ("a", "b", "v")
    # The group it expects is not in yet: the patience, as before.
    close, _ = close_and_members({"a": 0.0, "v": 0.1}, 1.0, 0.3, expects=expects, patience=patience)
    assert close == _approx(6.0)


def test_a_registration_still_expecting_a_peer_most_leave_out_does_not_break_the_early_close() -> None:
    """Stop 53's owner-omit (record 072): the evidence against a lying owner reached the honest
    registrants after different rounds, so for one round one of them still expected the group with
    the liar and the others the group without it, and the round waited out the patience on every
    node. The liar is outvoted (most registrations ask to leave it out): a registration expecting the
    group with it expects the same group, and the round closes once the honest three are in. An
    opener expecting a peer that has not come still keeps the patience, outvoted peers or not."""
    honest = ("a", "b", "c")
    lists = {p: tuple(q for q in honest if q != p) for p in honest}
    patience = dict.fromkeys([*honest, "liar"], 6.0)

    def registrations(expects: dict[str, str], excludes: dict[str, tuple[str, ...]]) -> Registrations:
        return Registrations(
            {"a": 0.0, "liar": 0.1, "b": 0.2, "c": 0.4},
            {**expects, "liar": expectation((*honest, "liar"))},
            patience,
            {**excludes, "liar": ()},
            {**lists, "liar": honest},
        )

    without, stale = expectation(honest), expectation((*honest, "liar"))
    # "b" registered before the evidence reached it: it expects the liar and does not leave it out.
    late_news = registrations({"a": without, "b": stale, "c": without}, {"a": ("liar",), "c": ("liar",)})
    assert late_news.outvoted() == {"liar"}
    close, members = late_news.close_and_members(1.0, 0.3)
    assert close == pytest.approx(0.4) and members == honest
    # Without an outvoted peer to account for it, an opener expecting a peer that has not come keeps
    # the wait.
    other = registrations(
        {"a": without, "b": expectation(("a", "b", "d")), "c": without}, dict.fromkeys(honest, ())
    )
    assert other.outvoted() == set()
    assert other.close_and_members(1.0, 0.3)[0] == pytest.approx(6.0)
    # And with one, an expectation of a group with a peer that is not here still does.
    odd = registrations(
        {"a": without, "b": expectation(("a", "b", "d")), "c": without}, {"a": ("liar",), "c": ("liar",)}
    )
    assert odd.close_and_members(1.0, 0.3)[0] == pytest.approx(6.0)


def test_keys_with_no_record_cannot_open_time_or_hold_a_round_once_some_registrants_worked_together() -> None:
    """The limit above, closed where registrants worked together: only the registrations of the
    core of their work lists open the round (`openers`). Two fresh keys dating theirs 100 s in the
    past close nothing and are in no group; one that registered just before the openers joins
    them; one claiming the most patience holds nothing."""
    openers = {"a", "b", "c"}
    times = {"x": -100.0, "y": -100.0, "a": 0.0, "b": 0.2, "c": 0.4}
    close, members = close_and_members(times, 1.0, 0.3, openers=openers)
    assert close == pytest.approx(1.2) and members == ("a", "b", "c")
    times = {"new": -0.5, "a": 0.0, "b": 0.2}
    close, members = close_and_members(times, 1.0, 0.3, openers={"a", "b"})
    assert close == pytest.approx(1.2) and members == ("a", "b", "new")
    times, patience = {"x": 0.0, "a": 0.1, "b": 0.2}, {"x": MAX_PATIENCE_S}
    assert close_and_members(times, 1.0, 0.3, patience=patience, openers={"a", "b"})[0] == pytest.approx(1.2)
    # A member of the group the registrants expect that registered just before the first opener
    # (it is no opener: it has no record with them) still lets the round close early.
    group = ("a", "b", "new")
    expects = dict.fromkeys(group, expectation(group))
    close, members = close_and_members(
        {"new": -0.01, "a": 0.0, "b": 0.2}, 1.0, 0.3, expects=expects, openers={"a", "b"}
    )
    assert close == pytest.approx(0.2) and members == ("a", "b", "new")
    # Registrations whose writers list one another are the openers.
    lists = {p: tuple(sorted(openers - {p})) for p in openers}
    found = Registrations(
        {"x": -100.0, "y": -100.0, "a": 0.0, "b": 0.2, "c": 0.4},
        dict.fromkeys(["x", "y", "a", "b", "c"], ""),
        dict.fromkeys(["x", "y", "a", "b", "c"], 0.0),
        workers={**lists, "x": ("y",), "y": ("x",)},
    )
    close, members = found.close_and_members(1.0, 0.3)
    assert close == pytest.approx(1.2) and members == ("a", "b", "c")


def test_one_patient_registration_does_not_hold_the_round_open_for_everyone() -> None:
    """The issue's staller: a key that registers first with the most patience allowed held every
    round it opened open 60 s. The round now waits the lower median of the patience its
    registrations claim: with two honest registrations of 2 s, 2 s."""
    times = {"x": 0.0, "a": 0.5, "b": 0.7}
    patience = {"x": MAX_PATIENCE_S, "a": 2.0, "b": 2.0}
    close, members = close_and_members(times, 1.0, 0.3, patience=patience)
    assert close == pytest.approx(2.0) and members == ("a", "b", "x")
    # Alone (nobody to outvote it) a registration keeps its own patience, as before.
    assert close_and_members({"x": 0.0}, 1.0, 0.3, patience={"x": 5.0})[0] == pytest.approx(5.0)
