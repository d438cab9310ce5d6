"""The owner's stream: a member's request, its parts and the answer, on one stream (owner.py has the
reduction).

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
in (it died mid-send), is dropped from the round: the owner no longer waits for it. On the wire:

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
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..algorithms.report import MAX_REPORT_BYTES
from .admission import NOT_ADMITTED, Admission
from .owner import BAN_S, Incoming, OwnerSession, RoundState, shape_error, size_list, str_list
from .statements import (
    BadStatement,
    Commitment,
    Receipt,
    Signed,
    Signer,
    digest,
)
from .wire import PROTOCOL_VERSION, Meter, read_chunks, read_frame, write_chunks, write_frame

logger = logging.getLogger(__name__)


REQUEST_HEADER_BYTES = 1 << 20
"""The most a request header may take (read before its round is known): a commitment lists ~45
bytes per part, so this holds ~20,000 parts."""


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

    `round_state(r, peer)` resolves to this peer's state for round r, named by `peer`'s stream, once
    its own group is known (None if it has none); a request waits for it at most `wait_s`. A request
    header must arrive within `header_timeout_s`; the payloads must be in by the session's deadline;
    the answer is written within the session's `answer_timeout_s`. Answers go out in chunks of
    `chunk_bytes`.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        round_state: Callable[[int, str], Awaitable[RoundState | None]],
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
            state = await asyncio.wait_for(self._round_state(request.round, remote), timeout=self._wait_s)
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
