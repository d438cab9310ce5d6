"""The owner's side of a round: take the members' payloads of the parts it owns, reduce once, answer.

An owner collects contributions until all members have sent or `part_timeout_s` has passed since it
formed the group, reduces its parts once with `parts.reduce_parts` (screening out non-finite and
outlier payloads), encodes each average once with its codec, and answers every member that
contributed in time with the same bytes, the sorted list of contributors it included, how many of
each one's parts it rejected and, for the owner of the first tensor, the contributors' encoded
reports. It refuses a request whose group id differs from its own (another view of the members or
another tensor layout), from a non-member, with the wrong parts, or whose payloads are malformed or
not of the owner's shapes: `codecs.payload_shape` checks each as `decode` would, without decoding
it, so the owner decodes every payload once, when it reduces. The owner's own parts never touch the
wire.

    request  = v, r round, g group id, p sender, w weight, t tokens, k part keys, n part lengths,
               m encoded report (only to the owner of the first tensor, else nil)
    response = v, ok, e error text (when not ok), c contributors (sorted), k, n,
               gm contributors' reports (only from the owner of the first tensor),
               x {contributor: number of its parts rejected}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..algorithms.codecs import Codec, payload_shape
from ..algorithms.parts import reduce_parts
from ..algorithms.report import MAX_REPORT_BYTES
from .matchmaking import Group
from .wire import PROTOCOL_VERSION, Meter, read_frame, write_frame

logger = logging.getLogger(__name__)


def str_list(value: Any) -> list[str]:
    """`value` if it is a list of strings; ValueError otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Request:
    """One member's parts for one owner, as read off the stream (types checked)."""

    round: int
    group_id: bytes
    peer: str
    weight: float
    tokens: float
    payloads: dict[str, bytes]
    metadata: bytes | None

    @classmethod
    def parse(cls, header: dict[str, Any], body: list[bytes]) -> Request:
        keys = str_list(header.get("k"))
        round, group_id, peer = header.get("r"), header.get("g"), header.get("p")
        weight, tokens, metadata = header.get("w"), header.get("t"), header.get("m")
        if not (
            isinstance(round, int)
            and isinstance(group_id, bytes)
            and isinstance(peer, str)
            and isinstance(weight, (int, float))
            and isinstance(tokens, (int, float))
            and (metadata is None or isinstance(metadata, bytes))
            and len(keys) == len(body)
        ):
            raise ValueError("malformed request header")
        if metadata is not None and len(metadata) > MAX_REPORT_BYTES:
            metadata = b""  # relayed as an empty, hence malformed, report: every member drops it alike
        payloads = dict(zip(keys, body, strict=True))
        return cls(round, group_id, peer, float(weight), float(tokens), payloads, metadata)


@dataclass(frozen=True)
class Incoming:
    """One member's contribution to the parts of one owner."""

    weight: float
    tokens: float
    payloads: dict[str, bytes]
    metadata: bytes | None


@dataclass(frozen=True)
class Answer:
    """An owner's answer: the contributors it included, its averaged parts, their reports.

    `rejected`: contributor -> how many of its parts this owner screened out (none: absent).
    """

    contributors: tuple[str, ...]
    payloads: dict[str, bytes]
    metadata: tuple[bytes, ...] | None
    rejected: dict[str, int] = field(default_factory=dict)


_DROPPED = Incoming(0.0, 0.0, {}, None)


def reduce_owned(
    keys: list[str], contributions: Mapping[str, Incoming], codec: Codec, outlier_factor: float | None
) -> tuple[Answer, list[tuple[str, str, str]]]:
    """The owner's reduction over the contributors that arrived, and (part, peer, reason) rejections."""
    contributors = tuple(sorted(contributions))
    entries = [contributions[peer] for peer in contributors]
    reduced = reduce_parts(
        keys,
        contributors,
        lambda i, key: entries[i].payloads[key],
        [e.weight for e in entries],
        [e.tokens for e in entries],
        codec,
        outlier_factor=outlier_factor,
    )
    metadata = tuple(e.metadata or b"" for e in entries)
    return Answer(contributors, reduced.averaged, metadata, reduced.rejected), reduced.rejections


