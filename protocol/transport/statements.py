"""The signed statements of a round, and the evidence they make (protocol/algorithms/verify.py).

Four kinds, each a MSGPack list signed with its author's peer key (the RSA key its libp2p id derives
from, `identity.NodeDHT`), carried as (body, signature, public key) and bound to one group by its
round and group id (which covers the run, the members and the tensor layout), so no statement
counts in another round:

    commit  = kind, round, group, member, weight, tokens, payload digests, payload norms,
              report digest, secret digest                      (member -> each owner, in its request)
    answer  = kind, round, group, owner, part keys, answer digests, contributors, their commitment
              digests, rejections per part [[contributor index, code]], rule, outlier factor,
              work cap, digest of the relayed reports (empty: none), per part the CenteredClip
              radius and factors [τ, [[contributor index, ρ]]] ([] where nothing was clipped)
                                                                  (owner -> each member)
    reveal  = kind, round, group, member, every owner's signed answer, secret
                                                                 (member -> every member)
    project = kind, round, group, member, seed, one projection per part, the members' secrets,
              per part its payload's inner product with a CenteredClip answer (None elsewhere)
                                                                 (member -> every member)
    receipt = kind, round, group, owner, member, the digest of the member's commitment
                                                  (owner -> member, once its parts are in)

Digests and norms are listed in the layout's order of the parts (every member's, `layout_of`).
Every field is type-checked and bounded where a statement is parsed (`parse`): nothing a peer signs
is trusted beyond its signature. Two statements of one kind, round and group with different
contents from the same author prove that it told different peers different things
(`evidence.Evidence`); anyone holding both can check it.

Over 500 lines, one idea: what a peer may sign. The statement kinds, each with its make and parse,
share the bounds and field checks at the top; `Mailbox` keeps the ones a round receives.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from ..algorithms.parts import MISMATCH, SCORED, SCREENED, Clip
from .identity import Identity, peer_id_of

COMMIT, ANSWER, REVEAL, PROJECT, RECEIPT = (
    "adloco.commit.v1",
    "adloco.answer.v2",
    "adloco.reveal.v1",
    "adloco.project.v2",
    "adloco.receipt.v1",
)
DIGEST_BYTES = 32
MAX_KEY_BYTES = 1024  # an SSH-encoded RSA public key; larger keys are refused (as for DHT subkeys)
MAX_SIGNATURE_BYTES = 1024
MAX_PEER_CHARS = 64
MAX_PART_CHARS = 512
_CODES = (SCORED, MISMATCH, SCREENED)


class BadStatement(ValueError):
    """A statement that is malformed, unsigned by the peer it names, or of another round."""


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class Signed:
    """A signed statement as it travels: its body (MSGPack), the signature, the signer's public key."""

    body: bytes
    signature: bytes
    public_key: bytes

    def to_wire(self) -> list[bytes]:
        return [self.body, self.signature, self.public_key]

    @classmethod
    def from_wire(cls, value: Any, *, max_body: int) -> Signed:
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(isinstance(v, bytes) for v in value)
            or len(value[0]) > max_body
            or len(value[1]) > MAX_SIGNATURE_BYTES
            or len(value[2]) > MAX_KEY_BYTES
        ):
            raise BadStatement("not a signed statement within its bounds")
        return cls(value[0], value[1], value[2])

    @property
    def digest(self) -> bytes:
        """What other statements name this one by: the digest of its body."""
        return digest(self.body)

    @property
    def size(self) -> int:
        """Its bytes on the wire (the framing's few bytes aside)."""
        return len(self.body) + len(self.signature) + len(self.public_key)


class Signer:
    """Signs statements with this peer's key."""

    def __init__(self, identity: Identity) -> None:
        self.peer_id = identity.peer_id
        self._key = identity.key
        self._public = identity.key.get_public_key().to_bytes()

    def sign(self, fields: Sequence[Any]) -> Signed:
        body = MSGPackSerializer.dumps(list(fields))
        # hivemind's keys sign in base64; the wire carries the raw 256 bytes.
        return Signed(body, base64.b64decode(self._key.sign(body)), self._public)


