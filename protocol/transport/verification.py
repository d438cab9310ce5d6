"""A member's check of a round's answers before it applies them (protocol/algorithms/verify.py).

Once every owner has answered (`member.assemble`), `verify_round`:

1. checks each owner's signed statement against the commitments it names: the same commitment of
   each contributor in every answer (else that contributor equivocated), the rules the round runs
   under, the screening recomputed from the committed norms, a rejection of this member's own
   payload as not matching its commitment (it does), exclusions by a scorer only where the run
   scores and alike in every part, the relayed reports against their commitments;
2. sends its reveal (every answer statement it holds, its secret) to every other member of the
   round and waits for theirs: an owner that sent another member a different answer is caught by
   its two signed statements, and a secret must match its commitment. The seed is drawn from the
   secrets of the round's *seeders* (`trust.seeders`: its owners, or every member where fewer than
   two own parts): a seeder that reveals nothing fails the round for everyone; any other member's
   reveal is waited for a grace only (`trust.GRACE_S`, not at all for one that missed it last time), so a
   key that did no work and withholds its reveal costs the round nothing;
3. derives the round's seed, projects its own payloads on it and sends the projections to every
   other member, with the inner products of its payloads with the CenteredClip answers they went
   into; checks every part it did not reduce itself: exactly where the answer needs no projection,
   against the norm its contributions allow, and by projection for the mean and for CenteredClip
   as the weighted mean its clip factors make it (`verify.check_mean`, a missing projection
   widening the check by what it could have been: the seeders' projections are waited for within
   the budget, the others' for a grace), whose factors it checks against the distances the inner
   products give (`verify.check_clip`).

A member that leaves the round before it has checked it (its exchange with an owner broke, or an
owner answered nothing) says so to the others (`WITHDRAW`, with whom it blames), and a member to
which no stream opens when this member sends it a statement has left too (`Mailbox.lost`: dead, or
gone from the network): nobody waits for their reveals or projections. A seeder gone before its
secret reached this member fails the round at once (`Caught.gone`), naming it where this member
could not reach it, and a withdrawn one (with whom it blamed) unless this member found some peer
of the round unreachable itself, which bears the withdrawal out (issue 26: an owner that died with
some members holding its answer and others not cost the survivors the whole reveal budget, ~45 s).

Any failure raises `Caught` naming the peers at fault: with `proven` when this member holds their
signed statements that show it (an equivocation, a screening its own commitments contradict), else
on its own observation (a silence, a mean that failed its projection: a contributor colluding with
the owner could have sent a false projection to frame it, which its committed norm bounds). The
statements of both later phases travel on their own stream handler (`VerifyHandler`): one frame,
acknowledged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID

from ..algorithms import verify
from ..algorithms.codecs import decode, error_bound, payload_codec, sum_count
from ..algorithms.parts import MIN_OUTLIER_GROUP, MISMATCH, SCORED, Aggregate, Clip, tensor_norm
from ..algorithms.trust import grace_s
from ..algorithms.trust import seeders as seeders_of
from ..algorithms.verify import Claim, Misanswer, Misprojection
from .admission import Admission
from .evidence import Evidence
from .matchmaking import Caught
from .owner import Answer, RoundState
from .statements import (
    ANSWER,
    COMMIT,
    PROJECT,
    REVEAL,
    AnswerStatement,
    BadStatement,
    Commitment,
    Mailbox,
    Projections,
    Receipt,
    Reveal,
    Signed,
    Signer,
    digest,
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
        round_state: Callable[[int], Awaitable[RoundState | None]],
        wait_s: float,
        chunk_bytes: int,
        executor: Executor,
        admission: Admission | None = None,
        on_evidence: Callable[[str, str], None] = lambda peer, why: None,
    ) -> None:
        self._on_evidence = on_evidence  # a peer proven to have lied, and why
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
            state = await asyncio.wait_for(self._round_state(round), timeout=self._wait_s)
            if state is None or remote not in state.group.members:
                raise ValueError("not a member of this peer's group for that round")
            if kind == DEFEND:
                await self._defend(header, state, writer, meter)
            elif kind == WITHDRAW:
                why, blamed = _withdrawal(header.get("s"), state.group.members)
                state.mail.withdrew(remote, why, blamed)
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
        answer = next((a.payloads[key] for a in state.answers.values() if key in a.payloads), None)
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
        true = await loop.run_in_executor(self._executor, _statements_of, payloads, answer, seed, key)
        false = sorted(p for p in claimed if not _agree_all(true[p], claimed[p]))
        body = [payloads[p] for p in false]
        await write_frame(
            writer, {"v": PROTOCOL_VERSION, "ok": True, "p": false, "s": [len(b) for b in body]}, [], meter
        )
        await write_chunks(writer, body, self._chunk_bytes, meter)


Shown = tuple[float, float | None]
"""What a contributor said of its payload of one part: its projection, and its inner product with
the part's answer (None where it sent none)."""


