"""Trust earned by work: whose contribution counted, and who may own parts.

A member's *work* in a round is the weight it committed to (`statements.Commitment`: tokens × its
staleness weight) when the owners averaged at least one of its parts, 0 when they left all of them
out (screening, scoring) or it committed to no weight. Work, not a key, is what earns a peer a say:

- `earners`: the members of a round whose work counts: positive, and at least 1/`WORK_FLOOR` of
  the group's median work, so a key that averages at weight 0 (or 10^-9 of everyone else's) earns
  nothing from its company. A node vouches for the swarm's head only with the peers whose work it
  took lately (`node/swarm/sync.py`), and lists in its records those whose work counted in
  `WORK_MIN_ROUNDS` of its last `WORK_ROUNDS` rounds (`WorkLedger`).
- `eligible_owners`: the members of a group that may own parts, from those lists: a set of
  *voters* (members whose list names a fellow member) each listed by more than half of the others
  in it, found by setting aside the least listed one at a time. Nobody lists a fresh key: it
  contributes (screened, checked like any other) and owns nothing, so a key made to stall or lie
  as an owner must first do accepted work, and loses it when caught. A group in which nobody is
  eligible (a fresh swarm, or peers that never averaged together) is owned by every member, as
  before. Known limit: keys that list one another and outnumber the peers that worked together in
  a group are eligible there; they are verified like any owner (`verify`), so what they can do is
  cost tries.

- `seeders`: whose secrets a round's seed of directions is drawn from (`verification`): its owners
  when at least two own parts, else every member. A key that has done no work takes the answers
  and then withholds its reveal at no cost to the round: nobody waits for its secret.

- `core` also decides whose word counts when the registrants of a round ask one another to leave
  peers out (`matchmaking.outvoted`): once some of them worked together, only they vote, so keys
  that did no work cannot leave out a peer that did, however many they are.

Every member of a group computes the same owners from the same registrations; the group id covers
them (`matchmaking.form_group`), so a member that read other lists is in another group, never one
where two members disagree on who owns what.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
from collections.abc import Collection, Mapping, Sequence

WORK_FLOOR = 20
"""A member earns trust from a round only with at least 1/WORK_FLOOR of the group's median work."""
WORK_ROUNDS = 8
"""The rounds a peer's work list looks back over (its own completed rounds)."""
WORK_MIN_ROUNDS = 3
"""A peer is listed once its work counted in this many of those rounds: a key made to stall or lie
as an owner buys each try with that much accepted work first."""
BAR_GROWTH = 4
"""Each owner a peer demotes (`WorkLedger.demote`: it was late with its answer) multiplies the
rounds of work this peer asks of a record before it lists it by this much, up to `MAX_BAR`: a key
made to stall, fresh or not, buys each stall with more rounds of honest work than the last."""
MAX_BAR = 48
"""The most rounds of work `WorkLedger` asks of a record, and the rounds without a demotion after
which its bar falls back one step."""
MAX_WORKERS = 32
"""The most peers one record (a readiness or a state record) may list as workers."""
GRACE_S = 1.0
"""How long, at least, a round's owners wait for what the other members send once the owners' own
is in (their reveals, projections: as long again as the owners' took, and never less than this;
their parts: from once more than half of the owners' parts are in, twice as long again, `owner`).
What the others send only adds to the round; waiting out a deadline for it would let a key with no
record hold every round it joins, and a key that owns parts make an honest owner late."""


def accepted_work(weights: Mapping[str, float], rejected: Mapping[str, int], parts: int) -> dict[str, float]:
    """Each member's work (see the module doc): its weight, or 0 when all its `parts` were left out."""
    return {m: (w if rejected.get(m, 0) < parts and w > 0 else 0.0) for m, w in weights.items()}


def earners(work: Mapping[str, float]) -> list[str]:
    """The members whose work counts (see the module doc), in `work`'s order."""
    positive = [w for w in work.values() if w > 0]
    if not positive:
        return []
    floor = statistics.median([*work.values()]) / WORK_FLOOR
    return [m for m, w in work.items() if w > 0 and w >= floor]