class KeyRing:
    """Checks that a statement is signed by the peer it names (public keys cached by their bytes)."""

    def __init__(self) -> None:
        self._peers: dict[bytes, tuple[str, RSAPublicKey]] = {}

    def open(self, signed: Signed, kind: str, author: str | None = None) -> list[Any]:
        """The fields of `signed` if it is a `kind` statement whose signature is valid and whose
        named author (its fourth field) holds the signing key (and is `author` when given)."""
        entry = self._peers.get(signed.public_key)
        if entry is None:
            try:
                key = RSAPublicKey.from_bytes(signed.public_key)
            except Exception:  # not an SSH RSA key
                raise BadStatement("the statement's key is not an RSA public key") from None
            entry = (peer_id_of(key._public_key), key)
            if len(self._peers) < 4096:
                self._peers[signed.public_key] = entry
        peer, key = entry
        if not key.verify(signed.body, base64.b64encode(signed.signature)):
            raise BadStatement("bad signature")
        try:
            fields = MSGPackSerializer.loads(signed.body)
        except Exception:
            raise BadStatement("the statement's body does not parse") from None
        if not isinstance(fields, list) or len(fields) < 4 or fields[0] != kind:
            raise BadStatement(f"not a {kind} statement")
        if fields[3] != peer or (author is not None and peer != author):
            raise BadStatement(f"a {kind} statement signed by another peer than it names")
        return fields


def _int(value: Any) -> int:
    if type(value) is not int:
        raise BadStatement("expected an integer")
    return value


def _float(value: Any, *, finite: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadStatement("expected a number")
    if finite and not math.isfinite(value):
        raise BadStatement("expected a finite number")
    return float(value)


def _digests(value: Any, count: int) -> list[bytes]:
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in value)
    ):
        raise BadStatement(f"expected {count} digests")
    return value


def _strings(value: Any, limit: int, chars: int) -> list[str]:
    if not isinstance(value, list) or len(value) > limit:
        raise BadStatement(f"expected at most {limit} strings")
    if not all(isinstance(v, str) and len(v) <= chars for v in value):
        raise BadStatement("expected strings")
    return value


def _bound(round: int, group_id: bytes, fields: list[Any]) -> None:
    if fields[1] != round or fields[2] != group_id:
        raise BadStatement("a statement of another round or group")


@dataclass(frozen=True)
class Commitment:
    """A member's commitment to its contribution (see the module doc)."""

    signed: Signed
    peer: str
    weight: float
    tokens: float
    digests: list[bytes]
    norms: list[float]
    report: bytes
    secret: bytes

    @classmethod
    def make(
        cls,
        signer: Signer,
        *,
        round: int,
        group_id: bytes,
        weight: float,
        tokens: float,
        digests: Sequence[bytes],
        norms: Sequence[float],
        report: bytes,
        secret: bytes,
    ) -> Commitment:
        fields = [COMMIT, round, group_id, signer.peer_id, weight, tokens, list(digests), list(norms)]
        fields += [digest(report), digest(secret)]
        return cls(
            signer.sign(fields),
            signer.peer_id,
            weight,
            tokens,
            list(digests),
            list(norms),
            digest(report),
            digest(secret),
        )

    @classmethod
    def parse(cls, signed: Signed, keys: KeyRing, *, round: int, group_id: bytes, parts: int) -> Commitment:
        """The commitment `signed` holds, for a layout of `parts` parts; BadStatement otherwise."""
        fields = keys.open(signed, COMMIT)
        if len(fields) != 10:
            raise BadStatement("a commitment has 10 fields")
        _bound(round, group_id, fields)
        norms = fields[7]
        if not isinstance(norms, list) or len(norms) != parts:
            raise BadStatement(f"expected {parts} norms")
        return cls(
            signed,
            fields[3],
            _float(fields[4]),
            _float(fields[5]),
            _digests(fields[6], parts),
            [_float(n) for n in norms],
            _digests([fields[8]], 1)[0],
            _digests([fields[9]], 1)[0],
        )


