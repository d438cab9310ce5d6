"""Evidence of a lie that travels with the ban: statements a peer signed that prove, to anyone who
holds them, that it lied; published in the DHT so that every node of the run leaves the liar out,
not only the members of the round that caught it.

Two kinds, each checked from the statements alone (`Evidence.check`: no round state is needed, so
a node that was in no group with the liar checks it as well as the round's members can):
- `EQUIVOCATED`: two statements of one kind (commitment, answer, reveal, projections), round, group
  and author (and, for answers, the same parts) whose bodies differ. Each is made once per round
  and sent alike to every peer (`statements`): two prove that the author told different peers
  different things;
- `DROPPED`: an owner's receipt of a member's parts and its answer statement of the same round and
  group that leaves the member out, or names another commitment of it (`dropped_after_receipt`).

Lies that take more than signatures to show (an answer that fails its projection, a payload unlike
its commitment) are not evidence that anyone else can check: they stay with the peers that saw
them, and travel only as votes (`matchmaking.outvoted`).

`EvidenceBoard` publishes this peer's evidence under f"{prefix}.evidence", subkey = its signing key
(a record naming no key is dropped, `identity.peer_of_subkey`), value = its newest `MAX_HELD` items,
each kept `ttl_s` after the conviction that produced it; and reads the board: each item it has not
seen is parsed within its bounds and checked, at most `MAX_CHECKS` per read in a random order of
the writers (so a flood of junk from many keys costs a few signature checks per read and cannot
keep real evidence out for long); a proven culprit is returned with why and who published it.
Nobody's word counts, so a writer needs no record of work, and a reader does not publish again
what it read (the DHT keeps the record until it expires).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time

from .identity import NodeDHT, peer_of_subkey
from .statements import (
    ANSWER,
    COMMIT,
    PROJECT,
    RECEIPT,
    REVEAL,
    AnswerStatement,
    BadStatement,
    KeyRing,
    Receipt,
    Signed,
    dropped_after_receipt,
)

logger = logging.getLogger(__name__)

EQUIVOCATED, DROPPED = "equivocated", "dropped"
MAX_EVIDENCE_BODY = 256 * 1024  # the most bytes of one statement's body in a piece of evidence
MAX_HELD = 4  # the most pieces of evidence one writer's record holds (its newest)
MAX_CHECKS = 16  # the most pieces of evidence checked per read of the board
MAX_SEEN = 4096  # pieces of evidence remembered as checked (their digests), oldest forgotten first
# The fields that name one statement of a kind, whose body must then be one: kind, round, group,
# author, and for an answer the parts it answers (an owner also answers a dead owner's parts).
_IDENTITY = {COMMIT: 4, REVEAL: 4, PROJECT: 4, ANSWER: 5}
_NAMES = {COMMIT: "commitments", REVEAL: "reveals", PROJECT: "projections", ANSWER: "answers"}
# Bounds of an answer statement checked outside its round (its body's size bounds it anyway).
_MOST_MEMBERS, _MOST_PARTS = 4096, 1 << 16


@dataclass(frozen=True)
class Evidence:
    """Two statements signed by one peer that prove a lie (see the module doc): `kind` is
    `EQUIVOCATED` with the statements' kind in `of`, or `DROPPED` (a receipt, then an answer)."""

    kind: str
    first: Signed
    second: Signed
    of: str = RECEIPT

    @classmethod
    def equivocated(cls, of: str, first: Signed, second: Signed) -> Evidence:
        """In the order of their digests: whoever holds the two, the same evidence."""
        first, second = sorted([first, second], key=lambda s: s.digest)
        return cls(EQUIVOCATED, first, second, of)

    @classmethod
    def dropped(cls, receipt: Signed, answer: Signed) -> Evidence:
        return cls(DROPPED, receipt, answer)

    def to_wire(self) -> list[Any]:
        return [self.kind, self.of, self.first.to_wire(), self.second.to_wire()]

    @classmethod
    def from_wire(cls, value: Any) -> Evidence:
        """The evidence `value` holds, within its bounds; BadStatement otherwise (not yet checked)."""
        if not isinstance(value, list) or len(value) != 4:
            raise BadStatement("evidence is a kind, a statement kind and two statements")
        kind, of = value[0], value[1]
        if not (kind == EQUIVOCATED and of in _IDENTITY) and not (kind == DROPPED and of == RECEIPT):
            raise BadStatement("evidence of an unknown kind")
        first = Signed.from_wire(value[2], max_body=MAX_EVIDENCE_BODY)
        second = Signed.from_wire(value[3], max_body=MAX_EVIDENCE_BODY)
        return cls(kind, first, second, of)

    @property
    def digest(self) -> bytes:
        parts = [self.kind.encode(), self.of.encode(), self.first.digest, self.second.digest]
        return hashlib.sha256(b"\0".join(parts)).digest()

    @property
    def size(self) -> int:
        return self.first.size + self.second.size

    def check(self, keys: KeyRing) -> tuple[str, str]:
        """The peer these statements convict and why; BadStatement if they prove nothing."""
        if self.kind == EQUIVOCATED:
            a, b = keys.open(self.first, self.of), keys.open(self.second, self.of)
            n = _IDENTITY[self.of]
            if a[:n] != b[:n] or self.first.body == self.second.body:
                raise BadStatement("not two different statements of one author, round and group")
            return str(a[3]), f"signed two different {_NAMES[self.of]} in round {a[1]}"
        fields = keys.open(self.first, RECEIPT)
        if len(fields) != 6 or type(fields[1]) is not int or not isinstance(fields[2], bytes):
            raise BadStatement("a malformed receipt")
        receipt = Receipt.parse(self.first, keys, round=fields[1], group_id=fields[2])
        answer = AnswerStatement.parse(
            self.second, keys, round=fields[1], group_id=fields[2], members=_MOST_MEMBERS, parts=_MOST_PARTS
        )
        if not dropped_after_receipt(receipt, answer):
            raise BadStatement("the statements do not show the owner dropping the member")
        why = f"dropped {receipt.member[-8:]}'s parts after signing their receipt in round {fields[1]}"
        return receipt.owner, why


