"""The owner's side of a round: take the members' payloads of the parts it owns, reduce once, answer.

An owner collects contributions until all members have sent (or were dropped) or its part deadline
has passed (`OwnerSession.deadline`, derived from the bytes of the round); once more than half of
the group's owners (`trust`) have sent, until a grace after (`trust.grace_s`: twice as long as they
took, at least `trust.GRACE_S`). So a key with no record that joins and sends nothing holds the
round that long, not to the deadline; and an owner whose parts never come (one that withholds them
from this owner alone, or died) cannot hold this owner's answer until its members give up on it as
late (`round_exchange`, `wire.late_answer_s`): this owner reduces without it, and the round's
members are those every owner admitted (`member.assemble`). It then reduces its parts once
with `parts.reduce_parts` (screening out non-finite and outlier payloads), encodes each average once
with its codec, and answers every member that contributed in time with the same bytes, the sorted
list of contributors it included, how many of each one's parts it rejected and, for the owner of the
first tensor, the contributors' encoded reports. The owner's own parts never touch the wire.

Why payloads are buffered per part and reduced at the deadline, not summed as chunks arrive: the
screening needs every payload of a part (the median norm) and the bit-identical sum needs the final
contributor set and order, neither known before all members are in or the deadline passed. The
owner therefore holds its parts' payloads (as it must, to screen), never a whole frame of a member,
and reads at most one chunk per stream at a time.

The stream a member sends its parts on, and the answer on it, are owner_streams.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from hivemind.utils.serializer import MSGPackSerializer

from ..algorithms.claims import UNBOUNDED, ClaimBounds
from ..algorithms.codecs import Codec, payload_codec, payload_shape
from ..algorithms.parts import MEAN, Aggregate, Clip, reduce_parts
from ..algorithms.scoring import Scorer
from ..algorithms.trust import grace_s
from .matchmaking import Group
from .statements import (
    AnswerStatement,
    Commitment,
    KeyRing,
    Mailbox,
    Receipt,
    Signer,
    digest,
    statement_bound,
)
from .turns import TURN_FLOOR_S, SendTurn, chain, send_order
from .wire import Meter

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


BAN_S = 600.0
"""How long an owner refuses a member that broke a rule on a stream authenticated as its own (wrong
parts or sizes, a claim the round does not allow, more bytes than announced, a malformed payload)."""


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
    payloads: Mapping[str, bytes]
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
        # Each contributor's payloads, after the reduction (on disk once shelved: `RoundExchange`).
        self.kept: dict[str, Mapping[str, bytes]] = {}
        self.receiving: set[str] = set()
        self.dropped: set[str] = set()
        self.closed = False
        self.result: Answer | None = None
        self.done = asyncio.Event()
        self.idle = asyncio.Event()  # done, and every admitted member has been answered
        self._all_in = asyncio.Event()
        self._owners_in = asyncio.Event()
        # Once more than half of the owners' parts are in, the rest are waited for a grace.
        self._owners_needed = len(group.owners) // 2 + 1
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
        if (
            sum(1 for o in self.group.owners if o in self.contributions or o in self.dropped)
            >= self._owners_needed
        ):
            self._owners_in.set()

    async def _wait_members(self) -> None:
        """Until every member is in, or the deadline; once more than half of the owners are in,
        until a grace after (see the module doc)."""
        loop = asyncio.get_running_loop()
        left = max(0.0, self.deadline - loop.time())
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
        grace = grace_s(2 * (now - self._opened))
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
    revealed: bool = False  # whether this peer has sent the others its reveal (`verify_round`)
    # The seeders whose secrets the seed was drawn without: their reveals were late (`verify_round`).
    unrevealed: tuple[str, ...] = ()

    def reduction_of(self, key: str) -> OwnerSession | None:
        """Our reduction of part `key`, if we made one."""
        return next((s for s in self.reductions if key in s.keys), None)

    def release(self) -> None:
        """Free what our reductions kept for the checks, and the answers' payloads: the caller's
        result holds them (its kept updates, while kept), and with the reductions' payloads gone no
        defense can be made of them (`verify_streams`). This state outlives the round by the
        averager's `record_ttl_s`, so it kept every round's averaged update of that long."""
        for session in self.reductions:
            session.release()
        self.answers = {owner: replace(a, payloads={}) for owner, a in self.answers.items()}

    @property
    def statement_bytes(self) -> int:
        """The most bytes a commitment or answer statement of this round may take."""
        return statement_bound(len(self.layout), len(self.group.members))