@dataclass(frozen=True)
class AnswerStatement:
    """An owner's statement of its answer (see the module doc). `codes[k]`: contributor index ->
    why the owner left its payload of part k out; `clips[k]`: what a CenteredClip answer of part k
    states (`parts.Clip`), None where the rule did not clip."""

    signed: Signed
    owner: str
    keys: list[str]
    digests: list[bytes]
    contributors: list[str]
    commitments: list[bytes]
    codes: list[dict[int, str]]
    rule: str
    outlier_factor: float | None
    work_cap: float | None
    reports: bytes
    clips: list[Clip | None] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        signer: Signer,
        *,
        round: int,
        group_id: bytes,
        keys: Sequence[str],
        payloads: Sequence[bytes],
        contributors: Sequence[str],
        commitments: Sequence[bytes],
        codes: Sequence[dict[int, str]],
        rule: str,
        outlier_factor: float | None,
        work_cap: float | None,
        reports: bytes,
        clips: Sequence[Clip | None] = (),
    ) -> AnswerStatement:
        digests = [digest(p) for p in payloads]
        wire_codes = [sorted([i, c] for i, c in part.items()) for part in codes]
        clips = list(clips) or [None] * len(keys)
        wire_clips = [[] if c is None else [c.tau, sorted([i, r] for i, r in c.rhos.items())] for c in clips]
        fields = [ANSWER, round, group_id, signer.peer_id, list(keys), digests, list(contributors)]
        fields += [list(commitments), wire_codes, rule, outlier_factor, work_cap, reports, wire_clips]
        return cls(
            signer.sign(fields),
            signer.peer_id,
            list(keys),
            digests,
            list(contributors),
            list(commitments),
            [dict(part) for part in codes],
            rule,
            outlier_factor,
            work_cap,
            reports,
            clips,
        )

    @classmethod
    def parse(
        cls, signed: Signed, keys: KeyRing, *, round: int, group_id: bytes, members: int, parts: int
    ) -> AnswerStatement:
        """The answer statement `signed` holds, in a group of `members` and a layout of `parts`
        parts; BadStatement otherwise."""
        fields = keys.open(signed, ANSWER)
        if len(fields) != 14:
            raise BadStatement("an answer statement has 14 fields")
        _bound(round, group_id, fields)
        names = _strings(fields[4], parts, MAX_PART_CHARS)
        contributors = _strings(fields[6], members, MAX_PEER_CHARS)
        if contributors != sorted(set(contributors)):
            raise BadStatement("contributors must be sorted and distinct")
        codes = fields[8]
        if not isinstance(codes, list) or len(codes) != len(names):
            raise BadStatement("one list of rejections per part")
        parsed: list[dict[int, str]] = []
        for part in codes:
            if not isinstance(part, list) or len(part) > len(contributors):
                raise BadStatement("rejections beyond the contributors")
            entries: dict[int, str] = {}
            for entry in part:
                if (
                    not isinstance(entry, list)
                    or len(entry) != 2
                    or type(entry[0]) is not int
                    or not 0 <= entry[0] < len(contributors)
                    or entry[1] not in _CODES
                    or entry[0] in entries
                ):
                    raise BadStatement("a malformed rejection")
                entries[entry[0]] = entry[1]
            parsed.append(entries)
        if not isinstance(fields[9], str) or len(fields[9]) > 64:
            raise BadStatement("a malformed rule")
        factor = None if fields[10] is None else _float(fields[10], finite=True)
        cap = None if fields[11] is None else _float(fields[11], finite=True)
        reports = fields[12]
        if not isinstance(reports, bytes) or len(reports) not in (0, DIGEST_BYTES):
            raise BadStatement("a malformed digest of the reports")
        clips = fields[13]
        if not isinstance(clips, list) or len(clips) != len(names):
            raise BadStatement("one clip statement per part")
        return cls(
            signed,
            fields[3],
            names,
            _digests(fields[5], len(names)),
            contributors,
            _digests(fields[7], len(contributors)),
            parsed,
            fields[9],
            factor,
            cap,
            reports,
            [_clip(c, len(contributors)) for c in clips],
        )


def _clip(value: Any, contributors: int) -> Clip | None:
    """One part's clip statement: [] (none), or [τ ≥ 0, [[index, ρ in (0, 1]], ...]] with distinct
    indices of the contributors."""
    if value == []:
        return None
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], list):
        raise BadStatement("a malformed clip statement")
    tau = _float(value[0], finite=True)
    if tau < 0 or len(value[1]) > contributors:
        raise BadStatement("a malformed clip statement")
    rhos: dict[int, float] = {}
    for entry in value[1]:
        if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int:
            raise BadStatement("a malformed clip factor")
        i, rho = entry[0], _float(entry[1], finite=True)
        if not 0 <= i < contributors or i in rhos or not 0 < rho <= 1:
            raise BadStatement("a malformed clip factor")
        rhos[i] = rho
    return Clip(tau, rhos)


