"""`swarm_head`: where the swarm is, from state records, and whose records a node believes."""

from __future__ import annotations

from collections.abc import Sequence

import pydantic.v1
import pytest

from adloco.node.swarm.sync import live_head, swarm_head
from adloco.protocol.algorithms.trust import MAX_WORKERS, earners
from adloco.protocol.transport.records import StateRecord

ME = "me"
GOOD, BAD, MINE = "a" * 64, "b" * 64, "c" * 64


def record(
    peer: str, round: int, theta: str, manifest: str = "d" * 64, workers: Sequence[str] = ()
) -> StateRecord:
    return StateRecord(
        peer_id=peer,
        round=round,
        theta_hash=theta,
        schedule="{}",
        manifest_hash=manifest,
        manifest_bytes=100,
        workers=list(workers),
    )


def test_the_unweighed_hint_is_the_latest_round_and_its_majority() -> None:
    """Without vouched peers `swarm_head` is the hint a node waits on (never acts on): the latest
    round any record claims and its majority hash, but no further than one round past where most
    of the other peers are (a far-ahead record ended a failed try's wait at once: the next try
    opened alone, a fork the swarm test caught)."""
    honest = [record("p1", 4, GOOD), record("p2", 4, GOOD)]
    hint = swarm_head([*honest, record("evil", 10**6, BAD)], ME)
    assert hint is not None and hint.round == 4
    # One peer a round ahead of the rest (it closed a round alone) does end the wait.
    hint = swarm_head([*honest, record("p3", 5, BAD)], ME)
    assert hint is not None and hint.round == 5
    head = swarm_head(
        [record("p1", 4, GOOD), record("p2", 4, GOOD), record("p3", 4, BAD), record(ME, 3, MINE)], ME
    )
    assert head is not None and (head.round, head.theta_hash, head.holders, head.quorum) == (
        4,
        GOOD,
        ["p1", "p2"],
        0,
    )


def test_a_record_from_a_peer_it_never_averaged_with_cannot_move_a_node() -> None:
    """The hijack of issue 10: one record claiming a far-ahead round. Not vouched: ignored."""
    records = [record("p1", 7, MINE), record("p2", 7, MINE), record("hijacker", 10**6, BAD)]
    head = swarm_head(records, ME, vouched={"p1", "p2"}, my_round=7)
    assert head is not None and (head.round, head.theta_hash) == (7, MINE)


def test_one_vouched_peer_ahead_alone_is_no_majority_but_a_majority_ahead_is_followed() -> None:
    """A peer that did average with this node, then claims a far-ahead round, is outvoted by the two
    others at this node's round; once both of them are at round 8 the node follows them there."""
    vouched = {"p1", "p2", "liar"}
    alone = [record("p1", 7, MINE), record("p2", 7, MINE), record("liar", 50, BAD)]
    head = swarm_head(alone, ME, vouched=vouched, my_round=7)
    assert head is not None and (head.round, head.theta_hash) == (7, MINE)
    ahead = [record("p1", 8, GOOD), record("p2", 8, GOOD), record("liar", 50, BAD)]
    head = swarm_head(ahead, ME, vouched=vouched, my_round=7)
    assert head is not None and (head.round, head.theta_hash, head.holders) == (8, GOOD, ["p1", "p2"])
    assert head.quorum == 2  # two of its donors must serve its manifest before it is acted on


def test_made_up_peers_cannot_outvote_a_node_on_its_own_round() -> None:
    """Fork healing counted identities: two made-up peers with another θ were a majority. Vouched,
    only the peers this node averaged with count."""
    records = [record("p1", 7, MINE), record("sybil1", 7, BAD), record("sybil2", 7, BAD)]
    head = swarm_head(records, ME, vouched={"p1"}, my_round=7)
    assert head is not None and head.theta_hash == MINE and head.hashes == {MINE: 1}


def test_records_naming_one_peer_twice_count_it_once() -> None:
    """Records are signed by any key, so several may name one peer: each hash counts peers, not
    records (the head's quorum check then asks the peers themselves)."""
    records = [record("p1", 8, BAD), record("p1", 8, BAD, manifest="e" * 64), record("p2", 8, GOOD)]
    records += [record("p3", 8, GOOD)]
    head = swarm_head(records, ME, vouched={"p1", "p2", "p3"}, my_round=7)
    assert head is not None and head.theta_hash == GOOD and head.hashes == {GOOD: 2, BAD: 1}


def test_no_majority_anywhere_means_no_head() -> None:
    records = [record("p1", 9, GOOD), record("p2", 8, BAD)]
    assert swarm_head(records, ME, vouched={"p1", "p2"}, my_round=8) is None


