"""Trust earned by work (`protocol/algorithms/trust.py`): whose work counts, who may own parts, and
in what order parts are dealt."""

from __future__ import annotations

import hashlib

import pytest

from adloco.protocol.algorithms.trust import (
    BAR_GROWTH,
    MAX_BAR,
    WORK_FLOOR,
    WORK_MIN_ROUNDS,
    WORK_ROUNDS,
    WorkLedger,
    accepted_work,
    earners,
    eligible_owners,
    owner_order,
    seeders,
)
from adloco.protocol.transport.matchmaking import outvoted


def test_work_is_the_weight_of_a_member_some_of_whose_parts_were_averaged() -> None:
    weights = {"a": 100.0, "b": 50.0, "c": 80.0, "d": 0.0}
    work = accepted_work(weights, {"b": 3, "c": 2}, parts=3)
    assert work == {"a": 100.0, "b": 0.0, "c": 80.0, "d": 0.0}  # b: all 3 parts left out


def test_a_key_at_weight_zero_or_a_sliver_of_the_median_earns_nothing() -> None:
    median = 100.0
    work = {"a": 90.0, "b": median, "c": 120.0, "zero": 0.0, "sliver": median / WORK_FLOOR / 2}
    assert earners(work) == ["a", "b", "c"]
    # A slow honest member with a twentieth of the median still counts.
    assert "slow" in earners({"a": 100.0, "b": 100.0, "slow": 100.0 / WORK_FLOOR})
    assert earners({"a": 0.0, "b": 0.0}) == []


def test_a_fresh_swarm_is_owned_by_every_member() -> None:
    members = ["a", "b", "c"]
    assert eligible_owners(members, {}) == ("a", "b", "c")
    assert eligible_owners(members, {"a": ["x"], "b": ["y"]}) == ("a", "b", "c")  # nobody lists a fellow


