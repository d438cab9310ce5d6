"""The owner's side of a round: take the members' payloads of the parts it owns, reduce once, answer.

An owner collects contributions until all members have sent (or were dropped) or its part deadline
has passed (`OwnerSession.deadline`, derived from the bytes of the round); where the group's owners
are some of its members (`trust`), until the owners' parts are in and a grace after (`trust.GRACE_S`:
at least as long again as they took), so a key with no record that joins and sends nothing holds
the round that long, not to the deadline. It then reduces its parts once
with `parts.reduce_parts` (screening out non-finite and outlier payloads), encodes each average once
with its codec, and answers every member that contributed in time with the same bytes, the sorted
list of contributors it included, how many of each one's parts it rejected and, for the owner of the
first tensor, the contributors' encoded reports. The owner's own parts never touch the wire.

A member's parts come in three steps on one stream. The request header announces the part sizes;
the owner refuses it, before a single payload byte, if its group id differs from its own (another
view of the members or another tensor layout), if the stream's peer is not the member it names or
not in the group, if the parts are not the ones this peer owns (or those of an owner it stands in
for: `RoundState.take_over`), or if a size differs from the owner's own payload of that part (the
group id covers every payload size, so honest members agree exactly). Otherwise it says go, and
reads the payloads as chunk frames (`wire.read_chunks`): a chunk larger than what is left of its
part is refused before it is read. Payloads arrive in full before
they count; `codecs.payload_shape` then checks each as `decode` would, without decoding it, so the
owner decodes every payload once, when it reduces. A member refused after its header was accepted
(it sent more than announced, a malformed payload), or whose stream broke before its payloads were
in (it died mid-send), is dropped from the round: the owner no longer waits for it.

Why payloads are buffered per part and reduced at the deadline, not summed as chunks arrive: the
screening needs every payload of a part (the median norm) and the bit-identical sum needs the final
contributor set and order, neither known before all members are in or the deadline passed. The
owner therefore holds its parts' payloads (as it must, to screen), never a whole frame of a member,
and reads at most one chunk per stream at a time.

    request  = v, r round, g group id, p sender, w weight, t tokens, k part keys, s part sizes,
               m encoded report (only to the owner of the first tensor, else nil)
    go       = v, ok, e error text (when not ok)
    payloads = chunk frames, part after part, each at most a chunk and what is left of its part
    receipt  = v, rc the owner's signed receipt of the member's parts (`statements.Receipt`)
    response = v, ok, e error text (when not ok), c contributors (sorted), k, s part sizes,
               gm contributors' reports (only from the owner of the first tensor),
               x {contributor: number of its parts rejected}; then the parts as chunk frames
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from hivemind.utils.serializer import MSGPackSerializer

from ..algorithms.claims import UNBOUNDED, ClaimBounds
from ..algorithms.codecs import Codec, payload_codec, payload_shape
from ..algorithms.parts import MEAN, Aggregate, Clip, reduce_parts
from ..algorithms.report import MAX_REPORT_BYTES
from ..algorithms.scoring import Scorer
from ..algorithms.trust import grace_s, seeders
from .admission import NOT_ADMITTED, Admission
from .matchmaking import Group
from .statements import (
    AnswerStatement,
    BadStatement,
    Commitment,
    KeyRing,
    Mailbox,
    Receipt,
    Signed,
    Signer,
    digest,
    statement_bound,
)
from .turns import TURN_FLOOR_S, SendTurn, chain, send_order
from .wire import PROTOCOL_VERSION, Meter, read_chunks, read_frame, write_chunks, write_frame

logger = logging.getLogger(__name__)


def str_list(value: Any) -> list[str]:
    """`value` if it is a list of strings; ValueError otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {type(value).__name__}")
    return value


def size_list(value: Any, count: int) -> list[int]:
    """`value` if it is a list of `count` byte sizes (ints >= 0); ValueError otherwise."""
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(type(v) is int and v >= 0 for v in value)
    ):
        raise ValueError(f"expected {count} part sizes")
    return value