def core(members: Collection[str], lists: Mapping[str, Collection[str]], *, seed: bytes = b"") -> set[str]:
    """The members that worked together (see the module doc), or none.

    The voters are the members whose list names a fellow member. While some voter is listed by no
    more than half of the other voters, the one listed least is set aside (ties: the last in
    `owner_order(seed)`, which no key chooses) and the rest count again: what remains is listed by
    more than half of the rest. Keys that list only one another drop out first while they are
    fewer than the peers that worked together, however their votes would have diluted the others'
    (a plain majority of all voters let two such keys leave three honest peers short of one)."""
    fellows = set(members)
    named = {m: (set(lists.get(m, ())) & fellows) - {m} for m in fellows}
    kept = {m for m in fellows if named[m]}
    rank = {p: i for i, p in enumerate(owner_order(seed, kept))}
    votes = {m: sum(1 for v in kept if m in named[v]) for m in kept}
    while kept:
        weakest = min(kept, key=lambda m: (votes[m], -rank[m]))
        if 2 * votes[weakest] > len(kept) - 1:
            break
        kept.discard(weakest)
        for m in named[weakest] & kept:  # its votes no longer count
            votes[m] -= 1
    return kept


def eligible_owners(
    members: Sequence[str], lists: Mapping[str, Collection[str]], *, seed: bytes = b""
) -> tuple[str, ...]:
    """The members that may own parts (see the module doc), in `members`' order: the `core`, or
    every member when it is empty."""
    kept = core(members, lists, seed=seed)
    return tuple(m for m in members if m in kept) if kept else tuple(members)


def grace_s(took: float) -> float:
    """How long to wait for the other members once the owners' part of a phase is in, after it
    took `took` seconds (`GRACE_S`)."""
    return max(GRACE_S, took)


def seeders(members: Sequence[str], owners: Collection[str]) -> list[str]:
    """The members whose secrets a round's seed needs (see the module doc), in `members`' order.

    A seed no owner can know before every answer is fixed needs one secret of a member that does
    not collude with the liar: an owner knows its own, so two owners at least. Keys that list one
    another and own a group's parts (the limit above) hold every secret of its seed, and so can fit
    a lie to its direction; what bounds their answers there is the norm each is checked against.

    A seeder late with its reveal is left out of the seed, which holds more than half of the
    seeders' secrets then (`verification`, record 077): a liar among them that waits for the others'
    reveals chooses between two seeds, by revealing or not, and pays for the choice with its key's
    standing (it is left out a while, demoted where it had a record)."""
    chosen = [m for m in members if m in owners]
    return chosen if len(chosen) >= 2 else list(members)