@dataclass(frozen=True)
class Convicted:
    """A peer a piece of evidence on the board convicts, why, and the peer that published it."""

    peer: str
    why: str
    published_by: str


class EvidenceBoard:
    """This peer's side of the run's evidence board (module doc); runs on the averager's loop."""

    def __init__(self, dht: NodeDHT, *, prefix: str, ttl_s: float) -> None:
        self.dht = dht
        self.key = f"{prefix}.evidence"
        self.ttl_s = ttl_s
        self._keys = KeyRing()
        self._held: list[tuple[float, Evidence]] = []  # (published at, DHT time), newest last
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    async def publish(self, evidence: Sequence[Evidence]) -> None:
        """Add `evidence` to this peer's record (the newest `MAX_HELD` within `ttl_s`) and store it."""
        now = float(get_dht_time())
        held = [(t, e) for t, e in self._held if now - t < self.ttl_s]
        digests = {e.digest for _, e in held}
        for item in evidence:
            if item.size > 2 * MAX_EVIDENCE_BODY:
                logger.debug("evidence of %d bytes is too large to publish", item.size)
            elif item.digest not in digests:
                held.append((now, item))
                digests.add(item.digest)
                self._remember(item.digest)
        self._held = held[-MAX_HELD:]
        if not self._held:
            return
        try:
            await self.dht.store(
                self.key,
                [e.to_wire() for _, e in self._held],
                expiration_time=self._held[-1][0] + self.ttl_s,
                subkey=self.dht.identity.subkey,
                return_future=True,
            )
        except Exception as e:  # the DHT process failed the call: the round's members have it anyway
            logger.warning("publishing evidence failed: %r", e)

    async def read(self) -> list[Convicted]:
        """The peers convicted by evidence on the board that this peer has not checked before."""
        found = await self.dht.get(self.key, latest=True, return_future=True)
        value = None if found is None else found.value
        if not isinstance(value, dict):
            return []
        records = list(value.items())
        random.shuffle(records)
        convicted: list[Convicted] = []
        checks = 0
        for subkey, item in records:
            writer = peer_of_subkey(subkey)
            record = getattr(item, "value", None)
            if writer is None or not isinstance(record, list) or len(record) > MAX_HELD:
                continue
            for wire in record:
                if checks >= MAX_CHECKS:
                    return convicted
                try:
                    evidence = Evidence.from_wire(wire)
                except BadStatement:  # type checks only: cheap
                    continue
                if evidence.digest in self._seen:
                    continue
                checks += 1
                self._remember(evidence.digest)
                try:
                    peer, why = evidence.check(self._keys)
                except BadStatement as e:
                    logger.debug("evidence published by %s proves nothing: %s", writer[-8:], e)
                    continue
                convicted.append(Convicted(peer, why, writer))
        return convicted

    def _remember(self, digest: bytes) -> None:
        self._seen[digest] = None
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