def _withdrawal(body: Any, members: Sequence[str]) -> tuple[str, list[str]]:
    """A withdrawal's reason and the members it could not reach (ValueError if malformed)."""
    if not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], str):
        raise ValueError("a withdrawal is a reason and the members it could not reach")
    blamed = body[1]
    if not isinstance(blamed, list) or len(blamed) > len(members) or not set(blamed) <= set(members):
        raise ValueError("a withdrawal may name only members of the group")
    return body[0][:WITHDRAW_CHARS], [str(p) for p in blamed]


def _statements_of(payloads: Mapping[str, bytes], answer: bytes, seed: bytes, key: str) -> dict[str, Shown]:
    """What each of `payloads` truly gives: its projection and its inner product with `answer`."""
    decoded = decode(answer)
    true: dict[str, Shown] = {}
    for peer, payload in payloads.items():
        values = decode(payload)
        true[peer] = (verify.project(values, seed, key), verify.inner(values, decoded))
    return true


def _agree_all(true: Shown, claimed: Shown) -> bool:
    """Whether a contributor's claims are what its payload gives (an inner product it did not send
    claims nothing)."""
    return _agree(true[0], claimed[0]) and (claimed[1] is None or _agree(true[1] or 0.0, claimed[1]))


def _agree(a: float, b: float) -> bool:
    """Two float64 projections of the same payload on the same direction (another machine's
    summation order moves them by ~1e-16 relative)."""
    return abs(a - b) <= 1e-9 * (abs(a) + abs(b)) + 1e-300


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


@dataclass(frozen=True)
class Settings:
    """The rules a member expects every owner of its round to have reduced under. `scoring`:
    whether the run scores contributions (`--score`): without it an owner has no scorer to leave a
    contributor out by."""

    aggregate: Aggregate
    outlier_factor: float | None
    work_cap: float | None
    scoring: bool = False


@dataclass
class Part:
    """One part to check: its owner's answer and what the commitments say of its contributions.
    `factors`: the answer's as a weighted mean (the mean's, or what its `clip` statement makes of
    them: `verify.stated_factors`); `mean`: the mean's, which a clip statement is checked with."""

    key: str
    owner: str
    payload: bytes
    claims: list[Claim]
    contributors: list[str]
    factors: list[tuple[int, float]] | None
    clip: Clip | None = None
    mean: list[tuple[int, float]] | None = None
    scale: float = 0.0  # CenteredClip's c: τ is c × the median distance


def _fail(culprit: str, why: str, *, proven: bool, evidence: Evidence | None = None) -> Caught:
    """`culprit` caught for `why`; `evidence`: its statements that prove it to anyone (`evidence`)."""
    caught = Caught(f"{culprit[-8:]}: {why}", {culprit: why}, proven=proven)
    caught.evidence = [] if evidence is None else [evidence]
    return caught