def shape_error(payloads: Mapping[str, bytes], shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why these payloads cannot be averaged with the owner's (None if they can).

    Reads headers and lengths only (`codecs.payload_shape`): cheap, and no value is decoded.
    """
    for key, payload in payloads.items():
        try:
            shape = payload_shape(payload)
        except ValueError as e:
            return f"{key}: {e}"
        if shape != shapes[key]:
            return f"{key}: shape {shape} instead of {shapes[key]}"
    return None


class OwnerSession:
    """The parts this peer owns in one group: collect contributions, reduce once, answer everyone."""

    def __init__(
        self,
        *,
        group: Group,
        keys: list[str],
        shapes: dict[str, tuple[int, ...]],
        codec: Codec,
        outlier_factor: float | None,
        with_metadata: bool,
        deadline: float,
    ) -> None:
        self.group = group
        self.keys = keys
        self.shapes = shapes
        self.codec = codec
        self.outlier_factor = outlier_factor
        self.with_metadata = with_metadata
        self.deadline = deadline
        self.contributions: dict[str, Incoming] = {}
        self.closed = False
        self.result: Answer | None = None
        self.done = asyncio.Event()
        self.idle = asyncio.Event()  # done, and every admitted member has been answered
        self._all_in = asyncio.Event()
        self._answering = 0

    def admit(self, peer: str, incoming: Incoming) -> bool:
        """Take a contribution; False once the session has closed or for a second one from `peer`."""
        if self.closed or peer in self.contributions:
            return False
        self.contributions[peer] = incoming
        self._answering += 1
        if len(self.contributions) == len(self.group.members):
            self._all_in.set()
        return True

    def answered(self) -> None:
        self._answering -= 1
        self._update_idle()

    async def run(self, executor: ThreadPoolExecutor) -> None:
        """Wait for the members (at most until the deadline), then reduce on `executor`."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._all_in.wait(), timeout=max(0.0, self.deadline - loop.time()))
        except asyncio.TimeoutError:
            missing = sorted(set(self.group.members) - set(self.contributions))
            logger.info("round %d: owner reduces without %s (part timeout)", self.group.round, missing)
        self.closed = True
        try:
            contributions = dict(self.contributions)
            self.result, rejections = await loop.run_in_executor(
                executor, reduce_owned, self.keys, contributions, self.codec, self.outlier_factor
            )
            for key, peer, reason in rejections:
                logger.warning(
                    "round %d: rejected part %r of %s: %s", self.group.round, key, peer[-8:], reason
                )
        except ValueError as e:
            logger.warning("round %d: reduction failed: %s", self.group.round, e)
        finally:
            self.contributions = {peer: _DROPPED for peer in self.contributions}  # free the payloads
            self.done.set()
            self._update_idle()

    def _update_idle(self) -> None:
        if self.done.is_set() and self._answering <= 0:
            self.idle.set()
            self.result = None  # everyone who needed it holds it; the round state outlives it


@dataclass
class RoundState:
    """This peer's part in one round, shared by its own `average` call and the stream handler."""

    group: Group
    session: OwnerSession | None
    meter: Meter = field(default_factory=Meter)


class OwnerHandler:
    """The stream handler members call: one request in, one answer (or refusal) out.

    `round_state(r)` resolves to this peer's state for round r once its own group is known (None if
    it has none); a request waits for it at most `wait_s`.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        round_state: Callable[[int], Awaitable[RoundState | None]],
        part_timeout_s: float,
        wait_s: float,
    ) -> None:
        self.peer_id = peer_id
        self._round_state = round_state
        self._part_timeout_s = part_timeout_s
        self._wait_s = wait_s

    async def serve(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Take one member's parts, answer with the averaged parts (or a refusal)."""
        meter = Meter()
        state: RoundState | None = None
        admitted: OwnerSession | None = None
        try:
            header, body = await asyncio.wait_for(read_frame(reader, meter), timeout=self._part_timeout_s)
            request = Request.parse(header, body)
            state = await asyncio.wait_for(self._round_state(request.round), timeout=self._wait_s)
            refusal = self._refusal(state, request)
            if refusal is None and state is not None and state.session is not None:
                incoming = Incoming(request.weight, request.tokens, request.payloads, request.metadata)
                if state.session.admit(request.peer, incoming):
                    admitted = state.session
                else:
                    refusal = "the owner has already reduced (too late) or got this member twice"
            if admitted is None:
                logger.debug("round %d: refused %s: %s", request.round, request.peer[-8:], refusal)
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": refusal}, [], meter)
                return
            await admitted.done.wait()
            await self._answer(writer, admitted, meter)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("averaging stream dropped: %r", e)
        finally:
            writer.close()
            if state is not None:
                state.meter.add(meter)
            if admitted is not None:
                admitted.answered()

    def _refusal(self, state: RoundState | None, request: Request) -> str | None:
        """Why this request cannot join our reduction (None if it can)."""
        if state is None:
            return "the owner is not in a group for this round"
        session = state.session
        if request.group_id != state.group.group_id:
            return "group mismatch (different view of the members, or a different tensor layout)"
        if request.peer not in state.group.members or request.peer == self.peer_id:
            return "not a member of the group"
        if session is None or list(request.payloads) != session.keys:
            return "these are not the parts this peer owns"
        if session.with_metadata and request.metadata is None:
            return "metadata missing"
        # On the event loop: the check is cheap, and on the reduction's executor it would queue
        # behind a running reduction.
        return shape_error(request.payloads, session.shapes)

    async def _answer(self, writer: asyncio.StreamWriter, session: OwnerSession, meter: Meter) -> None:
        result = session.result
        if result is None:
            header: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": False, "e": "the owner's reduction failed"}
            await write_frame(writer, header, [], meter)
            return
        header = {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "c": list(result.contributors),
            "k": session.keys,
            "gm": list(result.metadata) if session.with_metadata and result.metadata else None,
            "x": result.rejected,
        }
        await write_frame(writer, header, [result.payloads[k] for k in session.keys], meter)
