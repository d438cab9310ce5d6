"""Forming one round's group through the DHT, with no leader and a bounded wait.

`Matchmaker.matchmake(round)` stores a readiness record under the DHT key f"{prefix}.round{r}",
subkey = this peer's signing key (`identity.NodeDHT`: the key its peer id derives from), value =
(registration time, peer id, expectation, patience, exclusions, workers) in DHT time, expiring after
`record_ttl_s`. A record naming another peer than its key's is ignored: no one registers in another
peer's name (a registrant is a peer that holds its key and is then expected to serve its parts, as
any member). It reads the key back: the round opens at the `OPEN_QUORUM`-th earliest registration
seen (the earliest of all while fewer have registered) and closes `window_s` later, at T, or, when
its first registration is patient (see below), no sooner than that registration's patience after it;
a peer registered after T is late and gets None at once. At T + `grace_s` the peer reads the key
again and recomputes T from this read: a quorum reached since moves T later, and the peer waits
again (at most once per registration short of the quorum); then the group is the peers registered at
a time <= T that most of the others do not ask to leave out (`outvoted`: read on this last read only,
as every member reads it; a registrant that gave up on its first read, where it saw one hostile vote
and little else, refused the round the others counted it in), sorted by peer id; its owners are
the members the others' work lists make eligible (`trust.eligible_owners`), in an order drawn from
hash(prefix, r, members, tensor layout); group_id = hash of that and the owners. A registration
that no other followed within window (or its patience) + grace closed a round of its own (its
registrant found itself alone at its read, a node cut off from the others, say) and is no member of
a later group at that round. Peers whose reads agree
compute the same group without talking; clocks are assumed synchronized to well within `grace_s`
(hivemind's DHT time is the wall clock).

A registration's time is its writer's word. Opened by the earliest registration alone, a round
could be closed before anyone else registered by one record dated in the past, every round (the
honest peers would all be late); opened by the quorum's, it takes `OPEN_QUORUM` such identities;
and once some registrants worked together (`trust.core` of their work lists), only theirs open,
time and close the round (`openers`): the others join it, whatever date their records claim.
The price: a round closes one window after its second registration instead of its first, so its
first registrant waits at most two windows and two graces (`matchmaking_bound_s`), after the
patience of the round's first registration.

Patience: a registrant that completed its last round with others expects them again (the group's
owners and the chasers that shared rounds with it: `HivemindAverager._expected_again`; less those it
now leaves out, and those it saw leave a round since: `departed`), and registers with a patience
(its own last local round, at least `dht.DHT_STALL_S`, at most `MAX_PATIENCE_S`): a round it opens
stays open that long for them, unless the group it expects is complete sooner (the early close
below). The floor is for the DHT: a peer whose store or read waited on an unresponsive peer (one
frozen) registers up to that much later than the others, or is seen that much later, and with local
rounds shorter than that, each closed a round alone (a fork; record 056). Peers whose local rounds
drift apart (under overlap nothing pulls them back into step; the fastest one finishes up to a local
round before the slowest) then still meet, where a window of a few seconds let the fastest open a
round alone and the others another: a fork. The round waits the lower median of the patience of the
registrations dated within its first one's wait: one key claiming the most patience (60 s) held
every round it opened open that long; now the honest registrations outvote it (a key claiming none
can still cut an honest first registrant's wait short, at worst a fork the majority heals).
A peer's first registration (it has completed no round yet) has the same patience, group or not,
when its caller asks for any (a node passes its local round; the averager's own default keeps the
window): nodes started together end their first local round seconds apart, and with a window shorter than
that each of three averaged the first round alone, three lineages no majority heals (record 066).
Where that first try formed a group and failed (a hostile member), the node's retry expects that group,
less whom the failure left out, and closes once they are in rather than waiting the patience again.

A late contribution matchmakes with `join_only`: it registers at once, marked join-only, and waits
(at most `join_wait_s`) for another peer to open the round; it never opens one itself.

Early close: each registration says which group its registrant expects (the last it completed a
round with, and the former partners that registered for that round after its close: a peer one
round behind, catching up); when the first registrations are exactly that group, all expecting it,
the round closes at the last of them rather than a window later, with the join-only registrants
already there as members (`close_and_members`; a registration that still expects a peer most
registrants leave out, made before the evidence reached its writer, expects the same group). An
expected peer's join-only registration counts as its arrival; an expected peer whose registration is
dated before the round could have it is not waited for.

A member whose try failed after its group formed says so under f"{prefix}.round{r}.failed"
(`mark_failed`, bound to its key like a registration, naming the members it saw leave); once every
member of the group it read has, or has registered for the next try, or was seen to leave by one
that said so (`all_left`), no call of that try is running anywhere it could complete, and the next
try may open at once instead of after the longest a call may take. A member that never says so and
that nobody saw leave (frozen, or hostile) only leaves the wait at that bound, as before. A
registrant that came after the close reads the same board, and the next try's registrations, for the
group that formed without it (`left_try`): once at most one of its members is still in it, that try
cannot complete a shared round, and the late one retries with the others instead of waiting out the
bound.

Over 500 lines, one idea: the group rule and the `Matchmaker` that reads the DHT for it; the pure
rule (`close_and_members`, `form_group`, `outvoted`, the parsing of records) is the larger half,
tested on its own, and this docstring is its one account.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from ..algorithms.trust import MAX_WORKERS, core, eligible_owners, owner_order
from .admission import Admission
from .averager import NotOpened
from .dht import DHT_STALL_S
from .evidence import Evidence
from .identity import NodeDHT, peer_of_subkey

logger = logging.getLogger(__name__)

# This peer's own registration, as `_registrations` adds it: time, expectation, patience,
# exclusions, workers.
Mine = tuple[float, str, float, tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Group:
    """The members of one round as this peer sees them; peers with equal group_id agree on all of it."""

    round: int
    members: tuple[str, ...]
    group_id: bytes
    owners: tuple[str, ...]  # the members that may own parts, in the order parts are dealt


class RoundFailed(Exception):
    """This member cannot return a result for the round (the reason is logged). `blamed`: the peers
    whose failure it was, where this member saw whom (an owner whose stream broke), for the
    withdrawal it sends the round's other members (`verify_streams.WITHDRAW`)."""

    def __init__(self, message: str = "", *, blamed: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.blamed = tuple(blamed)


class Caught(RoundFailed):
    """The round failed because of what peers did: `culprits` maps each to why. `proven`: this
    member holds statements they signed that show it (`statements`); otherwise it is this member's
    own observation (a silence, an answer that failed its check), which it alone can vouch for.
    `silent`: the culprits sent no other owner their parts (every member sees the same answers).
    `gone`: the culprits left the round after the answers (unreachable, or withdrawn): a node that
    died, whose restart under its key must not find itself left out.
    `late`: owners that had not answered long after most others had (`round_exchange`): one with
    a record owns nothing until it has earned again (`trust.WorkLedger.demote`) and is not left out
    (an honest owner slow this once still contributes); one without is left out as seen, or as a
    departure when it completed a round with this member before (`conduct`).
    `unanswered`: owners that took this member's parts and gave no answer, late or for the whole
    budget; one without a record that completed a round with this member is taken for a death.
    `refused`: an unanswered owner that refused our request or gave a refusal for an answer (signed
    by nothing: from an honest owner a race) in a group of two, where this member's vote alone
    leaves it out; one without a record is then taken for a departure (not left out the first time
    within `owner.BAN_S`, then as a silence), whoever it is."""

    def __init__(
        self,
        message: str,
        culprits: dict[str, str],
        *,
        proven: bool,
        silent: bool = False,
        gone: bool = False,
        late: bool = False,
        unanswered: bool = False,
        refused: bool = False,
    ) -> None:
        super().__init__(message)
        self.culprits = culprits
        self.proven = proven
        self.silent = silent
        self.gone = gone
        self.late = late
        self.unanswered = unanswered
        self.refused = refused
        # The culprits' own signed statements that prove it to any other peer (`evidence.Evidence`):
        # passed on to the group (`verification`) and published to the run (`evidence.EvidenceBoard`).
        self.evidence: list[Evidence] = []


OPEN_QUORUM = 2  # registrations that open a round (see the module docstring)
# The longest a registration may keep the round it opens open (its patience); a record claiming more
# is ignored. Every peer's bound on matchmaking includes it: a first registrant may claim it.
MAX_PATIENCE_S = 60.0
EXPECTATION_CHARS = 32  # `expectation`'s hex digest
# The most registrations dated before the round whose every set is tried as the expected group's
# absent part (`close_and_members`): 2^4 sets of digests per registration, at most, on every read.
MOST_EARLY_TRIED = 4
JOIN_PREFIX = "join:"
MAX_EXPECT_CHARS = 48
MAX_PEER_CHARS = 64
JOIN_POLL_S = 0.05  # how often a join-only registrant looks whether a round has opened


def matchmaking_bound_s(window_s: float, grace_s: float, patience_s: float = MAX_PATIENCE_S) -> float:
    """The longest a registrant that is not late waits for its group: a registration it sees at its
    read one window and the grace after its own moves the close one window (and a read) further,
    once per registration short of the quorum; and the round's first registration may keep it
    open for its patience (at most `patience_s`) first."""
    return OPEN_QUORUM * (window_s + grace_s) + patience_s


def expectation(members: Collection[str]) -> str:
    """What a registration says of the group its registrant expects: a digest of its members."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:EXPECTATION_CHARS]


def joining(until: float) -> str:
    """The expectation field of a join-only registration: it waits for a round until `until`."""
    return f"{JOIN_PREFIX}{until:.3f}"


def join_deadline(expect: str) -> float | None:
    """When a join-only registration gives up waiting (None: not a join-only registration)."""
    if not expect.startswith(JOIN_PREFIX):
        return None
    try:
        until = float(expect[len(JOIN_PREFIX) :])
    except ValueError:
        return None
    return until if math.isfinite(until) else None


def close_and_members(
    records: Mapping[str, float],
    window_s: float,
    grace_s: float,
    quorum: int = OPEN_QUORUM,
    expects: Mapping[str, str] | None = None,
    patience: Mapping[str, float] | None = None,
    openers: Collection[str] | None = None,
    outvoted: Collection[str] = (),
) -> tuple[float, tuple[str, ...]]:
    """Close time T = the `quorum`-th earliest registration (the latest, while fewer) + window, or
    the round's first registration + its patience if that is later, and the peers registered from
    the round's first registration to T, sorted. (-inf, ()) when no round is open: only join-only
    registrations, which never open one.

    `openers` (default: every registrant): the registrants whose registrations open, time and
    close the round (the rules below); the others are members when they registered between a
    window and a grace before its first registration and its close. Given the registrants that
    worked together (`trust.core`), keys with no record cannot date records in the past to close
    rounds before the honest peers register, nor claim patience, nor keep an early close waiting.

    A registration that no other followed within its wait (window or patience, the larger) + grace
    closed a round of its own: its registrant read the key at that time, found itself alone and went
    on alone (a node cut off from the others, say, whose record the DHT hands out once its link is
    back). It is not the first of a later group, so the round starts at the first registration that
    another followed in time.

    `patience` (per registrant, seconds, default 0): how long a round that registration opens stays
    open at least (see the module docstring); the round takes the lower median of the patience of
    the registrations dated within its first one's wait, so that no single registrant sets it.

    `expects` (per registrant: "", an `expectation`, or `joining(until)`):
    - join-only registrations (late contributions) never open a round, take no part in the rules
      above, and are members of the round if it opened before their registrant gave up waiting
      (`until`) and they came before its close;
    - early close: when the round's first registrations, in time order, all expect one group and
      are exactly its members (at least `quorum` of them), the round closes at the last of them,
      as soon as the group it expected is complete, instead of a window later (hivemind closes a
      group once it is full). Another opener registering in between keeps the window (and the
      patience); a registrant that is no opener (a key without a record, once some registrants
      worked together) and expects another group is a member if it came by the early close, and
      neither holds nor breaks it (a fresh key each round, registered among the openers, held
      every round open for the patience); join-only registrants that registered
      by then are members of the round it closes, and do not hold it open (one key registering
      join-only every round held every round a window longer).
    - an expected peer whose registration is dated before the earliest a member's may be (an
      opener's: the round's start, so passed over above as a round of its own, or earlier still;
      another's: a window and a grace before it) is not coming: the group counts as complete
      without it.
      An honest peer dated so early found itself alone and went on; a key that dates its records
      back held every round that expected it open for the patience (issue 25 §2), and, in the
      round after, it was then welcome only join-only. Whatever such a registration expects, its
      registrant is not coming (`MOST_EARLY_TRIED`).
    - `outvoted`: the peers most registrants leave out (`outvoted`; not in `records`). An opener
      expecting the group with them (it registered before the evidence against them reached it)
      expects the same group as one expecting it without them: for one round after each
      conviction, the honest registrants' expectations differed by the peer some of them had just
      convicted, and the round waited out the patience (stop 53's owner-omit, record 072).
    """
    if not records:
        raise ValueError("no registrations")
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    expects = expects or {}
    patience = patience or {}
    deadlines = {p: join_deadline(expects.get(p, "")) for p in records}
    opening = set(records) if openers is None else set(openers)
    ordered = sorted(
        ((p, t) for p, t in records.items() if deadlines[p] is None and p in opening),
        key=lambda item: (item[1], item[0]),
    )
    if not ordered:
        return -math.inf, ()

    def waits(peer: str) -> float:  # how long a registration that opens a round waits for company
        return max(window_s, patience.get(peer, 0.0))

    first = 0
    while (
        first + 1 < len(ordered)
        and ordered[first + 1][1] - ordered[first][1] > waits(ordered[first][0]) + grace_s
    ):
        first += 1
    ordered = ordered[first:]
    start = ordered[0][1]
    # How long the round waits: the lower median of the patience of the registrations that can be in
    # it (dated within its first registration's wait), not the first one's alone: one key that claims
    # the most patience held every round it opened open that long.
    horizon = start + waits(ordered[0][0])
    held = statistics.median_low(patience.get(p, 0.0) for p, t in ordered if t <= horizon)
    close = max(ordered[min(quorum, len(ordered)) - 1][1] + window_s, start + held)
    waiting = {p for p, until in deadlines.items() if until is not None and start <= until}
    expected = expects.get(ordered[0][0], "")
    out = frozenset(outvoted)
    # The early close looks at every registration that can be a member (a newcomer registering in
    # between keeps the window), but only an opener's starts the round: another registrant's may
    # come a little before it, and it is still one of the group the round expects.
    earliest = {p: start if p in opening else start - window_s - grace_s for p in records}
    since = sorted(
        ((p, t) for p, t in records.items() if deadlines[p] is None and t >= earliest[p]),
        key=lambda item: (item[1], item[0]),
    )
    # Registrations dated before any member's can be: not coming (a peer of the group that went on
    # alone, or a key that dates its records back, opener or not). A digest names the group, so
    # which of them it expects is found by trying: those expecting this round's group all together,
    # and, while they are few, every set of them, whatever they expect. A backdater expecting
    # another group than the rest held the round after the one it was in open for the patience
    # (stop 53); more than a few of them keep the patience.
    early = sorted(p for p, t in records.items() if deadlines[p] is None and t < earliest[p])
    gones = [{p for p in early if expects.get(p, "") == expected}]
    if len(early) <= MOST_EARLY_TRIED:
        gones += [set(c) for n in range(len(early) + 1) for c in itertools.combinations(early, n)]
    # The openers in time order, with the join-only registrations among them: a join-only
    # registrant the group expects (a member one round behind, catching up) completes it when it
    # registers, as an opener does.
    events = sorted([*since, *((p, records[p]) for p in waiting)], key=lambda item: (item[1], item[0]))
    openers_in: list[str] = []
    for peer, t in events:
        if not expected or t > close:
            break
        if peer not in waiting:
            if expects.get(peer, "") != expected and peer not in opening:
                # A key that opens nothing (no record with the openers), expecting another group:
                # a member if it came by then, and it neither holds nor breaks the early close.
                continue
            # An opener expecting another group than the first may still expect one of the sets
            # tried below (the same group with outvoted peers, or without an opener that came); one
            # that expects none of them keeps the window (and the patience) from then on. Broken off
            # at it, the round waited the patience for the member an owner had dropped by proof,
            # which counts itself among the group it expects and the others did not yet list it as
            # an owner (record 076).
            openers_in.append(peer)
        if len(openers_in) < quorum:
            continue
        joined = {p for p in waiting if records[p] <= t}
        came = {*openers_in, *joined}
        seen_as = [seen | gone for gone in gones for seen in (came, set(openers_in))]
        # An opener the group does not expect, expecting the group all the same (a member that
        # joined the last round late, none of its owners: caught up, it came on time) is a member
        # and neither holds nor breaks the early close. Every set tried lies within those that came
        # and those not coming, so no expected peer is left behind. The victim of a founder's
        # owner-omit, back in step, held its first round with the others open for the patience.
        seen_as += [(came - {p}) | gone for p in openers_in for gone in (gones[0], set())]
        digests = {expectation(seen) for seen in seen_as}
        with_out = digests | {expectation(seen | out) for seen in seen_as} if out else digests
        if all(expects.get(p, "") in with_out for p in openers_in):
            strays = {p for p, at in since if p not in opening and at <= t}
            return t, tuple(sorted(came | strays))
    members = [p for p, t in ordered if t <= close] + [p for p in waiting if records[p] <= close]
    members += [
        p
        for p, t in records.items()
        if p not in opening and deadlines[p] is None and start - window_s - grace_s <= t <= close
    ]
    return close, tuple(sorted(members))


def layout_of(payloads: Mapping[str, bytes]) -> bytes:
    """Digest of the tensor names, their order and payload sizes: part ownership depends on them."""
    spec = [[key, len(payload)] for key, payload in payloads.items()]
    return hashlib.sha256(MSGPackSerializer.dumps(spec)).digest()[:16]


def group_id_of(prefix: str, round: int, members: Sequence[str], layout: bytes) -> bytes:
    """Identifier of a group: equal on two peers iff they agree on run, round, members and layout."""
    return hashlib.sha256(MSGPackSerializer.dumps([prefix, round, list(members), layout])).digest()[:16]


def form_group(
    prefix: str, round: int, members: Sequence[str], layout: bytes, lists: Mapping[str, Collection[str]]
) -> Group:
    """The group of `members` with the owners their work `lists` make eligible (`trust`), dealt
    parts in an order no key chooses; its id covers members, layout and owners."""
    seed = group_id_of(prefix, round, members, layout)
    owners = owner_order(seed, eligible_owners(members, lists, seed=seed))
    group_id = hashlib.sha256(seed + MSGPackSerializer.dumps(list(owners))).digest()[:16]
    return Group(round, tuple(members), group_id, owners)


def parse_failures(value: Any) -> dict[str, frozenset[str]]:
    """The peers that said their try failed, each with the members it saw leave that try (at most
    `MAX_EXCLUDED`), from a DHT dictionary value; an entry naming another peer than the one whose
    key signed it, or malformed, is ignored."""
    if not isinstance(value, dict):
        return {}
    found = {}
    for subkey, item in value.items():
        record = getattr(item, "value", None)
        if (
            isinstance(record, (list, tuple))
            and len(record) == 2
            and isinstance(record[0], str)
            and record[0] == peer_of_subkey(subkey)
            and _peers(record[1], MAX_EXCLUDED)
        ):
            found[record[0]] = frozenset(record[1])
    return found


MAX_EXCLUDED = 16
"""The most peers one registration may ask the others to leave out (`outvoted`)."""


def outvoted(
    excludes: Mapping[str, Collection[str]], lists: Mapping[str, Collection[str]] | None = None
) -> set[str]:
    """The registrants that more than half of the voters other than them ask to leave out: peers
    whose lies or silences most of the others caught (`verification`). The voters are the
    registrants that worked together (`trust.core` of their work `lists`), or all of them while
    none did: one registrant cannot remove anyone, and keys that did no work cannot remove a peer
    that did, however many they are (keys that worked together and outnumber the others can: the
    limit `trust` states)."""
    registrants = set(excludes)
    voters = core(registrants, lists or {}) or registrants
    out = set()
    for peer in registrants:
        others = voters - {peer}
        votes = sum(1 for other in others if peer in excludes[other])
        if others and 2 * votes > len(others):
            out.add(peer)
    return out


@dataclass
class Registrations:
    """What the registrations of one round say, per registrant: time, expectation, patience, the
    peers it asks the others to leave out, and those whose work it took lately (`trust`)."""

    times: dict[str, float]
    expects: dict[str, str]
    patience: dict[str, float]
    excludes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    workers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def close_and_members(
        self, window_s: float, grace_s: float, *, keep: str | None = None
    ) -> tuple[float, tuple[str, ...]]:
        """`close_and_members` over the registrants the others did not outvote (`outvoted`), and
        `keep` whatever the votes say (a registrant timing its own wait: `Matchmaker.matchmake`)."""
        out = self.outvoted() - {keep}
        times = {p: t for p, t in self.times.items() if p not in out}
        if not times:
            return -math.inf, ()
        # Once some registrants worked together, only they open and time the round (of those whose
        # registrations can open one: a join-only registration never does).
        openable = [p for p in times if join_deadline(self.expects.get(p, "")) is None]
        worked = core(openable, {p: self.workers.get(p, ()) for p in openable})
        return close_and_members(
            times,
            window_s,
            grace_s,
            expects=self.expects,
            patience=self.patience,
            openers=worked or None,
            outvoted=out,
        )

    def outvoted(self) -> set[str]:
        lists = {p: self.workers.get(p, ()) for p in self.times}
        return outvoted({p: self.excludes.get(p, ()) for p in self.times}, lists)

    def dated_by(self, latest: float, admitted: Collection[str]) -> Registrations:
        """The registrations of `admitted` peers dated `latest` at the latest."""
        kept = [p for p, t in self.times.items() if p in admitted and t <= latest]
        return Registrations(
            {p: self.times[p] for p in kept},
            {p: self.expects[p] for p in kept},
            {p: self.patience[p] for p in kept},
            {p: self.excludes.get(p, ()) for p in kept},
            {p: self.workers.get(p, ()) for p in kept},
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _peers(value: Any, most: int) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) <= most
        and all(isinstance(p, str) and len(p) <= MAX_PEER_CHARS for p in value)
    )


def parse_registrations(value: Any) -> Registrations:
    """The registrations in a DHT dictionary value; malformed entries (a patience outside
    [0, MAX_PATIENCE_S], more than MAX_EXCLUDED exclusions or MAX_WORKERS workers too), and entries
    naming another peer than the one whose key signed them, are ignored."""
    found = Registrations({}, {}, {})
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        record = getattr(item, "value", None)
        if (
            isinstance(record, (list, tuple))
            and len(record) == 6
            and _number(record[0])
            and isinstance(record[1], str)
            and record[1] == peer_of_subkey(subkey)
            and isinstance(record[2], str)
            and len(record[2]) <= MAX_EXPECT_CHARS
            and _number(record[3])
            and 0 <= record[3] <= MAX_PATIENCE_S
            and _peers(record[4], MAX_EXCLUDED)
            and _peers(record[5], MAX_WORKERS)
        ):
            found.times[record[1]] = float(record[0])
            found.expects[record[1]] = record[2]
            found.patience[record[1]] = float(record[3])
            found.excludes[record[1]] = tuple(record[4])
            found.workers[record[1]] = tuple(record[5])
    return found


class Matchmaker:
    """One peer's side of matchmaking on a DHT (see the module docstring); runs on the averager's loop.

    `on_stage(stage, round)` is the fault-injection hook, called at "registered" (record stored).
    """

    def __init__(
        self,
        dht: NodeDHT,
        *,
        peer_id: str,
        prefix: str,
        window_s: float,
        grace_s: float,
        record_ttl_s: float,
        on_stage: Callable[[str, int], None] | None = None,
        log: Callable[..., None],
        admission: Admission | None = None,
        excluded: Callable[[], Collection[str]] = tuple,
        workers: Callable[[], Sequence[str]] = tuple,
    ) -> None:
        self._admission = admission or Admission()
        # The peers this one asks the others to leave out (`outvoted`): those it caught; and those
        # whose work it took lately, most recent first (`trust.eligible_owners`).
        self.excluded, self.workers = excluded, workers
        if peer_id != dht.identity.peer_id:
            raise ValueError(f"peer id {peer_id} is not the DHT identity's {dht.identity.peer_id}")
        self.dht, self.peer_id, self.prefix = dht, peer_id, prefix
        self.window_s, self.grace_s, self.record_ttl_s = window_s, grace_s, record_ttl_s
        self._on_stage = on_stage
        self._log = log
        # The members of the last group this peer completed a round with: its registrations expect
        # them again (`close_and_members`'s early close). Before the first, the group its first try
        # formed, should that try fail (`HivemindAverager`); None until a group forms.
        self.expected: tuple[str, ...] | None = None

    def departed(self, peers: Iterable[str]) -> None:
        """`peers` left a round this peer was in (no stream to them opened, or theirs broke): its
        next registrations no longer expect them, so that its round closes once the others are in
        rather than after the patience (a member killed mid-round held every survivor's next round
        open that long; issue 26). One that comes back is expected again once it completes a
        round with this peer."""
        gone = set(peers)
        if self.expected is not None and gone:
            self.expected = tuple(p for p in self.expected if p not in gone)

    async def matchmake(
        self,
        round: int,
        layout: bytes,
        *,
        join_only: bool = False,
        join_wait_s: float | None = None,
        patience_s: float = 0.0,
    ) -> Group | None:
        """This peer's group for `round`, or None when it came too late; RoundFailed on DHT errors;
        `NotOpened` when `join_only` waited `join_wait_s` and no other peer had registered.
        `patience_s`: how long a round this registration opens stays open for the group this peer
        expects (at least `DHT_STALL_S`, at most `MAX_PATIENCE_S`); it applies only while that
        group is more than this peer, or, when it is > 0, to this peer's first registration (see
        the module docstring)."""
        key = f"{self.prefix}.round{round}"
        until = math.inf
        patience = 0.0
        leaves_out = self.excluded()
        if join_only:
            # Registered at once, marked join-only: it opens no round, and while it waits no round
            # closes early without it (`close_and_members`).
            until = float(get_dht_time()) + (self.record_ttl_s if join_wait_s is None else join_wait_s)
            expect = joining(until)
        else:
            # The group it completed its last round with, less the peers it now leaves out: they
            # will not come, and the others that caught them expect the same group (early close).
            expected = None if self.expected is None else [p for p in self.expected if p not in leaves_out]
            expect = "" if expected is None else expectation(expected)
            if (expected is not None and len(expected) > 1) or (expected is None and patience_s > 0):
                # At least a DHT stall: a peer of the group that a stall held back (its store, or
                # a read, waited on an unresponsive peer) registers that much later than the
                # others, and two rounds alone would fork. A peer's first registration waits as
                # long, group or not, when its caller asks for patience (a node does): nodes
                # started together end their first local round seconds apart (one's start was
                # slower), and a window shorter than that let each average the first round alone,
                # three lineages that no majority heals (record 066).
                patience = min(MAX_PATIENCE_S, max(DHT_STALL_S, patience_s))
        excluded = tuple(sorted(leaves_out)[:MAX_EXCLUDED])
        workers = tuple(self.workers())[:MAX_WORKERS]
        registered = await self._register(key, round, expect, patience, excluded, workers)
        mine = (registered, expect, patience, excluded, workers)
        # Whether the others leave this peer out is read once, on the records they decide on (at the
        # close and its grace); until then it times its wait as a member. A read just after it
        # registered may see few of the round's registrations, one key's vote a majority of them (a
        # record dated back is seen first): an honest peer that gave up on such a read refused the
        # others' requests as in no group, and they left it out (record 071).
        me = self.peer_id
        while True:
            records = await self._registrations(key, mine)
            close, members = records.close_and_members(self.window_s, self.grace_s, keep=me)
            if close > -math.inf and registered > close:
                self._log(
                    round, "late: the round closed %.2f s before this peer registered", registered - close
                )
                return None
            if self.peer_id in members:
                break
            # (Not join-only) a registration after a round it could have been in.
            if not join_only:
                self._in_no_group(round, records)
                return None
            # Join-only, and no round open yet: wait for a fresh peer to open one, until `until`
            # and the grace after it (a registration dated before `until` may show up that late).
            if get_dht_time() > until + self.grace_s:
                raise NotOpened(f"round {round}: no peer opened it within {join_wait_s or 0:.1f} s")
            await asyncio.sleep(JOIN_POLL_S)
        self._log(
            round,
            "registered at %.2f (patience %.1f s); %d registrations seen, earliest %.2f s before it",
            registered,
            patience,
            len(records.times),
            registered - min(records.times.values()),
        )
        while True:
            # Until the close and the grace after it, read again now and then: the group this peer
            # expects may be complete sooner (the early close), and the round then closes there.
            while (left := close + self.grace_s - get_dht_time()) > 0:
                if left <= self.poll_s:
                    await asyncio.sleep(left)
                    break
                await asyncio.sleep(self.poll_s)
                records = await self._registrations(key, mine, until=close + self.grace_s)
                early, _ = records.close_and_members(self.window_s, self.grace_s, keep=me)
                close = min(close, early)
            # A registration after close + grace is none of this round's (it is late, or it opens a
            # round of its own after this one closed), even if the read comes late enough to see it.
            records = await self._registrations(key, mine, until=close + self.grace_s)
            reread, _ = records.close_and_members(self.window_s, self.grace_s, keep=me)
            _, members = records.close_and_members(self.window_s, self.grace_s)
            if reread <= close:
                break
            # The quorum was reached after our last read: the round closes one window after it.
            self._log(round, "the round now closes %.2f s later", reread - close, level=logging.DEBUG)
            close = reread
        if self.peer_id not in members:  # (registered first, the others may have come and voted)
            self._in_no_group(round, records)
            return None
        self._log(
            round,
            "closed %.2f s after this registration, on the records (peer, s from it, expects, patience): %s",
            close - registered,
            [
                (
                    p[-8:],
                    f"{t - registered:+.2f}",
                    records.expects.get(p, "")[:8],
                    records.patience.get(p, 0.0),
                )
                for p, t in sorted(records.times.items(), key=lambda item: item[1])
            ],
            level=logging.DEBUG,
        )
        return form_group(self.prefix, round, members, layout, records.workers)

    def _in_no_group(self, round: int, records: Registrations) -> None:
        """Say why this registrant is in no group of `round`: most of the others caught it, or an
        earlier registration closed the round before its own."""
        if self.peer_id in records.outvoted():
            self._log(round, "left out: most of the others caught this peer", level=logging.WARNING)
        else:
            self._log(round, "late: an earlier registration closed the round before this peer's")

    async def round_view(self, round: int) -> tuple[frozenset[str], tuple[str, ...]]:
        """Who has registered for `round` so far, and the group those registrations make: a
        registrant that averaged it alone asks whether the others formed a round without it
        (`RoundLoop._went_on_without_us`); RoundFailed on DHT errors."""
        key = f"{self.prefix}.round{round}"
        records = await self._read(key)
        _, members = records.close_and_members(self.window_s, self.grace_s)
        return frozenset(records.times), members

    async def chasers(self, round: int, members: Collection[str]) -> set[str]:
        """The join-only registrants of `round` outside its group `members`: peers that came after
        the close, one round behind and catching up (RoundFailed on DHT errors)."""
        records = await self._read(f"{self.prefix}.round{round}")
        return {p for p, e in records.expects.items() if p not in members and join_deadline(e) is not None}

    def mark_failed(self, round: int, left: Collection[str] = ()) -> None:
        """Say that this peer's try at `round` failed after its group formed (see the module docstring),
        naming the members it saw leave that try (`left`, at most `MAX_EXCLUDED`): an owner whose
        stream broke, a member no stream reached. Returns once the store is under way, not once it
        landed: the live replicas have it in a round trip, but an unresponsive one (a frozen member)
        holds the store for two DHT RPC timeouts, one in the search for the replicas and one in the
        store (6 s measured; asking hivemind for the first replica's answer only does not shorten it),
        and a member that waited registered its next try seconds after the others, who had each closed
        that try alone. A DHT error is logged, not raised: the others then wait out the bound."""
        now = float(get_dht_time())
        try:
            stored = self.dht.store(
                f"{self.prefix}.round{round}.failed",
                [self.peer_id, sorted(left)[:MAX_EXCLUDED]],
                expiration_time=now + self.record_ttl_s,
                subkey=self.dht.identity.subkey,
                return_future=True,
            )
        except Exception as e:
            self._log(round, "could not say the try failed: %r", e, level=logging.DEBUG)
            return

        def landed(future: Any) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                self._log(round, "could not say the try failed: %r", error, level=logging.DEBUG)

        stored.add_done_callback(landed)

    async def left_try(self, round: int) -> tuple[tuple[str, ...], set[str]]:
        """The group the registrations of try `round` make, and those of its members that have left
        it: said their try failed (`mark_failed`), or registered for the next try (`round + 1`, the
        caller's numbering of one round's tries). For a registrant that came late to that group;
        RoundFailed on DHT errors."""
        (_, members), (failures, later) = await asyncio.gather(self.round_view(round), self._leavers(round))
        return members, (set(failures) | later) & set(members)

    async def all_left(self, round: int, members: Sequence[str]) -> bool:
        """Whether every one of `members` has left its try at `round`: said that the try failed
        there (`mark_failed`), or registered for the next try (a peer makes one call at a time, and
        a peer restarted from its checkpoint is in no call of its former life), or one of `members`
        that said so saw it leave. A dead owner never says; the members whose streams to it broke
        do, and a member that read the dead owner's answer before the others' exchanges failed then
        stops waiting for it when it reads them, not at the averaging timeout (110 s, while the
        restarted peer and the other survivor each averaged alone: a fork in CI's run of issue 26).
        A member that names others falsely only ends this wait early: the next try opens sooner,
        at worst a fork the majority heals. RoundFailed on DHT errors."""
        failures, later = await self._leavers(round)
        seen_leave = {p for member in members for p in failures.get(member, ())}
        return set(members) - seen_leave <= set(failures) | later

    async def _leavers(self, round: int) -> tuple[dict[str, frozenset[str]], set[str]]:
        """The failure marks of try `round`, and the registrants of the next try (read at once)."""
        failures, later = await asyncio.gather(
            self._failures(round), self._read(f"{self.prefix}.round{round + 1}")
        )
        return failures, set(later.times)

    async def _failures(self, round: int) -> dict[str, frozenset[str]]:
        """The peers that said their try at `round` failed (`mark_failed`), each with the members it
        saw leave; RoundFailed on DHT errors."""
        try:
            found = await self.dht.get(f"{self.prefix}.round{round}.failed", latest=True, return_future=True)
        except Exception as e:
            raise RoundFailed(f"reading the failures failed: {e!r}") from e
        return parse_failures(None if found is None else found.value)

    @property
    def poll_s(self) -> float:
        """How often a registrant reads the registrations again while it waits for the close."""
        return min(0.5, max(0.05, self.window_s / 8))

    async def _register(
        self,
        key: str,
        round: int,
        expect: str,
        patience: float,
        excluded: tuple[str, ...],
        workers: tuple[str, ...],
    ) -> float:
        registered = float(get_dht_time())
        try:
            stored = await self.dht.store(
                key,
                (registered, self.peer_id, expect, patience, list(excluded), list(workers)),
                expiration_time=registered + self.record_ttl_s,
                subkey=self.dht.identity.subkey,
                return_future=True,
            )
        except Exception as e:  # the DHT process failed the call; this round cannot be joined
            raise RoundFailed(f"storing the readiness record failed: {e!r}") from e
        if not stored:
            # hivemind returns the answer of the last replica to reply, and a replica refuses a record
            # it already holds with the same expiration; we saw False in ~1 of 20 test rounds with the
            # record stored. So False does not mean "not stored": the reads decide, and a record that
            # nobody sees only makes the group ids differ (a safe failure).
            self._log(round, "the DHT reported the readiness record as not stored", level=logging.DEBUG)
        if self._on_stage is not None:
            self._on_stage("registered", round)
        return registered

    async def _registrations(self, key: str, mine: Mine, *, until: float | None = None) -> Registrations:
        """The registrations dated `until` at the latest, with this peer's `mine` (time,
        expectation, patience, exclusions, workers) among them."""
        records = await self._read(key, until=until)
        # Our own record may not be visible yet; we know it exists.
        me = self.peer_id
        records.times[me], records.expects[me], records.patience[me] = mine[:3]
        records.excludes[me], records.workers[me] = mine[3:]
        return records

    async def _read(self, key: str, *, until: float | None = None) -> Registrations:
        try:
            found = await self.dht.get(key, latest=True, return_future=True)
        except Exception as e:
            raise RoundFailed(f"reading the registrations failed: {e!r}") from e
        records = parse_registrations(None if found is None else found.value)
        # A registration dated after now (beyond the clock skew allowed for) is no registration yet.
        latest = float(get_dht_time()) + self.grace_s
        if until is not None:
            latest = min(latest, until)
        admitted = await self._admission.select_async(records.times)
        return records.dated_by(latest, admitted)