def test_a_fresh_key_owns_nothing_in_a_group_that_worked_together() -> None:
    lists = {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"], "new": []}
    assert eligible_owners(["a", "b", "c", "new"], lists) == ("a", "b", "c")
    # Listing the others makes it a voter, not an owner.
    lists["new"] = ["a", "b", "c"]
    assert eligible_owners(["a", "b", "c", "new"], lists) == ("a", "b", "c")


def test_two_keys_that_list_each_other_do_not_outvote_three_that_worked_together() -> None:
    lists = {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"], "s1": ["s2"], "s2": ["s1"]}
    assert eligible_owners(["a", "b", "c", "s1", "s2"], lists) == ("a", "b", "c")


def test_a_peer_back_after_its_company_left_owns_with_the_one_it_worked_with() -> None:
    # a and b worked together; c's work the others have forgotten: it owns again once it has a record.
    lists = {"a": ["b"], "b": ["a"], "c": ["a"]}
    assert eligible_owners(["a", "b", "c"], lists) == ("a", "b")


def test_keys_listing_each_other_beyond_half_the_voters_are_eligible_the_known_limit() -> None:
    """The module doc's limit, pinned: five keys that list one another, against three honest peers,
    are more than half of the voters and own the parts (their answers are then verified)."""
    honest = ["a", "b", "c"]
    sybils = [f"s{i}" for i in range(5)]
    lists = {h: [o for o in honest if o != h] for h in honest}
    lists |= {s: [o for o in sybils if o != s] for s in sybils}
    assert eligible_owners(honest + sybils, lists) == tuple(sybils)


def test_the_seed_is_drawn_from_the_owners_secrets_when_two_own_else_from_every_member() -> None:
    members = ["a", "b", "c", "new"]
    assert seeders(members, ("c", "a", "b")) == ["a", "b", "c"]  # a fresh key's secret is not needed
    assert seeders(members, members) == members  # a fresh swarm: everyone owns, every secret counts
    # One owner knows its own secret: the seed would be its to choose, so every member's counts.
    assert seeders(members, ("a",)) == members


def test_owner_order_is_a_draw_from_the_seed_that_no_id_can_fix() -> None:
    owners = [f"Qm{i:044d}" for i in range(6)]
    orders = {owner_order(hashlib.sha256(bytes([r])).digest(), owners) for r in range(40)}
    assert all(sorted(o) == sorted(owners) for o in orders)
    # The lowest id is not always first (sorted ids gave it the largest tensor every round).
    firsts = [owner_order(hashlib.sha256(bytes([r])).digest(), owners)[0] for r in range(40)]
    assert len(set(firsts)) > 3
    assert owner_order(b"seed", owners) == owner_order(b"seed", list(reversed(owners)))


@pytest.mark.parametrize("members", [["a"], ["a", "b"]])
def test_small_groups_always_have_an_owner(members: list[str]) -> None:
    assert eligible_owners(members, {m: ["zz"] for m in members}) == tuple(members)
    assert eligible_owners(members, {m: [o for o in members if o != m] for m in members}) == tuple(members)


def test_one_registrant_cannot_leave_anyone_out_and_a_majority_can() -> None:
    excludes = {"a": ["s"], "b": ["s"], "c": [], "s": ["a"]}
    assert outvoted(excludes) == {"s"}  # 2 of its 3 others
    assert outvoted({"a": ["b"], "b": [], "c": []}) == set()


def test_keys_that_did_no_work_cannot_leave_out_a_peer_that_did_however_many() -> None:
    """Five fresh keys ask to leave out an honest peer of three that worked together: by keys they
    are 5 of 7 of its others, by work they have no vote. The three still leave out a staller of
    theirs (a peer in their core that two of them caught)."""
    honest = ["a", "b", "c"]
    sybils = [f"s{i}" for i in range(5)]
    lists = {h: [o for o in honest if o != h] for h in honest}
    excludes: dict[str, list[str]] = {h: [] for h in honest} | {s: ["a"] for s in sybils}
    assert outvoted(excludes) == {"a"}  # by keys
    assert outvoted(excludes, lists) == set()  # by work
    lists["x"] = ["a", "b", "c"]
    for h in honest:
        lists[h].append("x")
    excludes |= {"a": ["x"], "b": ["x"], "x": ["c"]}
    assert outvoted(excludes, lists) == {"x"}


def test_a_peer_is_listed_after_its_work_counted_in_enough_recent_rounds_and_forgotten_when_caught() -> None:
    ledger = WorkLedger()
    for _ in range(WORK_MIN_ROUNDS - 1):
        ledger.count({"me": 1.0, "a": 1.0, "b": 1.0}, me="me")
    assert ledger.listed() == []  # not yet: a key buys its first try as an owner with these rounds
    ledger.count({"me": 1.0, "a": 1.0, "b": 1.0, "zero": 0.0}, me="me")
    assert ledger.listed() == ["a", "b"]  # never itself, never the weightless key
    ledger.forget("a")
    assert ledger.listed() == ["b"] and ledger.listed(without={"b"}) == []
    # b away: its rounds fall out of the window until fewer than WORK_MIN_ROUNDS are left.
    for _ in range(WORK_ROUNDS - WORK_MIN_ROUNDS + 1):
        ledger.count({"me": 1.0, "c": 1.0}, me="me")
    assert ledger.listed() == ["c"]


def test_work_credited_after_its_round_counts_as_if_counted_with_it_within_the_window() -> None:
    """`WorkLedger.credit` (record 079): a newcomer's work held back until its reveal came counts in
    the round it was done in: three rounds of it, each credited late (one after the next round was
    counted), list it as three counted with their rounds would; a credit of a round past the window,
    or of one not yet counted, counts nothing."""
    ledger = WorkLedger()
    rounds = [ledger.count({"me": 1.0, "a": 1.0, "new": 0.0}, me="me") for _ in range(2)]
    ledger.credit("new", rounds[1])
    ledger.credit("new", rounds[0])
    third = ledger.count({"me": 1.0, "a": 1.0, "new": 0.0}, me="me")
    assert "new" not in ledger.listed()
    ledger.credit("new", third)
    ledger.credit("new", third)  # twice is once
    assert ledger.listed() == ["a", "new"]
    late = WorkLedger()
    first = late.count({"me": 1.0, "a": 1.0}, me="me")
    last = [late.count({"me": 1.0, "a": 1.0}, me="me") for _ in range(WORK_ROUNDS)][-2:]
    for peer, past in (("old", first), ("ahead", last[-1] + 1)):  # out of the window, not yet counted
        for at in (*last, past):
            late.credit(peer, at)
    assert late.listed() == ["a"]


def test_a_fresh_swarm_s_founders_are_listed_after_its_first_round_and_a_later_key_is_not() -> None:
    """`WorkLedger.found` (record 077): the peers whose work counted in this peer's first round, a
    fresh swarm's, are listed at once; a key that came a round later waits the bar as any newcomer;
    a founder caught, or whose record ended, is a founder no more. Called after any later round, or
    while a founder's work was weightless, it lists nobody more."""
    ledger = WorkLedger()
    ledger.count({"me": 1.0, "a": 1.0, "b": 1.0, "mute": 0.0}, me="me")
    ledger.found()
    assert ledger.listed() == ["a", "b"]  # never itself, never the key whose work did not count
    ledger.count({"me": 1.0, "a": 1.0, "b": 1.0, "fresh": 1.0}, me="me")
    ledger.found()  # a second round: nobody is a founder from it
    assert ledger.listed() == ["a", "b"]
    ledger.forget("a")
    for _ in range(2):
        ledger.count({"me": 1.0, "a": 1.0, "b": 1.0, "fresh": 1.0}, me="me")
    assert ledger.listed() == ["b", "fresh"]  # fresh: its third round; a: its record began again
    for _ in range(WORK_ROUNDS):
        ledger.count({"me": 1.0, "a": 1.0, "fresh": 1.0}, me="me")
    ledger.count({"me": 1.0, "a": 1.0, "b": 1.0, "fresh": 1.0}, me="me")
    assert "b" not in ledger.listed()  # its record ended while it was away: it earns again


def test_each_late_owner_it_listed_makes_every_new_record_span_more_rounds_before_it_is_listed() -> None:
    """`WorkLedger.demote`: a staller that earned ownership (`WORK_MIN_ROUNDS`) and stalled buys its
    next stall, under its key or a fresh one, with `BAR_GROWTH` times more rounds of work; peers
    listed already stay listed; the bar falls back a step after `MAX_BAR` rounds without a stall."""
    ledger = WorkLedger()
    everyone = {"me": 1.0, "a": 1.0, "s": 1.0}
    for _ in range(WORK_MIN_ROUNDS):
        ledger.count(everyone, me="me")
    assert ledger.listed() == ["a", "s"]
    ledger.demote("never-listed")  # a fresh swarm's late owner: nothing to take, nothing raised
    assert ledger.bar == WORK_MIN_ROUNDS
    ledger.demote("s")
    assert ledger.bar == WORK_MIN_ROUNDS * BAR_GROWTH and ledger.listed() == ["a"]
    rounds = 0
    while True:
        ledger.count({**everyone, "fresh": 1.0}, me="me")  # s again, and a re-keyed staller
        rounds += 1
        if ledger.listed() != ["a"]:
            break
    assert rounds == WORK_MIN_ROUNDS * BAR_GROWTH and ledger.listed() == ["a", "fresh", "s"]
    ledger.demote("s")
    assert ledger.bar == min(MAX_BAR, WORK_MIN_ROUNDS * BAR_GROWTH**2)
    for _ in range(MAX_BAR - 1):
        ledger.count(everyone, me="me")
    assert ledger.bar == MAX_BAR
    ledger.count(everyone, me="me")
    assert ledger.bar == MAX_BAR // BAR_GROWTH
