"""Forming one round's group through the DHT, with no leader and a bounded wait.

`Matchmaker.matchmake(round)` stores a readiness record under the DHT key f"{prefix}.round{r}",
subkey = this peer's signing key (`identity.NodeDHT`: the key its peer id derives from), value =
(registration time, peer id) in DHT time, expiring after `record_ttl_s`. A record naming another
peer than its key's is ignored: no one registers in another peer's name (a registrant is a peer
that holds its key and is then expected to serve its parts, as any member). It reads the key back:
the round opens at the `OPEN_QUORUM`-th earliest registration seen (the earliest of all while fewer
have registered) and closes `window_s` later, at T; a peer registered after T is late and gets None
at once. At T + `grace_s` the peer reads the key again and recomputes T from this read: a quorum
reached since moves T later, and the peer waits again (at most once per registration short of the
quorum); then the group is the peers registered at a time <= T, sorted by peer id; group_id =
hash(prefix, r, members, tensor layout). A registration that no other followed within window + grace
closed a round of its own (its registrant found itself alone at its read, a node cut off from the
others, say) and is no member of a later group at that round. Peers whose reads agree compute the
same group without talking; clocks are assumed synchronized to well within `grace_s` (hivemind's
DHT time is the wall clock).

A registration's time is its writer's word. Opened by the earliest registration alone, a round
could be closed before anyone else registered by one record dated in the past, every round (the
honest peers would all be late); opened by the quorum's, it takes `OPEN_QUORUM` such identities.
The price: a round closes one window after its second registration instead of its first, so its
first registrant waits at most two windows and two graces (`matchmaking_bound_s`).

A late contribution matchmakes with `join_only`: it waits until another peer has registered (at most
`join_wait_s`) and never opens a round itself.

A member whose try failed after its group formed says so under f"{prefix}.round{r}.failed"
(`mark_failed`, bound to its key like a registration); once every member of the group it read has
(`all_failed`), no call of that try is running anywhere it could complete, and the next try may
open at once instead of after the longest a call may take. A member that never says so (dead, or
hostile) only leaves the wait at that bound, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from .admission import Admission
from .averager import NotOpened
from .identity import NodeDHT, peer_of_subkey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """The members of one round as this peer sees them; peers with equal group_id agree on all of it."""

    round: int
    members: tuple[str, ...]
    group_id: bytes


class RoundFailed(Exception):
    """This member cannot return a result for the round (the reason is logged)."""


OPEN_QUORUM = 2  # registrations that open a round (see the module docstring)


def matchmaking_bound_s(window_s: float, grace_s: float) -> float:
    """The longest a registrant that is not late waits for its group: a registration it sees at its
    read one window and the grace after its own moves the close one window (and a read) further,
    once per registration short of the quorum."""
    return OPEN_QUORUM * (window_s + grace_s)


def close_and_members(
    records: Mapping[str, float], window_s: float, grace_s: float, quorum: int = OPEN_QUORUM
) -> tuple[float, tuple[str, ...]]:
    """Close time T = the `quorum`-th earliest registration (the latest, while fewer) + window, and
    the peers registered from the round's first registration to T, sorted.

    A registration that no other followed within `window_s + grace_s` closed a round of its own: its
    registrant read the key at that time, found itself alone and went on alone (a node cut off from
    the others, say, whose record the DHT hands out once its link is back). It is not the first of
    a later group, so the round starts at the first registration that another followed in time.
    """
    if not records:
        raise ValueError("no registrations")
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    times = sorted(records.values())
    first = 0
    while first + 1 < len(times) and times[first + 1] - times[first] > window_s + grace_s:
        first += 1
    times = times[first:]
    close = times[min(quorum, len(times)) - 1] + window_s
    return close, tuple(sorted(peer for peer, t in records.items() if times[0] <= t <= close))


def layout_of(payloads: Mapping[str, bytes]) -> bytes:
    """Digest of the tensor names, their order and payload sizes: part ownership depends on them."""
    spec = [[key, len(payload)] for key, payload in payloads.items()]
    return hashlib.sha256(MSGPackSerializer.dumps(spec)).digest()[:16]


def group_id_of(prefix: str, round: int, members: Sequence[str], layout: bytes) -> bytes:
    """Identifier of a group: equal on two peers iff they agree on run, round, members and layout."""
    return hashlib.sha256(MSGPackSerializer.dumps([prefix, round, list(members), layout])).digest()[:16]


def parse_failures(value: Any) -> set[str]:
    """The peers that said their try failed, from a DHT dictionary value; an entry naming another
    peer than the one whose key signed it is ignored."""
    if not isinstance(value, dict):
        return set()
    return {
        record
        for subkey, item in value.items()
        if isinstance(record := getattr(item, "value", None), str) and record == peer_of_subkey(subkey)
    }


def parse_registrations(value: Any) -> dict[str, float]:
    """Registration time per peer from a DHT dictionary value; malformed entries, and entries naming
    another peer than the one whose key signed them, are ignored."""
    records: dict[str, float] = {}
    if not isinstance(value, dict):
        return records
    for subkey, item in value.items():
        record = getattr(item, "value", None)
        if (
            isinstance(record, (list, tuple))
            and len(record) == 2
            and isinstance(record[0], (int, float))
            and not isinstance(record[0], bool)
            and math.isfinite(record[0])
            and isinstance(record[1], str)
            and record[1] == peer_of_subkey(subkey)
        ):
            records[record[1]] = float(record[0])
    return records


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
    ) -> None:
        self._admission = admission or Admission()
        if peer_id != dht.identity.peer_id:
            raise ValueError(f"peer id {peer_id} is not the DHT identity's {dht.identity.peer_id}")
        self.dht, self.peer_id, self.prefix = dht, peer_id, prefix
        self.window_s, self.grace_s, self.record_ttl_s = window_s, grace_s, record_ttl_s
        self._on_stage = on_stage
        self._log = log

    async def matchmake(
        self, round: int, layout: bytes, *, join_only: bool = False, join_wait_s: float | None = None
    ) -> Group | None:
        """This peer's group for `round`, or None when it came too late; RoundFailed on DHT errors;
        `NotOpened` when `join_only` waited `join_wait_s` and no other peer had registered."""
        key = f"{self.prefix}.round{round}"
        if join_only:
            try:
                await asyncio.wait_for(self._await_opened(key), join_wait_s)
            except asyncio.TimeoutError:
                raise NotOpened(f"round {round}: no peer opened it within {join_wait_s:.1f} s") from None
        registered = await self._register(key, round)
        records = await self._registrations(key, registered)
        close, _ = close_and_members(records, self.window_s, self.grace_s)
        if registered > close:
            self._log(round, "late: the round closed %.2f s before this peer registered", registered - close)
            return None
        self._log(
            round,
            "registered at %.2f; %d registrations seen, earliest %.2f s before it",
            registered,
            len(records),
            registered - min(records.values()),
        )
        while True:
            await asyncio.sleep(max(0.0, close + self.grace_s - get_dht_time()))
            # A registration after close + grace is none of this round's (it is late, or it opens a
            # round of its own after this one closed), even if the read comes late enough to see it.
            records = {
                p: t
                for p, t in (await self._registrations(key, registered)).items()
                if t <= close + self.grace_s
            }
            reread, members = close_and_members(records, self.window_s, self.grace_s)
            if reread <= close:
                break
            # The quorum was reached after our last read: the round closes one window after it.
            self._log(round, "the round now closes %.2f s later", reread - close, level=logging.DEBUG)
            close = reread
        if self.peer_id not in members:
            self._log(round, "late: an earlier registration closed the round before this peer's")
            return None
        return Group(round, members, group_id_of(self.prefix, round, members, layout))

    async def mark_failed(self, round: int) -> None:
        """Say that this peer's try at `round` failed after its group formed (see the module
        docstring); a DHT error is logged, not raised: the others then wait out the bound."""
        now = float(get_dht_time())
        try:
            await self.dht.store(
                f"{self.prefix}.round{round}.failed",
                self.peer_id,
                expiration_time=now + self.record_ttl_s,
                subkey=self.dht.identity.subkey,
                return_future=True,
            )
        except Exception as e:
            self._log(round, "could not say the try failed: %r", e, level=logging.DEBUG)

    async def all_failed(self, round: int, members: Sequence[str]) -> bool:
        """Whether every one of `members` said its try at `round` failed."""
        try:
            found = await self.dht.get(f"{self.prefix}.round{round}.failed", latest=True, return_future=True)
        except Exception as e:
            raise RoundFailed(f"reading the failures failed: {e!r}") from e
        return set(members) <= parse_failures(None if found is None else found.value)

    async def _register(self, key: str, round: int) -> float:
        registered = float(get_dht_time())
        try:
            stored = await self.dht.store(
                key,
                (registered, self.peer_id),
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

    async def _await_opened(self, key: str) -> None:
        """Poll until another peer has opened the round: registering now would put this peer in a
        group with others (bounded by the caller's timeout). A round long closed is not open."""
        while True:
            records = await self._read(key)
            records[self.peer_id] = float(get_dht_time())
            _, members = close_and_members(records, self.window_s, self.grace_s)
            if self.peer_id in members and len(members) > 1:
                return
            # Poll fast: the joiner must register within the window that this registration opened.
            await asyncio.sleep(0.05)

    async def _registrations(self, key: str, registered: float) -> dict[str, float]:
        records = await self._read(key)
        # Our own record may not be visible yet; we know it exists.
        records.setdefault(self.peer_id, registered)
        return records

    async def _read(self, key: str) -> dict[str, float]:
        try:
            found = await self.dht.get(key, latest=True, return_future=True)
        except Exception as e:
            raise RoundFailed(f"reading the registrations failed: {e!r}") from e
        records = parse_registrations(None if found is None else found.value)
        # A registration dated after now (beyond the clock skew allowed for) is no registration yet.
        soonest = float(get_dht_time()) + self.grace_s
        admitted = await self._admission.select_async(records)
        return {peer: t for peer, t in records.items() if peer in admitted and t <= soonest}