def check_statements(
    answers: Mapping[str, Answer],
    *,
    layout: Mapping[str, int],
    own: Commitment,
    settings: Settings,
) -> dict[str, Commitment]:
    """Step 1 of the module doc for every answer (keyed by the owner whose parts it holds); the
    round's commitments by contributor. Caught for a contradiction (proven), and for an answer
    reduced under other rules than this peer's: proven for another rule or outlier factor (the run's
    flags: the owner signed that it does not follow them; such a peer, hostile or misconfigured,
    failed every round it owned parts in, for everyone), on this peer's word for another work cap
    (the round's schedule as the owner saw it)."""
    commitments: dict[str, Commitment] = {}
    for slot, answer in answers.items():
        statement = answer.statement
        if statement is None:
            raise _fail(slot, "answered without a signed statement", proven=False)
        reducer = statement.owner
        flags = (statement.rule, statement.outlier_factor) != (
            str(settings.aggregate),
            settings.outlier_factor,
        )
        if flags or statement.work_cap != settings.work_cap:
            why = (
                f"reduced under {statement.rule}, outlier factor {statement.outlier_factor}, work cap"
                f" {statement.work_cap}; this peer runs {settings.aggregate}, {settings.outlier_factor},"
                f" {settings.work_cap}"
            )
            raise _fail(reducer, why, proven=flags)
        for commitment in answer.commitments:
            held = commitments.setdefault(commitment.peer, commitment)
            if held.signed.body != commitment.signed.body:
                raise _fail(
                    commitment.peer,
                    "committed to different contributions with different owners",
                    proven=True,
                    evidence=Evidence.equivocated(COMMIT, held.signed, commitment.signed),
                )
        if statement.reports and answer.metadata is not None:  # the reducer relays the reports
            for commitment, report in zip(answer.commitments, answer.metadata, strict=True):
                # An empty report is one elided for its size (`owner.Request`): dropped alike.
                if report and digest(report) != commitment.report:
                    raise _fail(reducer, f"relayed another report of {commitment.peer[-8:]}", proven=True)
        scored = [frozenset(i for i, code in codes.items() if code == SCORED) for codes in statement.codes]
        if any(scored) and not settings.scoring:
            raise _fail(reducer, "left contributors out by a scorer this run does not run", proven=True)
        if len(set(scored)) > 1:  # a scorer judges a contributor over all the owner's parts at once
            raise _fail(reducer, "its scorer left out different contributors in different parts", proven=True)
        if own.peer in answer.contributors:
            mine = answer.contributors.index(own.peer)
            for key, codes in zip(statement.keys, statement.codes, strict=True):
                if codes.get(mine) == MISMATCH:
                    raise _fail(reducer, f"rejected our {key!r} as unlike our commitment", proven=True)
    return commitments


def parts_to_check(
    answers: Mapping[str, Answer],
    *,
    layout: Mapping[str, int],
    settings: Settings,
    skip: set[str],
) -> list[Part]:
    """The parts of the answers not reduced by a peer in `skip` (this one), with the factors their
    statements imply; Caught (proven) when a screening contradicts the committed norms."""
    parts = []
    for answer in answers.values():
        statement = answer.statement
        assert statement is not None
        reducer = statement.owner
        if reducer in skip:
            continue
        for key, codes, clip in zip(statement.keys, statement.codes, statement.clips, strict=True):
            at = layout[key]
            claims = [Claim(c.weight, c.tokens, c.norms[at], c.digests[at]) for c in answer.commitments]
            try:
                mean = verify.expected_factors(
                    claims, codes, outlier_factor=settings.outlier_factor, work_cap=settings.work_cap
                )
                factors = verify.stated_factors(clip, mean, settings.aggregate)
            except Misanswer as e:
                raise _fail(reducer, f"{key!r}: {e}", proven=True) from e
            contributors = list(answer.contributors)
            scale = settings.aggregate.param
            parts.append(
                Part(key, reducer, answer.payloads[key], claims, contributors, factors, clip, mean, scale)
            )
    return parts


@dataclass
class Checked:
    """What checking one part's answer left to do once the projections are in: nothing (`tolerance`
    None), or `verify.check_mean` with the answer's projection, and for a clip statement
    `verify.check_clip` with the answer's norm and rounding."""

    part: Part
    tolerance: float | None = None
    projection: float = 0.0
    norm: float = 0.0
    rounding: float = 0.0