def test_when_no_vouched_peer_has_a_record_left_the_node_reads_everyone_again() -> None:
    """Peers it averaged with that have all left vouch for nothing: as a fresh node."""
    head = swarm_head([record("new1", 12, GOOD), record("new2", 12, GOOD)], ME, vouched={"gone"}, my_round=7)
    assert head is not None and (head.round, head.theta_hash, head.quorum) == (12, GOOD, 0)


def test_a_fresh_joiner_follows_the_majority_of_live_peers_not_the_furthest_claim() -> None:
    """`live_head`: the highest round more than half of the live peers reached, at the hash most of
    the peers at that round hold. A hijacker far ahead (alone, or with one honest peer left) does not
    move the joiner past the honest round; lagging honest peers still give a head."""
    honest = [record("p1", 6, GOOD), record("p2", 6, GOOD)]
    hijack = record("evil", 10**6, BAD, "e" * 64)
    for live in ([*honest, hijack], [honest[0], hijack], [record("p1", 5, MINE), honest[1], hijack]):
        head = live_head(live, ME)
        assert head is not None and (head.round, head.theta_hash) == (6, GOOD), live
        assert head.target is not None and "evil" not in head.target.donors
    # A liar at the honest round with another hash, and the honest peers a round apart: a tie, no head.
    assert live_head([record("p1", 5, MINE), honest[1], record("evil", 6, BAD)], ME) is None
    # Outvoted at the same round, it is not taken; alone, it is (nobody else is there to weigh).
    head = live_head([*honest, record("evil", 6, BAD)], ME)
    assert head is not None and head.theta_hash == GOOD
    alone = live_head([hijack, record(ME, 6, GOOD)], ME)
    assert alone is not None and alone.round == 10**6
    assert live_head([record(ME, 6, GOOD)], ME) is None


HONEST = ["p1", "p2", "p3"]
SYBILS = [f"sybil{i}" for i in range(5)]


def _swarm_and_sybils(*, sybils_list_each_other: bool) -> list[StateRecord]:
    """Three peers that worked together at round 9 (each lists the other two), and five keys that
    averaged with them at weight 0 (so nobody lists them) and now stand by a poisoned head at 9."""
    honest = [record(p, 9, GOOD, workers=[o for o in HONEST if o != p]) for p in HONEST]

    def listed(sybil: str) -> list[str]:
        return [o for o in SYBILS if o != sybil] if sybils_list_each_other else HONEST

    return honest + [record(s, 9, BAD, manifest="e" * 64, workers=listed(s)) for s in SYBILS]


def test_keys_that_averaged_at_weight_zero_move_neither_a_node_that_averaged_nor_a_joiner() -> None:
    """The issue's five keys: they averaged with the three at weight 0, then vouch for a poisoned
    head. A node of the three vouches only for the peers whose work counted, so their records are
    not read; a joiner weighs the live writers by the work lists, and nobody lists them (listing
    the honest peers makes them voters of no weight). By keys alone they were the majority."""
    records = _swarm_and_sybils(sybils_list_each_other=False)
    work = {p: 100.0 for p in HONEST} | {s: 0.0 for s in SYBILS}
    vouched = set(earners(work)) - {"p1"}
    head = swarm_head(records, "p1", vouched=vouched, my_round=9)
    assert head is not None and (head.theta_hash, head.holders) == (GOOD, ["p2", "p3"])
    head = live_head(records, ME)
    assert head is not None and (head.theta_hash, head.holders) == (GOOD, HONEST)
    by_keys = live_head([r.copy(update={"workers": []}) for r in records], ME)
    assert by_keys is not None and by_keys.theta_hash == BAD


def test_keys_that_list_one_another_are_beaten_by_an_anchor_and_only_by_one() -> None:
    """The limit `trust` states, pinned: five keys that list one another outnumber three peers that
    worked together, and a joiner with no anchor follows them. With one of the three as its anchor
    (`--trust-peers`, by default the ids in `--peers`) it counts the anchor and whom the anchor
    lists; an anchor that is not live changes nothing."""
    records = _swarm_and_sybils(sybils_list_each_other=True)
    head = live_head(records, ME)
    assert head is not None and head.theta_hash == BAD
    head = live_head(records, ME, anchors={"p1"})
    assert head is not None and (head.theta_hash, head.holders) == (GOOD, HONEST)
    head = live_head(records, ME, anchors={"gone"})
    assert head is not None and head.theta_hash == BAD


def test_a_state_record_lists_at_most_max_workers_peer_ids() -> None:
    record("p1", 1, GOOD, workers=[f"Qm{i:044d}" for i in range(MAX_WORKERS)])
    for workers in ([f"Qm{i:044d}" for i in range(MAX_WORKERS + 1)], ["x" * 65]):
        with pytest.raises(pydantic.v1.ValidationError):
            record("p1", 1, GOOD, workers=workers)