REQUEST_HEADER_BYTES = 1 << 20
"""The most a request header may take (read before its round is known): a commitment lists ~45
bytes per part, so this holds ~20,000 parts."""
BAN_S = 600.0
"""How long an owner refuses a member that broke a rule on a stream authenticated as its own (wrong
parts or sizes, a claim the round does not allow, more bytes than announced, a malformed payload)."""


@dataclass(frozen=True)
class Request:
    """One member's request header for one owner, as read off the stream (types checked)."""

    round: int
    group_id: bytes
    peer: str
    weight: float
    tokens: float
    keys: list[str]
    sizes: list[int]
    metadata: bytes | None
    commitment: Signed

    @classmethod
    def parse(cls, header: dict[str, Any], *, max_statement: int) -> Request:
        keys = str_list(header.get("k"))
        sizes = size_list(header.get("s"), len(keys))
        round, group_id, peer = header.get("r"), header.get("g"), header.get("p")
        weight, tokens, metadata = header.get("w"), header.get("t"), header.get("m")
        if not (
            isinstance(round, int)
            and isinstance(group_id, bytes)
            and isinstance(peer, str)
            and isinstance(weight, (int, float))
            and isinstance(tokens, (int, float))
            and (metadata is None or isinstance(metadata, bytes))
        ):
            raise ValueError("malformed request header")
        if metadata is not None and len(metadata) > MAX_REPORT_BYTES:
            # Relayed as an empty, hence malformed, report: every member drops it alike. The only
            # report a relay may change (`verification` holds every other one to its commitment).
            metadata = b""
        commitment = Signed.from_wire(header.get("c"), max_body=max_statement)
        return cls(round, group_id, peer, float(weight), float(tokens), keys, sizes, metadata, commitment)


@dataclass(frozen=True)
class Incoming:
    """One member's contribution to the parts of one owner, and its signed commitment."""

    weight: float
    tokens: float
    payloads: dict[str, bytes]
    metadata: bytes | None
    commitment: Commitment | None = None


@dataclass(frozen=True)
class Answer:
    """An owner's answer: the contributors it included, its averaged parts, their reports.

    `rejected`: contributor -> how many of its parts this owner screened out (none: absent).
    `statement`: the owner's signed statement of it, `commitments` the contributors' (in their
    order), what a member checks it with (`verification`); None only in process.
    """

    contributors: tuple[str, ...]
    payloads: dict[str, bytes]
    metadata: tuple[bytes, ...] | None
    rejected: dict[str, int] = field(default_factory=dict)
    statement: AnswerStatement | None = None
    commitments: tuple[Commitment, ...] = ()


_DROPPED = Incoming(0.0, 0.0, {}, None)


def reports_digest(metadata: tuple[bytes, ...] | None) -> bytes:
    """What an answer statement names the relayed reports by (empty when it relays none)."""
    return b"" if metadata is None else digest(MSGPackSerializer.dumps(list(metadata)))


def reduce_owned(
    keys: list[str],
    contributions: Mapping[str, Incoming],
    codec: Codec,
    outlier_factor: float | None,
    aggregate: Aggregate = MEAN,
    scorer: Scorer | None = None,
    work_cap: float | None = None,
    *,
    layout: Mapping[str, int] | None = None,
    signed_by: Callable[..., AnswerStatement] | None = None,
) -> tuple[Answer, list[tuple[str, str, str]]]:
    """The owner's reduction over the contributors that arrived, and (part, peer, reason) rejections;
    with a `scorer`, the contributors it excludes are rejected in every part (`parts.reduce_parts`);
    `work_cap`: the round's reference work, the most the screening credits a claim with. When every
    contribution carries its commitment, the screening runs on the committed norms (`layout`: each
    part's place in them) and `signed_by(...)` makes the answer's signed statement."""
    contributors = tuple(sorted(contributions))
    entries = [contributions[peer] for peer in contributors]
    commitments = [e.commitment for e in entries]
    committed = layout is not None and all(c is not None for c in commitments)

    def claimed_norm(i: int, key: str) -> float:
        commitment = commitments[i]
        assert commitment is not None and layout is not None
        return commitment.norms[layout[key]]

    reduced = reduce_parts(
        keys,
        contributors,
        lambda i, key: entries[i].payloads[key],
        [e.weight for e in entries],
        [e.tokens for e in entries],
        codec,
        outlier_factor=outlier_factor,
        aggregate=aggregate,
        scorer=scorer,
        work_cap=work_cap,
        claimed_norms=claimed_norm if committed else None,
    )
    metadata = tuple(e.metadata or b"" for e in entries)
    statement = None
    kept: tuple[Commitment, ...] = ()
    if committed and signed_by is not None:
        kept = tuple(c for c in commitments if c is not None)
        statement = signed_by(
            keys=keys,
            payloads=[reduced.averaged[k] for k in keys],
            contributors=contributors,
            commitments=[c.signed.digest for c in kept],
            codes=[reduced.codes[k] for k in keys],
            clips=[reduced.clips.get(k) for k in keys],
            metadata=metadata,
        )
    answer = Answer(contributors, reduced.averaged, metadata, reduced.rejected, statement, kept)
    return answer, reduced.rejections