class WorkLedger:
    """Whose work one peer took in its last `WORK_ROUNDS` completed rounds (`earners` of each), and
    so whom its records list (`listed`). Thread-safe: the averager counts on its loop, the node
    lists from its training thread too.

    A record is a peer's unbroken run of work here: it begins at the first round its work counted
    and ends when none did in `WORK_ROUNDS` rounds, or when the peer is caught (`forget`) or was
    late as an owner (`demote`). A peer is listed once its record spans `bar` rounds as well:
    `WORK_MIN_ROUNDS` while no owner stalled, `BAR_GROWTH` times more after each one that did (up to
    `MAX_BAR`), one step back after `MAX_BAR` rounds without. A staller that re-keys starts a record
    as any newcomer does, so the rounds between its stalls grow with every stall; an honest newcomer
    waits as long to own parts, and contributes all the while. Peers listed already stay listed.

    A swarm's founders are the exception (`found`): in this peer's first round, where every member
    owned (nobody listed anyone: a fresh swarm), those whose work counted are listed from then on,
    for as long as their record lasts. Without it a fresh swarm listed nobody for `bar` rounds, and
    a key made after its first round owned parts and seeded like a founder until then (record 077:
    robust_swarm's mute+fresh cost its third round)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rounds = 0
        self._counted: dict[str, list[int]] = {}  # peer -> the rounds (this peer's count) it earned in
        self._since: dict[str, int] = {}  # peer -> the round its record began
        self._spanned: set[str] = set()  # peers whose record has spanned the bar in force
        self._founders: set[str] = set()  # listed from the first round, while their record lasts
        self.bar = WORK_MIN_ROUNDS  # the rounds a record spans before it is listed
        self._raised_at = 0  # the round the bar last moved

    def count(self, work: Mapping[str, float], *, me: str = "") -> int:
        """One more completed round, in which the members of `work` did that work; its number here
        (for `credit`)."""
        with self._lock:
            self._rounds += 1
            for peer in earners(work):
                if peer != me:
                    self._counted.setdefault(peer, []).append(self._rounds)
                    self._since.setdefault(peer, self._rounds)
            self._expire()
            return self._rounds

    def credit(self, peer: str, at: int) -> None:
        """`peer`'s work in round `at` (`count`'s number) counts after all: it was held back until
        its reveal came (`HivemindAverager`, record 079). No round older than `WORK_ROUNDS` counts."""
        with self._lock:
            if not self._rounds - WORK_ROUNDS < at <= self._rounds:
                return
            rounds = self._counted.setdefault(peer, [])
            if at not in rounds:
                rounds.append(at)
                rounds.sort()
            self._since[peer] = min(self._since.get(peer, at), at)
            if self._spans(peer):
                self._spanned.add(peer)

    def _expire(self) -> None:
        """End the records without work in the last `WORK_ROUNDS` rounds; move the bar (class doc)."""
        for peer, rounds in list(self._counted.items()):
            kept = [r for r in rounds if r > self._rounds - WORK_ROUNDS]
            if kept:
                self._counted[peer] = kept
            else:
                del self._counted[peer], self._since[peer]
                self._spanned.discard(peer)
                self._founders.discard(peer)
        if self.bar > WORK_MIN_ROUNDS and self._rounds - self._raised_at >= MAX_BAR:
            self.bar, self._raised_at = max(WORK_MIN_ROUNDS, self.bar // BAR_GROWTH), self._rounds
        self._spanned |= {p for p in self._since if self._spans(p)}

    def _spans(self, peer: str) -> bool:
        """`peer`'s record spans the bar: its first counted round is `bar` rounds back or more."""
        return self._rounds - self._since[peer] + 1 >= self.bar

    def found(self) -> None:
        """This peer's only round so far was a fresh swarm's (every member owned): the peers whose work
        counted in it are its founders (the class doc)."""
        with self._lock:
            if self._rounds == 1:
                self._founders = {p for p, since in self._since.items() if since == 1}

    def forget(self, peer: str) -> None:
        """`peer` was caught: its trust is earned again, by work after its exclusion."""
        with self._lock:
            self._counted.pop(peer, None)
            self._since.pop(peer, None)
            self._spanned.discard(peer)
            self._founders.discard(peer)

    def demote(self, peer: str) -> None:
        """`peer` was late with its answer as an owner: its record ends (`forget`) and, if it was
        listed, every record needs `BAR_GROWTH` times more rounds before it is listed (the class doc)."""
        listed = peer in self.listed()
        self.forget(peer)
        if listed:
            with self._lock:
                self.bar, self._raised_at = min(MAX_BAR, self.bar * BAR_GROWTH), self._rounds

    def listed(self, *, without: Collection[str] = ()) -> list[str]:
        """The peers whose work counted in at least `WORK_MIN_ROUNDS` of the last `WORK_ROUNDS`
        rounds and whose record spans `bar` rounds, and the founders whose record lasts (`found`),
        the most recent first (ties by id), less `without`."""
        with self._lock:
            last = {
                p: rounds[-1]
                for p, rounds in self._counted.items()
                if (len(rounds) >= WORK_MIN_ROUNDS and p in self._spanned) or p in self._founders
            }
        return sorted((p for p in last if p not in without), key=lambda p: (-last[p], p))


def owner_order(seed: bytes, owners: Collection[str]) -> tuple[str, ...]:
    """`owners` in the order parts are dealt to them (`parts.assign_parts`: the first gets the
    largest): by a hash of the group's seed and the peer id, so no key can grind an id that owns the
    largest tensor in every group (sorted ids gave the lowest id the largest tensor every round)."""
    return tuple(sorted(owners, key=lambda p: hashlib.sha256(seed + p.encode()).digest()))