def check_part(part: Part, seed: bytes, settings: Settings) -> Checked:
    """Everything about one part's answer that needs no other member's projection (on an executor:
    it decodes the answer); Caught (proven) when the answer is wrong on its face."""
    try:
        codec = payload_codec(part.payload)
        if codec == "sum" and len(part.contributors) < sum_count(part.payload):
            raise Misanswer("a sum of more payloads than contributors")
        decoded = decode(part.payload)
        if verify.check_exact(part.payload, decoded, part.claims, part.factors):
            return Checked(part)
        assert part.factors is not None
        # A weighted mean: the mean, CenteredClip with its factors, any rule below its minimum.
        weighted = (
            settings.aggregate.rule == "mean"
            or part.clip is not None
            or len(part.factors) < MIN_OUTLIER_GROUP
        )
        rule = Aggregate() if weighted else settings.aggregate
        verify.check_bound(decoded, part.payload, part.claims, part.factors, rule)
        if not weighted:
            return Checked(part)
        tolerance = verify.mean_tolerance(part.payload, decoded, part.claims, part.factors)
        bound = error_bound(part.payload, decoded)
        if tolerance is None or bound is None:
            return Checked(part)
        projection = verify.project(decoded, seed, part.key)
        return Checked(part, tolerance, projection, tensor_norm(decoded), bound.l2)
    except ValueError as e:  # Misanswer, or an answer no honest encoder makes
        raise _fail(part.owner, f"{part.key!r}: {e}", proven=True) from e


def own_projections(payloads: Mapping[str, bytes], layout: Sequence[str], seed: bytes) -> list[float]:
    """This member's projections of its payloads, in the layout's order (on an executor)."""
    return [verify.project_payload(payloads[key], seed, key) for key in layout]


def own_dots(
    payloads: Mapping[str, bytes], layout: Sequence[str], clipped: Mapping[str, bytes]
) -> list[float | None]:
    """This member's inner products <x, a> of its payloads with the CenteredClip answers `clipped`
    (part -> answer) they went into, in the layout's order, None for the other parts (on an
    executor)."""
    dots: list[float | None] = []
    for key in layout:
        dots.append(None if key not in clipped else verify.inner(decode(payloads[key]), decode(clipped[key])))
    return dots


def clipped_answers(answers: Mapping[str, Answer], peer_id: str) -> dict[str, bytes]:
    """The answers of the parts where a clip statement gives `peer_id`'s payload a factor."""
    clipped = {}
    for answer in answers.values():
        statement = answer.statement
        if statement is None or peer_id not in statement.contributors:
            continue
        mine = statement.contributors.index(peer_id)
        for key, clip in zip(statement.keys, statement.clips, strict=True):
            if clip is not None and mine in clip.rhos:
                clipped[key] = answer.payloads[key]
    return clipped


def finish_check(
    checked: Checked,
    projections: Mapping[str, Projections],
    layout: Mapping[str, int],
    shown: Mapping[str, Shown] | None = None,
) -> None:
    """`verify.check_mean` of one part with the projections in hand, and `verify.check_clip` of its
    clip statement with the inner products (`shown`: what the payloads the owner showed truly give,
    in place of their contributors' false word); Caught when it fails (on this member's word: the
    owner, or a contributor that framed it, until the owner shows which)."""
    part = checked.part
    if checked.tolerance is None or part.factors is None:
        return
    at = layout[part.key]
    values: dict[int, float | None] = {}
    dots: dict[int, float | None] = {}
    for i, _ in part.factors:  # the accepted payloads: a rejected one's projection plays no part
        peer = part.contributors[i]
        held = projections.get(peer)
        values[i], dots[i] = (None, None) if held is None else (held.values[at], held.dots[at])
        if shown and peer in shown:
            values[i], dots[i] = shown[peer]
        try:
            if values[i] is not None:
                verify.check_projection(values[i] or 0.0, part.claims[i])
            if dots[i] is not None:
                verify.check_dot(dots[i] or 0.0, part.claims[i], checked.norm)
        except Misprojection as e:
            raise _fail(peer, f"{part.key!r}: {e}", proven=True) from e
    try:
        verify.check_mean(checked.projection, values, part.claims, part.factors, checked.tolerance)
        if part.clip is not None and part.mean is not None:
            verify.check_clip(
                part.clip,
                part.claims,
                part.mean,
                part.scale,
                answer_norm=checked.norm,
                rounding=checked.rounding,
                dots=dots,
            )
    except Misanswer as e:
        raise _fail(part.owner, f"{part.key!r}: {e}", proven=False) from e