@dataclass(frozen=True)
class Reveal:
    """A member's reveal: the answers it holds and its secret."""

    signed: Signed
    peer: str
    answers: list[Signed]
    secret: bytes

    @classmethod
    def make(
        cls, signer: Signer, *, round: int, group_id: bytes, answers: Sequence[Signed], secret: bytes
    ) -> Reveal:
        fields = [REVEAL, round, group_id, signer.peer_id, [a.to_wire() for a in answers], secret]
        return cls(signer.sign(fields), signer.peer_id, list(answers), secret)

    @classmethod
    def parse(
        cls, signed: Signed, keys: KeyRing, *, round: int, group_id: bytes, owners: int, max_answer: int
    ) -> Reveal:
        fields = keys.open(signed, REVEAL)
        if len(fields) != 6:
            raise BadStatement("a reveal has 6 fields")
        _bound(round, group_id, fields)
        answers = fields[4]
        if not isinstance(answers, list) or len(answers) > owners:
            raise BadStatement(f"at most {owners} answers")
        secret = fields[5]
        if not isinstance(secret, bytes) or len(secret) != DIGEST_BYTES:
            raise BadStatement("a secret is 32 bytes")
        return cls(signed, fields[3], [Signed.from_wire(a, max_body=max_answer) for a in answers], secret)


@dataclass(frozen=True)
class Projections:
    """A member's projections of its own payloads on the round's directions, and the secrets the
    seed was drawn from (passed on: a member that missed a reveal takes the secret from here, its
    hash being in the revealer's commitment), and the inner products <x, a> of its payloads with the
    CenteredClip answers they went into (`dots`; None for the other parts), which the members check
    the clip factors with (`verify.check_clip`)."""

    signed: Signed
    peer: str
    seed: bytes
    values: list[float]
    secrets: list[tuple[str, bytes]] = field(default_factory=list)
    dots: list[float | None] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        signer: Signer,
        *,
        round: int,
        group_id: bytes,
        seed: bytes,
        values: Sequence[float],
        secrets: Sequence[Sequence[Any]] = (),
        dots: Sequence[float | None] = (),
    ) -> Projections:
        dots = list(dots) or [None] * len(values)
        fields = [
            PROJECT,
            round,
            group_id,
            signer.peer_id,
            seed,
            list(values),
            [list(s) for s in secrets],
            dots,
        ]
        pairs = [(str(peer), bytes(value)) for peer, value in secrets]
        return cls(signer.sign(fields), signer.peer_id, seed, list(values), pairs, dots)

    @classmethod
    def parse(
        cls, signed: Signed, keys: KeyRing, *, round: int, group_id: bytes, parts: int, members: int
    ) -> Projections:
        fields = keys.open(signed, PROJECT)
        if len(fields) != 8:
            raise BadStatement("a projection statement has 8 fields")
        _bound(round, group_id, fields)
        values, secrets, dots = fields[5], fields[6], fields[7]
        if not isinstance(values, list) or len(values) != parts:
            raise BadStatement(f"expected {parts} projections")
        if not isinstance(dots, list) or len(dots) != parts:
            raise BadStatement(f"expected {parts} inner products")
        if not isinstance(secrets, list) or len(secrets) > members:
            raise BadStatement(f"at most {members} secrets")
        pairs = []
        for pair in secrets:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or not isinstance(pair[0], str)
                or len(pair[0]) > MAX_PEER_CHARS
                or not isinstance(pair[1], bytes)
                or len(pair[1]) != DIGEST_BYTES
            ):
                raise BadStatement("a malformed secret")
            pairs.append((pair[0], pair[1]))
        return cls(
            signed,
            fields[3],
            _digests([fields[4]], 1)[0],
            [_float(v) for v in values],
            pairs,
            [None if d is None else _float(d, finite=True) for d in dots],
        )


