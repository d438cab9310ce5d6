"""The streams of a round's checks (verification.py): reveals, projections, defenses, accusations
and withdrawals, each one frame on the run's verification handler (`handler_name`), acknowledged.

`VerifyHandler` serves them: a frame is bounded, parsed and kept only from a member of the round's
group (`RoundState.mail`), or answered (`DEFEND`: an owner shows the payloads that prove a
contributor's projection false); `send_statement` and `ask_defense` are the sending side. A peer to
which no stream opens has left the round (`Mailbox.lost`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from hivemind.p2p import P2P, PeerID

from .admission import Admission
from .checks import Shown, agree_all, statements_of
from .owner import RoundState
from .statements import (
    PROJECT,
    REVEAL,
    AnswerStatement,
    Projections,
    Receipt,
    Reveal,
    Signed,
    dropped_after_receipt,
)
from .wire import PROTOCOL_VERSION, Meter, read_chunks, read_frame, write_chunks, write_frame

logger = logging.getLogger(__name__)


ACK_HEADER_BYTES = 256


def handler_name(prefix: str) -> str:
    """The stream handler a run's reveals and projections travel on."""
    return f"adloco.verify.v{PROTOCOL_VERSION}.{hashlib.sha256(prefix.encode()).hexdigest()[:24]}"


ACCUSE = "accuse"
"""A member an owner dropped after signing the receipt of its parts passes on the receipt and the
owner's answer statement: two signatures of the owner that prove it (`statements.Receipt`)."""
WITHDRAW = "withdraw"
"""A member that leaves a round it was grouped in before it has checked it (its exchange failed: an
owner broke, or answered nothing in time) says so to the others, with whom it could not reach, so
they do not wait out the budget for its reveal (unsigned: the stream names its sender)."""
WITHDRAW_CHARS = 200  # the most characters of a withdrawal's reason
RESEND_S = 0.5  # a statement whose stream broke once open is sent again this much later, once
DEFEND = "defend"
"""A member whose projection check of an owner's part failed asks the owner which contributors'
projections (or inner products with the answer) were false; the owner answers with their payloads,
which prove it (`defend`)."""