def shape_error(
    payloads: Mapping[str, bytes],
    shapes: Mapping[str, tuple[int, ...]],
    codecs: Mapping[str, Collection[str]] | None = None,
) -> str | None:
    """Why these payloads cannot be averaged with the owner's (None if they can): a payload that
    does not parse, of another shape, or (given `codecs`, key -> the codec families allowed) made
    by another codec than the round's. A contribution in the round's codec cannot be a `sum`
    payload, whose parts each decode to a whole tensor.

    Reads headers and lengths only (`codecs.payload_shape`): cheap, and no value is decoded.
    """
    for key, payload in payloads.items():
        try:
            shape = payload_shape(payload)
            family = payload_codec(payload)
        except ValueError as e:
            return f"{key}: {e}"
        if shape != shapes[key]:
            return f"{key}: shape {shape} instead of {shapes[key]}"
        if codecs is not None and family not in codecs[key]:
            return f"{key}: a {family} payload where the round's codec makes {sorted(codecs[key])}"
    return None


class OwnerSession:
    """The parts this peer owns in one group: collect contributions, reduce once, answer everyone."""

    def __init__(
        self,
        *,
        group: Group,
        keys: list[str],
        shapes: dict[str, tuple[int, ...]],
        sizes: list[int],
        codec: Codec,
        outlier_factor: float | None,
        with_metadata: bool,
        deadline: float,
        answer_timeout_s: float,
        bounds: ClaimBounds = UNBOUNDED,
        aggregate: Aggregate = MEAN,
        on_stage: Callable[[str, int], None] | None = None,
        scorer: Scorer | None = None,
        owner: str = "",
        turn_budget_s: float = TURN_FLOOR_S,
        signer: Signer | None = None,
        layout: Mapping[str, int] | None = None,
        codecs: Mapping[str, str] | None = None,
    ) -> None:
        self.group = group
        # Each part's codec family, as the owner's own payload has it: every contribution's must be.
        self.codecs = {k: {family} for k, family in (codecs or {}).items()} or None
        # Signs the answer's statement (`statements`), the parts' places in the members' commitments.
        self.signer, self.layout = signer, layout
        # The members are answered one at a time, after the owner's place in the group (`turns`).
        self.owner, self.turn_budget_s = owner, turn_budget_s
        self._turns: dict[str, SendTurn] | None = None
        self.keys = keys
        self.shapes = shapes
        self.sizes = sizes
        self.codec = codec
        self.outlier_factor = outlier_factor
        self.aggregate = aggregate
        self.scorer = scorer
        self.bounds = bounds
        self.with_metadata = with_metadata
        self.deadline = deadline  # loop time
        self.answer_timeout_s = answer_timeout_s
        self.contributions: dict[str, Incoming] = {}
        self.kept: dict[str, dict[str, bytes]] = {}  # each contributor's payloads, after the reduction
        self.receiving: set[str] = set()
        self.dropped: set[str] = set()
        self.closed = False
        self.result: Answer | None = None
        self.done = asyncio.Event()
        self.idle = asyncio.Event()  # done, and every admitted member has been answered
        self._all_in = asyncio.Event()
        self._owners_in = asyncio.Event()
        # Where only some members own, the others' parts are waited for a grace once the owners' are in.
        self._graced = len(seeders(group.members, group.owners)) < len(group.members)
        self._opened = asyncio.get_running_loop().time()
        self._answering = 0
        self.done_at: float | None = None  # loop time the reduction ended
        self._on_stage = on_stage  # fault injection: "reducing" once the members are in, "answered"

    def receive(self, peer: str) -> bool:
        """Reserve `peer`'s one incoming stream; False once closed, or if `peer` already sent, is
        sending or was dropped (a member cannot make the owner buffer its parts twice)."""
        if self.closed or peer in self.contributions or peer in self.receiving or peer in self.dropped:
            return False
        self.receiving.add(peer)
        return True

    def admit(self, peer: str, incoming: Incoming) -> bool:
        """Take a contribution; False once the session has closed or for a second one from `peer`."""
        self.receiving.discard(peer)
        if self.closed or peer in self.contributions or peer in self.dropped:
            return False
        self.contributions[peer] = incoming
        self._answering += 1
        self._update_all_in()
        return True

    def waiting(self) -> list[str]:
        """The members whose parts this open reduction still waits for and that have sent nothing."""
        if self.closed:
            return []
        taken = set(self.contributions) | self.receiving | self.dropped
        return [m for m in self.group.members if m not in taken]

    def drop(self, peer: str) -> None:
        """`peer` broke the protocol after its header was accepted: never wait for it again."""
        self.receiving.discard(peer)
        if peer not in self.contributions:
            self.dropped.add(peer)
            self._update_all_in()

    def _update_all_in(self) -> None:
        if len(self.contributions) + len(self.dropped) == len(self.group.members):
            self._all_in.set()
        if all(o in self.contributions or o in self.dropped for o in self.group.owners):
            self._owners_in.set()

    async def _wait_members(self) -> None:
        """Until every member is in, or the deadline; where some members own nothing, until the
        owners are in and a grace after (see the module doc)."""
        loop = asyncio.get_running_loop()
        left = max(0.0, self.deadline - loop.time())
        if not self._graced:
            await asyncio.wait_for(self._all_in.wait(), timeout=left)
            return
        either = [asyncio.ensure_future(e.wait()) for e in (self._all_in, self._owners_in)]
        try:
            await asyncio.wait(either, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in either:
                waiting.cancel()
        if self._all_in.is_set():
            return
        if not self._owners_in.is_set():
            raise asyncio.TimeoutError
        now = loop.time()
        grace = grace_s(now - self._opened)
        await asyncio.wait_for(self._all_in.wait(), timeout=max(0.0, min(self.deadline, now + grace) - now))

    def answered(self) -> None:
        self._answering -= 1
        self._update_idle()

    def answer_turn(self, peer: str) -> SendTurn:
        """`peer`'s turn among the answers (once reduced): the members it admitted, in the order after
        the owner's place in the group; a turn of its own, at once, for any other peer."""
        if self._turns is None and self.done.is_set() and self.owner in self.group.members:
            order = [m for m in send_order(self.group.members, self.owner) if m in self.contributions]
            self._turns = chain(order, dict.fromkeys(order, self.turn_budget_s))
        return (self._turns or {}).get(peer) or SendTurn(None, 0.0)

    async def run(self, executor: ThreadPoolExecutor) -> None:
        """Wait for the members (at most until the deadline), then reduce on `executor`."""
        loop = asyncio.get_running_loop()
        try:
            await self._wait_members()
        except asyncio.TimeoutError:
            missing = sorted(set(self.group.members) - set(self.contributions) - self.dropped)
            logger.info("round %d: owner reduces without %s (part deadline)", self.group.round, missing)
        if self.dropped:
            logger.warning(
                "round %d: owner dropped %s", self.group.round, sorted(p[-8:] for p in self.dropped)
            )
        self.closed = True
        if self._on_stage is not None:
            self._on_stage("reducing", self.group.round)
        try:
            contributions = dict(self.contributions)
            self.result, rejections = await loop.run_in_executor(
                executor,
                functools.partial(
                    reduce_owned,
                    self.keys,
                    contributions,
                    self.codec,
                    self.outlier_factor,
                    self.aggregate,
                    self.scorer,
                    self.bounds.reference_tokens,
                    layout=self.layout,
                    signed_by=None if self.signer is None else self._sign,
                ),
            )
            for key, peer, reason in rejections:
                logger.warning(
                    "round %d: rejected part %r of %s: %s", self.group.round, key, peer[-8:], reason
                )
        except ValueError as e:
            logger.warning("round %d: reduction failed: %s", self.group.round, e)
        finally:
            # The payloads stay until the round's checks are over (`release`): a member whose check
            # of these parts fails asks this owner to show which contributor's projection was false.
            self.kept = {peer: c.payloads for peer, c in self.contributions.items()}
            self.contributions = {peer: _DROPPED for peer in self.contributions}
            self.done_at = loop.time()
            self.done.set()
            self._update_idle()

    def _sign(
        self,
        *,
        keys: list[str],
        payloads: list[bytes],
        contributors: tuple[str, ...],
        commitments: list[bytes],
        codes: list[dict[int, str]],
        clips: list[Clip | None],
        metadata: tuple[bytes, ...],
    ) -> AnswerStatement:
        """This reduction's signed statement (on the reduction's thread)."""
        assert self.signer is not None
        return AnswerStatement.make(
            self.signer,
            round=self.group.round,
            group_id=self.group.group_id,
            keys=keys,
            payloads=payloads,
            contributors=contributors,
            commitments=commitments,
            codes=codes,
            rule=str(self.aggregate),
            outlier_factor=self.outlier_factor,
            work_cap=self.bounds.reference_tokens,
            reports=reports_digest(metadata if self.with_metadata else None),
            clips=clips,
        )

    def restate(self, answer: Answer) -> Answer:
        """`answer` with a statement of its bytes signed by this owner, its contributors, rejections
        and clip factors as its own statement has them: what `reduce_owned` signs, for an answer
        changed after the reduction (the way the tests' and bench/hostile_node.py's liars lie)."""
        assert answer.statement is not None
        statement = self._sign(
            keys=self.keys,
            payloads=[answer.payloads[k] for k in self.keys],
            contributors=answer.contributors,
            commitments=[c.signed.digest for c in answer.commitments],
            codes=answer.statement.codes,
            clips=answer.statement.clips,
            metadata=answer.metadata or (),
        )
        return replace(answer, statement=statement)

    def delivered(self) -> None:
        """A member has read its whole answer (fault injection: the "answered" stage, once per member)."""
        if self._on_stage is not None:
            self._on_stage("answered", self.group.round)

    def release(self) -> None:
        """Free the contributions' payloads (the round's checks are over)."""
        self.kept = {}

    def owed_until(self) -> float | None:
        """Until when (loop time) members may still be reading the answers of this reduction: each
        answer gets `answer_timeout_s` from the reduction, no less than its member waits for it.
        None when nothing is owed: not reduced (an abandoned round), or every answer was read."""
        if self.done_at is None or self.idle.is_set():
            return None
        return self.done_at + self.answer_timeout_s

    def _update_idle(self) -> None:
        if self.done.is_set() and self._answering <= 0:
            self.idle.set()
            self.result = None  # everyone who needed it holds it; the round state outlives it


def _no_take_over(keys: list[str]) -> OwnerSession | None:
    return None


@dataclass
class RoundState:
    """This peer's part in one round, shared by its own `average` call and the stream handlers.

    `take_over(keys)`: the session in which this peer reduces `keys` in place of their owner, when
    they are exactly the parts of another member (a member that could not reach that owner asks
    the next members in order; see hivemind_averager.py); None for any other keys. `layout`: every
    part's place in the contributions (the members' commitments list theirs in this order); `ring`
    checks the statements of the round's peers; `own`: this peer's commitment; `mail`: the reveals
    and projections the other members sent it (`verification`).
    """

    group: Group
    session: OwnerSession | None
    meter: Meter = field(default_factory=Meter)
    take_over: Callable[[list[str]], OwnerSession | None] = _no_take_over
    layout: dict[str, int] = field(default_factory=dict)
    ring: KeyRing = field(default_factory=KeyRing)
    own: Commitment | None = None
    mail: Mailbox = field(default_factory=Mailbox)
    reductions: list[OwnerSession] = field(default_factory=list)  # ours and those we stand in for
    answers: dict[str, Answer] = field(default_factory=dict)  # every owner's, once gathered
    receipts: dict[str, Receipt] = field(default_factory=dict)  # each owner's, for our parts
    seed: bytes | None = None  # the round's direction seed, once every secret is in
    commitments: dict[str, Commitment] = field(default_factory=dict)  # every contributor's, once checked

    def reduction_of(self, key: str) -> OwnerSession | None:
        """Our reduction of part `key`, if we made one."""
        return next((s for s in self.reductions if key in s.keys), None)

    def release(self) -> None:
        """Free what our reductions kept for the checks."""
        for session in self.reductions:
            session.release()

    @property
    def statement_bytes(self) -> int:
        """The most bytes a commitment or answer statement of this round may take."""
        return statement_bound(len(self.layout), len(self.group.members))


def _session_for(state: RoundState, request: Request) -> OwnerSession | None:
    """Our session for the parts `request` announces: ours, or those of an owner we stand in for;
    else our own (whose rules the request then breaks), or None when we own nothing."""
    own = state.session
    if own is not None and request.keys == own.keys:
        return own
    return state.take_over(request.keys) or own


def _violation(session: OwnerSession, request: Request, state: RoundState) -> str | None:
    """How a member of the group announced other parts than the ones it must send, claimed a weight
    or tokens the round does not allow, or sent a commitment that is not its own for this round or
    not what it announces (None: none of these); the group id covers every payload size, so honest
    members announce exactly ours."""
    if request.keys != session.keys:
        return "these are not the parts this peer owns"
    if session.with_metadata and request.metadata is None:
        return "metadata missing"
    if request.sizes != session.sizes:
        return f"part sizes {request.sizes} announced, {session.sizes} expected"
    violation = session.bounds.violation(request.weight, request.tokens)
    if violation is not None:
        return violation
    try:
        commitment = _commitment_of(request, state)
    except BadStatement as e:
        return f"commitment: {e}"
    if commitment.weight != request.weight or commitment.tokens != request.tokens:
        return "the commitment claims another weight or tokens than the request"
    if request.metadata and digest(request.metadata) != commitment.report:
        return "the report is not the one committed to"
    return None


def _commitment_of(request: Request, state: RoundState) -> Commitment:
    commitment = Commitment.parse(
        request.commitment,
        state.ring,
        round=state.group.round,
        group_id=state.group.group_id,
        parts=len(state.layout),
    )
    if commitment.peer != request.peer:
        raise BadStatement("the commitment of another member")
    return commitment


class OwnerHandler:
    """The stream handler members call: one request in, one answer (or refusal) out.

    `round_state(r)` resolves to this peer's state for round r once its own group is known (None if
    it has none); a request waits for it at most `wait_s`. A request header must arrive within
    `header_timeout_s`; the payloads must be in by the session's deadline; the answer is written
    within the session's `answer_timeout_s`. Answers go out in chunks of `chunk_bytes`.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        round_state: Callable[[int], Awaitable[RoundState | None]],
        header_timeout_s: float,
        wait_s: float,
        chunk_bytes: int,
        ban_s: float = BAN_S,
        admission: Admission | None = None,
        signer: Signer | None = None,
    ) -> None:
        self.peer_id = peer_id
        self._signer = signer  # signs the receipts of the parts we take
        self._admission = admission or Admission()
        self._round_state = round_state
        self._header_timeout_s = header_timeout_s
        self._wait_s = wait_s
        self._chunk_bytes = chunk_bytes
        self._ban_s = ban_s
        # Members that broke a rule of the protocol on a stream authenticated as theirs, and until
        # when (loop time) this owner refuses them: they are dropped from every round meanwhile.
        self.banned: dict[str, float] = {}
        self.violations = 0  # rule breaks caught since start (each one (re)starts a ban)

    def active_bans(self, now: float) -> int:
        """Members refused at `now` (the handler's loop time; read from another thread, the count
        may miss a ban made meanwhile)."""
        return sum(1 for until in list(self.banned.values()) if until > now)

    def _ban(self, peer: str, why: str) -> None:
        self.violations += 1
        until = asyncio.get_running_loop().time() + self._ban_s
        if peer not in self.banned:
            logger.warning("member %s broke the protocol (%s): refused %.0f s", peer[-8:], why, self._ban_s)
        self.banned[peer] = until

    def _ban_left(self, peer: str) -> float:
        """Seconds `peer` stays refused (0: not banned)."""
        left = self.banned.get(peer, 0.0) - asyncio.get_running_loop().time()
        if left <= 0:
            self.banned.pop(peer, None)
            return 0.0
        return left

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Take one member's parts, answer with the averaged parts (or a refusal)."""
        meter = Meter()
        state: RoundState | None = None
        receiving: OwnerSession | None = None
        admitted: OwnerSession | None = None
        try:
            remote = str(info.peer_id.to_base58())
            if not await self._admission.select_async([remote]):
                # A private run's outsider: refused before a byte of its request is read.
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": NOT_ADMITTED}, [], meter)
                return
            header, _ = await asyncio.wait_for(
                read_frame(reader, meter, max_header=REQUEST_HEADER_BYTES, max_body=0),
                timeout=self._header_timeout_s,
            )
            request = Request.parse(header, max_statement=REQUEST_HEADER_BYTES)
            state = await asyncio.wait_for(self._round_state(request.round), timeout=self._wait_s)
            refusal = self._refusal(state, request, remote)
            session = _session_for(state, request) if refusal is None and state is not None else None
            if refusal is None and session is None:
                refusal = "this peer owns no parts in the group"
            if refusal is None and session is not None and state is not None:
                banned_s = self._ban_left(request.peer)
                violation = _violation(session, request, state)
                if banned_s > 0:
                    session.drop(request.peer)
                    refusal = f"refused for {banned_s:.0f} s more: this member broke the protocol"
                elif violation is not None:
                    # A member of the group (its stream is authenticated as the peer it names) that
                    # announced the wrong parts or claimed what the round does not allow.
                    session.drop(request.peer)
                    self._ban(request.peer, violation)
                    refusal = violation
                elif session.receive(request.peer):
                    receiving = session
                else:
                    refusal = "the owner has already reduced (too late), or got or dropped this member"
            if receiving is None or state is None:
                await self._refuse(writer, request, refusal, meter)
                return
            await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True}, [], meter)
            meter.checks_received += request.commitment.size
            admitted = await self._receive(reader, writer, receiving, request, meter, state)
            if admitted is None:
                return
            await self._receipt(writer, state, request, meter)
            await admitted.done.wait()
            await asyncio.wait_for(
                self._answer_until_received(reader, writer, admitted, meter, request.peer),
                timeout=admitted.answer_timeout_s,
            )
            admitted.delivered()
        except ValueError as e:  # a protocol violation: the member is out of this round
            logger.info("averaging stream refused: %s", e)
            if receiving is not None and admitted is None:
                receiving.drop(request.peer)
                self._ban(request.peer, str(e)[:200])
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.debug("averaging stream dropped: %r", e)
            if receiving is not None and admitted is None:
                # Its stream broke mid-send (the member died, or gave up): members never send again
                # on another stream, so the owner does not wait for it until the part deadline.
                receiving.drop(request.peer)
        finally:
            writer.close()
            if receiving is not None and admitted is None:
                receiving.receiving.discard(request.peer)
            if state is not None:
                state.meter.add(meter)
            if admitted is not None:
                admitted.answered()

    async def _receive(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: OwnerSession,
        request: Request,
        meter: Meter,
        state: RoundState,
    ) -> OwnerSession | None:
        """Read the announced payloads by the session's deadline, check them against the member's
        commitment and admit them (None: refused)."""
        remaining = session.deadline - asyncio.get_running_loop().time()
        body = await asyncio.wait_for(read_chunks(reader, request.sizes, meter), timeout=max(0.0, remaining))
        payloads = dict(zip(request.keys, body, strict=True))
        # On the event loop: the check is cheap, and on the reduction's executor it would queue
        # behind a running reduction.
        error = shape_error(payloads, session.shapes, session.codecs)
        if error is not None:
            raise ValueError(f"{request.peer[-8:]}: {error}")
        commitment = _commitment_of(request, state)  # parsed at the header already: cannot fail
        for key, payload in payloads.items():
            if digest(payload) != commitment.digests[state.layout[key]]:
                raise ValueError(f"{request.peer[-8:]}: payload {key!r} is not the one committed to")
        incoming = Incoming(request.weight, request.tokens, payloads, request.metadata, commitment)
        if session.admit(request.peer, incoming):
            return session
        await self._refuse(writer, request, "the owner has already reduced (too late)", meter)
        return None

    async def _refuse(
        self, writer: asyncio.StreamWriter, request: Request, why: str | None, meter: Meter
    ) -> None:
        logger.debug("round %d: refused %s: %s", request.round, request.peer[-8:], why)
        await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": why}, [], meter)

    def _refusal(self, state: RoundState | None, request: Request, stream_peer: str) -> str | None:
        """Why this request is not for our reduction (None if it is); nothing read past its header."""
        if state is None:
            return "the owner is not in a group for this round"
        if request.group_id != state.group.group_id:
            return "group mismatch (different view of the members, or a different tensor layout)"
        if request.peer != stream_peer:
            return "the request names another peer than the stream's"
        if request.peer not in state.group.members or request.peer == self.peer_id:
            return "not a member of the group"
        return None

    async def _receipt(
        self, writer: asyncio.StreamWriter, state: RoundState, request: Request, meter: Meter
    ) -> None:
        """Our signed word that we took the member's parts: should our answer leave it out, it holds
        the proof (`statements.Receipt`)."""
        if self._signer is None:
            return
        receipt = Receipt.make(
            self._signer,
            round=state.group.round,
            group_id=state.group.group_id,
            member=request.peer,
            commitment=request.commitment.digest,
        )
        await write_frame(writer, {"v": PROTOCOL_VERSION, "rc": receipt.signed.to_wire()}, [], meter)
        meter.checks_sent += receipt.signed.size

    async def _answer_until_received(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: OwnerSession,
        meter: Meter,
        peer: str,
    ) -> None:
        """Answer, then wait for the member to close its end, which it does once it has read the
        answer. Until then the answer is not given: bytes written may still sit in this process's
        p2pd, and an owner that counted them as given could end its last round and stop its p2pd
        with the answer in flight."""
        await self._answer(writer, session, meter, peer)
        await writer.drain()
        if await reader.read(1):
            raise ValueError("the member sent more after its parts")

    async def _answer(
        self, writer: asyncio.StreamWriter, session: OwnerSession, meter: Meter, peer: str
    ) -> None:
        result = session.result
        if result is None:
            header: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": False, "e": "the owner's reduction failed"}
            await write_frame(writer, header, [], meter)
            return
        payloads = [result.payloads[k] for k in session.keys]
        turn = session.answer_turn(peer)
        header = {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "c": list(result.contributors),
            "k": session.keys,
            "s": [len(p) for p in payloads],
            "gm": list(result.metadata) if session.with_metadata and result.metadata else None,
            "x": result.rejected,
        }
        if result.statement is not None:
            header["st"] = result.statement.signed.to_wire()
            header["cm"] = [c.signed.to_wire() for c in result.commitments]
            meter.checks_sent += result.statement.signed.size + sum(c.signed.size for c in result.commitments)
        await write_frame(writer, header, [], meter)
        try:
            await turn.begin()
            await write_chunks(writer, payloads, self._chunk_bytes, meter)
        finally:
            turn.end()