@dataclass(frozen=True)
class Receipt:
    """An owner's word that it took a member's parts (its commitment named by digest): with the
    owner's answer statement that leaves the member out, proof that the owner dropped them."""

    signed: Signed
    owner: str
    member: str
    commitment: bytes

    @classmethod
    def make(cls, signer: Signer, *, round: int, group_id: bytes, member: str, commitment: bytes) -> Receipt:
        fields = [RECEIPT, round, group_id, signer.peer_id, member, commitment]
        return cls(signer.sign(fields), signer.peer_id, member, commitment)

    @classmethod
    def parse(cls, signed: Signed, keys: KeyRing, *, round: int, group_id: bytes) -> Receipt:
        fields = keys.open(signed, RECEIPT)
        if len(fields) != 6 or not isinstance(fields[4], str) or len(fields[4]) > MAX_PEER_CHARS:
            raise BadStatement("a malformed receipt")
        _bound(round, group_id, fields)
        return cls(signed, fields[3], fields[4], _digests([fields[5]], 1)[0])


def dropped_after_receipt(receipt: Receipt, statement: AnswerStatement) -> bool:
    """Whether `statement` (the same owner's answer, same round) leaves out, or names another
    commitment of, the member whose parts `receipt` says the owner took: the owner's own two
    signatures prove that it dropped them."""
    if receipt.owner != statement.owner:
        return False
    if receipt.member not in statement.contributors:
        return True
    return statement.commitments[statement.contributors.index(receipt.member)] != receipt.commitment


@dataclass
class Mailbox:
    """The reveals and projections other members sent this peer for one round (the first of each
    from each member; a second, different one is kept as the proof that it equivocated), and the
    members known to have left the round (`gone`, why): one this peer could not open a stream to
    (`unreachable`: dead, or gone from the network), or one that said it withdrew (its exchange
    failed, `verify_streams.WITHDRAW`), naming whom it could not reach (`withdrawals`), and whether
    it had sent its reveal (one that had not, `unrevealed`, sent it to nobody: no member can relay
    its secret)."""

    reveals: dict[str, Reveal] = field(default_factory=dict)
    projections: dict[str, Projections] = field(default_factory=dict)
    equivocations: dict[str, tuple[str, Signed, Signed]] = field(default_factory=dict)  # kind, both
    gone: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    withdrawals: dict[str, list[str]] = field(default_factory=dict)
    unrevealed: set[str] = field(default_factory=set)
    arrived: dict[str, float] = field(default_factory=dict)  # loop time of each member's first reveal
    # Members an owner was shown (an accusation that checked out) to have left out after signing
    # their receipt: they take the round all the same (`member.assemble`).
    dropped: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def lost(self, peer: str) -> None:
        """No stream to `peer` could be opened: it has left the round."""
        self.unreachable.add(peer)
        self.gone.setdefault(peer, "unreachable")
        self.changed.set()

    def withdrew(self, peer: str, why: str, blamed: list[str], revealed: bool) -> None:
        """`peer` said it leaves the round (`why`), as it could not reach `blamed`, having sent its
        reveal or not (`revealed`)."""
        if peer not in self.withdrawals and not revealed:
            self.unrevealed.add(peer)
        self.withdrawals.setdefault(peer, blamed)
        self.gone.setdefault(peer, f"withdrew: {why}")
        self.changed.set()

    def put(self, kind: str, statement: Reveal | Projections) -> None:
        box: dict[str, Any] = self.reveals if kind == REVEAL else self.projections
        held = box.get(statement.peer)
        if held is None:
            box[statement.peer] = statement
            if kind == REVEAL:
                self.arrived[statement.peer] = asyncio.get_running_loop().time()
        elif held.signed.body != statement.signed.body:
            self.equivocations.setdefault(statement.peer, (kind, held.signed, statement.signed))
        self.changed.set()

    async def wait(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait until `ready()` or the loop-time `deadline`; whether it is ready."""
        loop = asyncio.get_running_loop()
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=left)
        return True


def statement_bound(parts: int, members: int) -> int:
    """The most bytes a commitment or answer statement of a layout of `parts` parts and a group of
    `members` members can need: every list at its longest (a rejection or a clip factor of every
    member in every part)."""
    per_part = MAX_PART_CHARS + 2 * DIGEST_BYTES + 32
    per_member = MAX_PEER_CHARS + DIGEST_BYTES + 32 * parts + 16
    return 4096 + parts * per_part + members * per_member