class VerifyHandler:
    """The stream handler for reveals, projections and defenses: one request per stream, from a
    member of the round's group, parsed and bounded before it is kept (`RoundState.mail`) or
    answered (`_defend`)."""

    def __init__(
        self,
        *,
        round_state: Callable[[int, str], Awaitable[RoundState | None]],
        wait_s: float,
        chunk_bytes: int,
        executor: Executor,
        admission: Admission | None = None,
        on_evidence: Callable[[str, str], None] = lambda peer, why: None,
        on_dropped: Callable[[RoundState, str], None] = lambda state, member: None,
    ) -> None:
        self._on_evidence = on_evidence  # a peer proven to have lied, and why
        self._on_dropped = on_dropped  # a member an owner was proven to have left out of a round
        self._round_state = round_state
        self._wait_s = wait_s
        self._chunk_bytes = chunk_bytes
        self._executor = executor
        self._admission = admission or Admission()

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        meter = Meter()
        try:
            remote = str(info.peer_id.to_base58())
            if not await self._admission.select_async([remote]):
                return
            header, _ = await asyncio.wait_for(
                read_frame(reader, meter, max_header=MAX_FRAME_BYTES, max_body=0), timeout=self._wait_s
            )
            round, kind = header.get("r"), header.get("k")
            if type(round) is not int or kind not in (REVEAL, PROJECT, DEFEND, ACCUSE, WITHDRAW):
                raise ValueError("malformed verification frame")
            state = await asyncio.wait_for(self._round_state(round, remote), timeout=self._wait_s)
            if state is None or remote not in state.group.members:
                raise ValueError("not a member of this peer's group for that round")
            if kind == DEFEND:
                await self._defend(header, state, writer, meter)
            elif kind == WITHDRAW:
                why, blamed, revealed = _withdrawal(header.get("s"), state.group.members)
                state.mail.withdrew(remote, why, blamed, revealed)
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True}, [], meter)
            elif kind == ACCUSE:
                self._accusation(header, state)
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True}, [], meter)
            else:
                statement = self._statement(header, kind, state)
                if statement.peer != remote:
                    raise ValueError("a statement of another peer than the stream's")
                state.mail.put(kind, statement)
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True}, [], meter)
            # Every byte of these streams is the checks' (the payloads an owner shows included).
            meter.checks_sent, meter.checks_received = meter.wire_sent, meter.wire_received
            state.meter.add(meter)
        except (ValueError, OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.debug("verification stream refused: %r", e)
        finally:
            writer.close()

    def _accusation(self, header: dict[str, Any], state: RoundState) -> None:
        """An owner's receipt and its answer statement that leaves the member out: convict the owner
        if its two signatures say so (ValueError for anything else)."""
        pair = header.get("s")
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError("an accusation is a receipt and an answer statement")
        group = state.group
        receipt = Receipt.parse(
            Signed.from_wire(pair[0], max_body=state.statement_bytes),
            state.ring,
            round=group.round,
            group_id=group.group_id,
        )
        statement = AnswerStatement.parse(
            Signed.from_wire(pair[1], max_body=state.statement_bytes),
            state.ring,
            round=group.round,
            group_id=group.group_id,
            members=len(group.members),
            parts=len(state.layout),
        )
        if not dropped_after_receipt(receipt, statement):
            raise ValueError("the statements do not show the owner dropping the member")
        if receipt.member in group.members:  # a name the owner signed, not necessarily a member's
            state.mail.dropped.add(receipt.member)
            self._on_dropped(state, receipt.member)
        self._on_evidence(receipt.owner, f"dropped {receipt.member[-8:]}'s parts after signing their receipt")

    def _statement(self, header: dict[str, Any], kind: str, state: RoundState) -> Reveal | Projections:
        group = state.group
        members = len(group.members)
        signed = Signed.from_wire(header.get("s"), max_body=members * state.statement_bytes + 4096)
        if kind == REVEAL:
            return Reveal.parse(
                signed,
                state.ring,
                round=group.round,
                group_id=group.group_id,
                owners=members,
                max_answer=state.statement_bytes,
            )
        return Projections.parse(
            signed,
            state.ring,
            round=group.round,
            group_id=group.group_id,
            parts=len(state.layout),
            members=members,
        )

    async def _defend(
        self, header: dict[str, Any], state: RoundState, writer: asyncio.StreamWriter, meter: Meter
    ) -> None:
        """Answer a member whose check of our part failed: the payloads of the contributors whose
        projections or inner products with our answer (as the member holds them, signed) are not
        those of the payloads they committed to. Refused when we hold no such reduction any more
        (the checks are over) or no seed."""
        key = header.get("key")
        listed = header.get("s")
        session = state.reduction_of(key) if isinstance(key, str) else None
        # Our answer of the part as every member holds it (the session frees its own once sent).
        answer = (
            next((a.payloads[key] for a in state.answers.values() if key in a.payloads), None)
            if isinstance(key, str)
            else None
        )
        if (
            not isinstance(key, str)
            or session is None
            or not session.kept
            or answer is None
            or state.seed is None
            or not isinstance(listed, list)
        ):
            await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False}, [], meter)
            return
        if len(listed) > len(state.group.members):
            raise ValueError("more projections than members")
        group, seed, at = state.group, state.seed, state.layout[key]
        claimed: dict[str, Shown] = {}
        for wire in listed:
            held = Projections.parse(
                Signed.from_wire(wire, max_body=state.statement_bytes),
                state.ring,
                round=group.round,
                group_id=group.group_id,
                parts=len(state.layout),
                members=len(group.members),
            )
            if held.seed == seed and held.peer in session.kept:
                claimed[held.peer] = (held.values[at], held.dots[at])
        loop = asyncio.get_running_loop()
        payloads = {peer: session.kept[peer][key] for peer in claimed}
        true = await loop.run_in_executor(self._executor, statements_of, payloads, answer, seed, key)
        false = sorted(p for p in claimed if not agree_all(true[p], claimed[p]))
        body = [payloads[p] for p in false]
        await write_frame(
            writer, {"v": PROTOCOL_VERSION, "ok": True, "p": false, "s": [len(b) for b in body]}, [], meter
        )
        await write_chunks(writer, body, self._chunk_bytes, meter)


def _withdrawal(body: Any, members: Sequence[str]) -> tuple[str, list[str], bool]:
    """A withdrawal's reason, the members it could not reach, and whether its sender had revealed
    (ValueError if malformed)."""
    if not isinstance(body, list) or len(body) != 3 or not isinstance(body[0], str):
        raise ValueError("a withdrawal is a reason, the members it could not reach and whether it revealed")
    blamed, revealed = body[1], body[2]
    if not isinstance(blamed, list) or len(blamed) > len(members) or not set(blamed) <= set(members):
        raise ValueError("a withdrawal may name only members of the group")
    if not isinstance(revealed, bool):
        raise ValueError("a withdrawal says whether its sender revealed, true or false")
    return body[0][:WITHDRAW_CHARS], [str(p) for p in blamed], revealed