async def verify_round(
    *,
    state: RoundState,
    answers: Mapping[str, Answer],
    members: Sequence[str],
    peer_id: str,
    own: Commitment,
    secret: bytes,
    payloads: Mapping[str, bytes],
    settings: Settings,
    signer: Signer,
    send: Callable[[str, str, Signed], None],
    defend: Callable[[str, str, list[Signed]], Awaitable[dict[str, bytes]]],
    executor: Executor,
    budget_s: float,
    reveal_by: float,
    laggards: set[str] | None = None,
) -> dict[str, str]:
    """The module doc's three steps for one round; returns when every answer checked out, with the
    contributors an owner showed to have sent false projections (the round still checks out with
    their true ones), and why. `reveal_by`: the loop time by which every member that is still
    within its exchange budget has sent its reveal (the group's formation plus that budget, plus
    `budget_s`); the wait for the reveals ends there, for secrets relayed by others `budget_s` later.

    `answers`: each answer keyed by the owner whose parts it holds (reduced by it, by a stand-in,
    or by this peer);
    `members`: the round's members (those every owner admitted), who reveal and project;
    `payloads`: this member's own; `send(peer, kind, signed)` starts delivering a statement;
    `defend(owner, key, projections)` asks an owner whose part failed its check which of those
    projections were false (`ask_defense`);
    `laggards`: the members other than seeders whose reveal missed its grace in an earlier round
    (this peer's own memory, updated here to those that missed it in this one): they are not
    waited for.
    """
    loop = asyncio.get_running_loop()
    layout = state.layout
    group = state.group
    commitments = check_statements(answers, layout=layout, own=own, settings=settings)
    state.commitments = commitments  # the weights the members' work is counted by (`trust`)
    statements = {slot: a.statement for slot, a in answers.items() if a.statement is not None}
    reducers = sorted(statements)  # the owners' slots, in the order every member sees them
    reveal = Reveal.make(
        signer,
        round=group.round,
        group_id=group.group_id,
        answers=[statements[r].signed for r in reducers],
        secret=secret,
    )
    others = [m for m in members if m != peer_id]
    for peer in others:
        send(peer, REVEAL, reveal.signed)
    mail = state.mail
    seeders = seeders_of(members, group.owners)
    laggards = set() if laggards is None else laggards
    waited = [m for m in others if m in seeders or m not in laggards]
    secrets = await _gather_secrets(
        mail, commitments, statements, state, waited, peer_id, secret, reveal_by, budget_s, seeders
    )
    for peer in others:  # a seeder revealed (to someone): the round would have failed otherwise
        (laggards.discard if peer in mail.reveals or peer in seeders else laggards.add)(peer)
    seed = verify.round_seed(
        group.group_id,
        [secrets[m] for m in seeders],
        [statements[r].signed.digest for r in reducers],
    )
    state.seed = seed  # for the owners' defense of their parts (`VerifyHandler._defend`)
    # Our projections and the checks of the answers run side by side (the executor has two threads).
    ours = loop.run_in_executor(executor, own_projections, payloads, list(layout), seed)
    clipped = clipped_answers(answers, peer_id)
    dots = loop.run_in_executor(executor, own_dots, payloads, list(layout), clipped) if clipped else None
    parts = parts_to_check(answers, layout=layout, settings=settings, skip={peer_id})
    checks = [loop.run_in_executor(executor, check_part, part, seed, settings) for part in parts]
    mine = await ours
    projected = Projections.make(
        signer,
        round=group.round,
        group_id=group.group_id,
        seed=seed,
        values=mine,
        secrets=[[m, secrets[m]] for m in seeders],
        dots=[None] * len(mine) if dots is None else await dots,
    )
    for peer in others:
        send(peer, PROJECT, projected.signed)
    checked = []
    for outcome in await asyncio.gather(*checks, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
        checked.append(outcome)
    wanted = {
        c.part.contributors[i] for c in checked if c.tolerance is not None for i, _ in c.part.factors or []
    } - {peer_id}
    needed = wanted & set(seeders)
    await _wait_graced(
        mail,
        lambda: needed <= set(mail.projections) | set(mail.gone),
        lambda: wanted - laggards <= set(mail.projections) | set(mail.gone),
        max(loop.time(), reveal_by) + budget_s,
    )
    _check_equivocations(mail)
    held = {p: s for p, s in mail.projections.items() if s.seed == seed}
    held[peer_id] = projected
    failed: list[Checked] = []
    for c in checked:
        try:
            finish_check(c, held, layout)
        except Caught as e:
            if e.proven:
                raise
            failed.append(c)
    liars: dict[str, str] = {}
    for c in failed:
        # A contributor may have sent a false projection to frame the owner: the owner holds the
        # payloads, and shows the false ones (`VerifyHandler._defend`); failing that, it is blamed.
        part = c.part
        accepted = [part.contributors[i] for i, _ in part.factors or []]
        listed = [held[p].signed for p in accepted if p in held]
        shown = await defend(part.owner, part.key, listed)
        true = await loop.run_in_executor(executor, _shown, shown, part, held, seed, layout)
        for peer, (value, claimed) in true.items():
            liars[peer] = f"{part.key!r}: said {claimed}, its payload gives {value}"
        finish_check(c, held, layout, {p: v for p, (v, _) in true.items()})
    return liars


def _shown(
    shown: Mapping[str, bytes],
    part: Part,
    held: Mapping[str, Projections],
    seed: bytes,
    layout: Mapping[str, int],
) -> dict[str, tuple[Shown, Shown]]:
    """The payloads an owner showed that prove their contributors' projections or inner products
    with the answer false: (true, claimed) by contributor. One that is not the committed payload, or
    that gives what its contributor said, proves nothing and is ignored."""
    at = layout[part.key]
    offered = {}
    for peer, payload in shown.items():
        if peer not in part.contributors or peer not in held:
            continue
        if verify.payload_digest(payload) == part.claims[part.contributors.index(peer)].digest:
            offered[peer] = payload
    proven = {}
    for peer, value in _statements_of(offered, part.payload, seed, part.key).items():
        claimed = (held[peer].values[at], held[peer].dots[at])
        if not _agree_all(value, claimed):
            proven[peer] = (value, claimed)
    return proven


async def _wait_graced(
    mail: Mailbox, needed: Callable[[], bool], wanted: Callable[[], bool], deadline: float
) -> None:
    """Wait for `needed()` until `deadline`, then for `wanted()` a grace longer
    (`trust.grace_s` of what `needed` took), within `deadline`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await mail.wait(needed, deadline)
    took = loop.time() - start
    await mail.wait(wanted, min(deadline, loop.time() + grace_s(took)))


async def _gather_secrets(
    mail: Mailbox,
    commitments: Mapping[str, Commitment],
    statements: Mapping[str, AnswerStatement],
    state: RoundState,
    others: Sequence[str],
    peer_id: str,
    secret: bytes,
    reveal_by: float,
    budget_s: float,
    seeders: Sequence[str],
) -> dict[str, bytes]:
    """The seeders' secrets, each matching its commitment: from its reveal (whose answers must be
    ours), or relayed in another member's projections (a member may reveal to some members only:
    what one honest member holds, all then hold). Caught when one is missing `budget_s` after
    `reveal_by`: nobody revealed it, or nobody passed it on in time. The reveals of `others` that
    are not seeders are waited for a grace (`_wait_graced`) and checked like any."""

    def known() -> dict[str, bytes]:
        found = {peer_id: secret}
        for peer, revealed in mail.reveals.items():
            commitment = commitments.get(peer)
            if commitment is not None and digest(revealed.secret) == commitment.secret:
                found[peer] = revealed.secret
        for relayed in mail.projections.values():
            for peer, value in relayed.secrets:
                commitment = commitments.get(peer)
                if peer not in found and commitment is not None and digest(value) == commitment.secret:
                    found[peer] = value
        return found

    required = [p for p in seeders if p != peer_id]
    await _wait_graced(
        mail,
        lambda: all(p in mail.reveals or p in mail.gone for p in required),
        lambda: all(p in mail.reveals or p in mail.gone for p in others),
        reveal_by,
    )
    if not all(p in known() for p in required):
        await mail.wait(lambda: all(p in known() or p in mail.gone for p in required), reveal_by + budget_s)
    _check_equivocations(mail)
    for peer, revealed in mail.reveals.items():
        commitment = commitments.get(peer)
        if commitment is None or digest(revealed.secret) != commitment.secret:
            raise _fail(peer, "revealed a secret it had not committed to", proven=True)
        _compare_answers(revealed, statements, state)
    secrets = known()
    silent = [p for p in required if p not in secrets]
    if any(p in mail.gone for p in silent):
        raise _left(mail, [p for p in silent if p in mail.gone])
    if silent:
        raise Caught(
            f"no reveal from {[p[-8:] for p in silent]}",
            dict.fromkeys(silent, "withheld its reveal"),
            proven=False,
        )
    return secrets


def _left(mail: Mailbox, seeders: Sequence[str]) -> Caught:
    """The round fails: `seeders` left it before their secrets reached this member. One this member
    could not reach is named; one that withdrew is named too, unless this member itself found some
    member of the round unreachable (then the withdrawal is borne out: an owner died mid-answer,
    and the member it left without an answer is not at fault), else it names whom it blamed as
    well, accuser and accused alike (a dispute no signature settles)."""
    culprits: dict[str, str] = {}
    for peer in seeders:
        if peer in mail.unreachable:
            culprits[peer] = "left the round (unreachable)"
        elif not mail.unreachable:
            culprits[peer] = f"left the round ({mail.gone[peer]})"
            for blamed in mail.withdrawals.get(peer, []):
                culprits.setdefault(blamed, f"could not be reached by {peer[-8:]}")
    names = sorted(p[-8:] for p in seeders)
    return Caught(f"{names} left the round before revealing", culprits, proven=False, gone=True)


def _check_equivocations(mail: Mailbox) -> None:
    for peer, (kind, first, second) in mail.equivocations.items():
        raise _fail(
            peer,
            "sent this peer two different statements of one round",
            proven=True,
            evidence=Evidence.equivocated(kind, first, second),
        )


def _compare_answers(reveal: Reveal, statements: Mapping[str, AnswerStatement], state: RoundState) -> None:
    """Caught unless `reveal` holds every answer statement this member holds: a different one,
    signed by its owner, proves that owner equivocated; one not signed by it, that the revealer lied."""
    group = state.group
    theirs: dict[tuple[str, tuple[str, ...]], Signed] = {}
    for signed in reveal.answers:
        try:
            fields = state.ring.open(signed, ANSWER)
        except BadStatement as e:
            raise _fail(reveal.peer, f"revealed a forged answer: {e}", proven=True) from e
        if fields[1] != group.round or fields[2] != group.group_id or not isinstance(fields[4], list):
            raise _fail(reveal.peer, "revealed an answer of another round", proven=True)
        theirs[(fields[3], tuple(map(str, fields[4])))] = signed
    for statement in statements.values():
        reducer = statement.owner
        other = theirs.get((reducer, tuple(statement.keys)))
        if other is None:
            raise _fail(reveal.peer, f"revealed no answer of {reducer[-8:]}", proven=True)
        if other.body != statement.signed.body:
            raise _fail(
                reducer,
                f"answered {reveal.peer[-8:]} otherwise than this peer",
                proven=True,
                evidence=Evidence.equivocated(ANSWER, statement.signed, other),
            )