async def ask_defense(
    p2p: P2P,
    handler: str,
    owner: str,
    *,
    round: int,
    key: str,
    projections: Sequence[Signed],
    size: int,
    timeout_s: float,
    meter: Meter,
) -> dict[str, bytes]:
    """Ask `owner` which of `projections` (of part `key`) are false; the payloads it shows, each at
    most `size` bytes (every contribution of a part is that size), by contributor. Empty when it
    shows none, refuses or does not answer within `timeout_s`."""

    async def ask() -> dict[str, bytes]:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(owner), handler)
        mine = Meter()
        try:
            return await exchange(reader, writer, mine)
        finally:
            writer.close()
            mine.checks_sent, mine.checks_received = mine.wire_sent, mine.wire_received
            meter.add(mine)

    async def exchange(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mine: Meter
    ) -> dict[str, bytes]:
        request = {"v": PROTOCOL_VERSION, "r": round, "k": DEFEND, "key": key}
        await write_frame(writer, {**request, "s": [p.to_wire() for p in projections]}, [], mine)
        reply, _ = await read_frame(reader, mine, max_header=MAX_FRAME_BYTES, max_body=0)
        peers, sizes = reply.get("p"), reply.get("s")
        if not reply.get("ok") or not isinstance(peers, list) or not isinstance(sizes, list):
            return {}
        if len(peers) != len(sizes) or len(peers) > len(projections):
            return {}
        if not all(isinstance(p, str) for p in peers) or not all(
            type(n) is int and 0 <= n <= size for n in sizes
        ):
            return {}
        body = await read_chunks(reader, sizes, mine)
        return dict(zip(peers, body, strict=True))

    try:
        return await asyncio.wait_for(ask(), timeout=timeout_s)
    except Exception as e:
        logger.debug("asking %s to show the false projections failed: %r", owner[-8:], e)
        return {}


MAX_FRAME_BYTES = 64 << 20
"""The most a reveal or projection frame may take before its round is known (a reveal carries every
owner's answer statement); each is then bounded by its round's layout and group."""


async def send_statement(
    p2p: P2P,
    handler: str,
    peer: str,
    *,
    round: int,
    kind: str,
    signed: Signed | list[Any],
    timeout_s: float,
    meter: Meter,
    on_unreachable: Callable[[], None] | None = None,
) -> bool:
    """Send one statement (or, for an accusation, the wire forms of two; for a withdrawal, its
    reason and whom it blames) to `peer`; whether it acknowledged it within `timeout_s`. Its bytes
    count in `meter`. `on_unreachable` is called when no stream to `peer` could be opened at all
    (refused, not timed out: the peer is gone)."""
    wire = signed.to_wire() if isinstance(signed, Signed) else signed

    async def send() -> bool:
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise _Unreachable() from e
        mine = Meter()
        try:
            await write_frame(writer, {"v": PROTOCOL_VERSION, "r": round, "k": kind, "s": wire}, [], mine)
            ack, _ = await read_frame(reader, mine, max_header=ACK_HEADER_BYTES, max_body=0)
            return bool(ack.get("ok"))
        finally:
            writer.close()
            mine.checks_sent, mine.checks_received = mine.wire_sent, mine.wire_received
            meter.add(mine)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for attempt in range(2):
        try:
            return await asyncio.wait_for(send(), timeout=max(0.0, deadline - loop.time()))
        except _Unreachable as e:
            logger.debug("sending a %s to %s: unreachable: %r", kind, peer[-8:], e.__cause__)
            if on_unreachable is not None:
                on_unreachable()
            return False
        except Exception as e:
            logger.debug("sending a %s to %s failed: %r", kind, peer[-8:], e)
            if isinstance(e, asyncio.TimeoutError) or attempt == 1:
                return False
        # The stream broke once open: the peer may have died after it opened (an owner killed
        # just after its last answer, say); whether a new one opens tells.
        await asyncio.sleep(min(RESEND_S, max(0.0, deadline - loop.time())))
    return False


class _Unreachable(Exception):
    """No stream to the peer could be opened."""
