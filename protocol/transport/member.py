"""The member's side of a round: send each owner its parts, gather the answers, assemble the result.

Every member opens one stream to each other owner and sends its payloads of that owner's parts,
weight and tokens; the owner of the first tensor also receives its encoded report. The payloads go
in chunk frames once the owner has accepted the request header (the framing is in owner.py), and
the averaged parts come back the same way: the member reads an answer only if each announced size
is within what the owner's codec can produce for that part, so no owner can make it read more. A
member returns
a result only if it received every part, all parts name the same contributor set, that set contains
itself and lies within its group, and the reports came back for every contributor; otherwise
`RoundFailed`. Members that return results therefore share one group id and hold the bytes each
owner sent to all; the gathered reports are parsed once here (`allreduce.gather_reports`), the same
bytes by the same function on every member.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID

from ..algorithms.allreduce import Contribution, gather_reports
from ..algorithms.codecs import payload_codec, payload_shape, sum_count
from ..algorithms.parts import merge_rejected
from .averager import MemberResult
from .evidence import Evidence
from .matchmaking import Caught, RoundFailed
from .owner import Answer, RoundState, reports_digest, shape_error, size_list, str_list
from .statements import (
    AnswerStatement,
    BadStatement,
    Commitment,
    Receipt,
    Signed,
    digest,
    dropped_after_receipt,
)
from .turns import SendTurn
from .wire import PROTOCOL_VERSION, read_chunks, read_frame, write_chunks, write_frame

logger = logging.getLogger(__name__)

GO_HEADER_BYTES = 1 << 12  # the owner's go or refusal after a request header
RECEIPT_HEADER_BYTES = 1 << 12  # an owner's signed receipt of our parts


class OwnerUnreachable(RoundFailed):
    """No stream to the owner could be opened: nothing of ours reached it (it is gone, never
    existed, or serves nothing), so its parts may be asked of another member."""


def _fault(owner: str, why: str) -> Caught:
    """An owner's answer that breaks the protocol, as this member saw it on the owner's stream."""
    return Caught(f"owner {owner[-8:]} {why}", {owner: why}, proven=False)


def _refused(owner: str, response: Mapping[str, Any], members: int) -> Caught:
    """An owner's refusal, at our request's header or in place of its answer. It is signed by
    nothing and names nothing of ours this member could check, so it proves nothing either way:
    from an honest owner a race (our parts too late, another view of the group), from a hostile one
    a way to fail every try (issue 25 §2). As an owner that gave no answer (`Caught.unanswered`,
    `late`): one with a record of work is demoted, so it owns nothing at the retry and cannot refuse
    again there; one without is left out a while, as seen. In a group of `members` 2 it is taken
    for a departure instead (`refused`: not left out the first time within `owner.BAN_S`, then as a
    silence): there this member's vote alone is a majority, and an honest race would split the pair
    (`HivemindAverager._convict`)."""
    why = f"refused: {str(response.get('e'))[:200]}"
    return Caught(
        f"owner {owner[-8:]} {why}",
        {owner: why},
        proven=False,
        late=True,
        unanswered=True,
        refused=members <= 2,
    )


def parse_rejected(value: Any, contributors: Sequence[str], num_parts: int) -> dict[str, int] | None:
    """An owner's "x" field: rejected parts per contributor, or None if it is malformed.

    Absent (an owner from before screening) means none. Every key must be a contributor and every
    count in 1..num_parts (the owner cannot reject more parts than it owns).
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        return None
    for peer, count in value.items():
        if peer not in contributors or type(count) is not int or not 1 <= count <= num_parts:
            return None
    return dict(value)


def request_header(
    state: RoundState, *, peer_id: str, keys: list[str], contribution: Contribution, with_metadata: bool
) -> dict[str, Any]:
    """The request header announcing our payloads of `keys` to their owner (owner.py's framing),
    with our signed commitment (`statements.Commitment`)."""
    if state.own is None:
        raise RoundFailed("no commitment to send")
    return {
        "c": state.own.signed.to_wire(),
        "v": PROTOCOL_VERSION,
        "r": state.group.round,
        "g": state.group.group_id,
        "p": peer_id,
        "w": float(contribution.weight),
        "t": float(contribution.tokens),
        "k": keys,
        "s": [len(contribution.payloads[k]) for k in keys],
        "m": bytes(contribution.metadata) if with_metadata else None,
    }


async def fetch(
    p2p: P2P,
    handler: str,
    state: RoundState,
    *,
    peer_id: str,
    owner: str,
    keys: list[str],
    contribution: Contribution,
    with_metadata: bool,
    chunk_bytes: int,
    answer_bounds: Mapping[str, int],
    on_stage: Callable[[str, int], None] | None = None,
    turn: SendTurn | None = None,
) -> Answer:
    """Send `owner` our payloads of `keys` (and our report if `with_metadata`) in chunks of
    `chunk_bytes`; return its answer, whose part k may be at most `answer_bounds[k]` bytes.
    `on_stage` is the fault-injection hook, called as on_stage("sending", round) once the first
    chunk frame is written. `turn`: the payloads go out in this member's turn (`SendTurn`)."""
    header = request_header(
        state, peer_id=peer_id, keys=keys, contribution=contribution, with_metadata=with_metadata
    )
    turn = turn or SendTurn(None, 0.0)  # none given: its own turn, at once
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(owner), handler)
    except Exception as e:
        turn.end()
        raise OwnerUnreachable(f"cannot reach owner {owner[-8:]}: {e}", blamed=[owner]) from e
    try:
        await write_frame(writer, header, [], state.meter)
        if state.own is not None:
            state.meter.checks_sent += state.own.signed.size
        go, _ = await read_frame(reader, state.meter, max_header=GO_HEADER_BYTES, max_body=0)
        if not go.get("ok"):
            raise _refused(owner, go, len(state.group.members))
        payloads = [contribution.payloads[k] for k in keys]
        await turn.begin()
        if on_stage is None:
            await write_chunks(writer, payloads, chunk_bytes, state.meter)
        else:
            await _write_chunks_staged(writer, payloads, chunk_bytes, state, on_stage)
        turn.end()  # the next owner's payloads may go while we wait for this one's answer
        state.receipts[owner] = await _read_receipt(reader, state, owner)
        response, _ = await read_frame(reader, state.meter, max_body=0)
        sizes = _answer_sizes(
            response, owner=owner, keys=keys, bounds=answer_bounds, members=len(state.group.members)
        )
        body = await read_chunks(reader, sizes, state.meter)
    except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
        raise RoundFailed(f"exchange with owner {owner[-8:]} broke: {e!r}", blamed=[owner]) from e
    finally:
        turn.end()  # refused, or broke before its payloads were out (a no-op otherwise)
        writer.close()
    # Each averaged part must decode to our own part's shape: a payload's header states its shape,
    # so a few bytes could otherwise decode to any size (a low-rank factor pair, say).
    shapes = {k: payload_shape(contribution.payloads[k]) for k in keys}
    # The round's codec (ours), or the accepted contributions gathered in a sum payload.
    families = {k: {payload_codec(contribution.payloads[k]), "sum"} for k in keys}
    error = shape_error(dict(zip(keys, body, strict=True)), shapes, families)
    if error is not None:
        raise _fault(owner, f"answered a part of another shape: {error}")
    answer = _parse_answer(response, body, owner=owner, keys=keys, with_metadata=with_metadata)
    # A sum carries one payload per contributor, each decoding to the whole part: read from its
    # header before anything decodes it (the checks and the clip's inner products run side by side).
    most = min(len(answer.contributors), len(state.group.members))
    summed = [k for k in keys if sum_count(answer.payloads[k]) > most]
    if summed:
        raise _fault(owner, f"answered a sum of more payloads than contributors in {summed[:3]}")
    return _with_statement(answer, response, body, state=state, owner=owner, keys=keys)


def _with_statement(
    answer: Answer,
    response: dict[str, Any],
    body: list[bytes],
    *,
    state: RoundState,
    owner: str,
    keys: list[str],
) -> Answer:
    """`answer` with the owner's signed statement of it and the contributors' commitments, each
    checked against the answer as it came: Caught (on this member's word: the stream, not a
    signature, says who sent the bytes) when they do not describe it."""
    group = state.group

    def caught(why: str) -> Caught:
        return Caught(f"owner {owner[-8:]} {why}", {owner: why}, proven=False)

    try:
        signed = Signed.from_wire(response.get("st"), max_body=state.statement_bytes)
        statement = AnswerStatement.parse(
            signed,
            state.ring,
            round=group.round,
            group_id=group.group_id,
            members=len(group.members),
            parts=len(state.layout),
        )
        listed = response.get("cm")
        if not isinstance(listed, list) or len(listed) != len(answer.contributors):
            raise BadStatement("one commitment per contributor")
        commitments = tuple(
            Commitment.parse(
                Signed.from_wire(c, max_body=state.statement_bytes),
                state.ring,
                round=group.round,
                group_id=group.group_id,
                parts=len(state.layout),
            )
            for c in listed
        )
    except BadStatement as e:
        raise caught(f"answered with a malformed statement: {e}") from e
    state.meter.checks_received += signed.size + sum(c.signed.size for c in commitments)
    if statement.owner != owner:
        raise caught("answered with another peer's statement")
    if (
        statement.keys != keys
        or statement.digests != [digest(part) for part in body]
        or statement.contributors != list(answer.contributors)
        or [c.signed.digest for c in commitments] != statement.commitments
        or [c.peer for c in commitments] != statement.contributors
        or statement.reports != reports_digest(answer.metadata)
    ):
        raise caught("answered otherwise than its signed statement says")
    counts: dict[str, int] = {}
    for codes in statement.codes:
        for i in codes:
            counts[statement.contributors[i]] = counts.get(statement.contributors[i], 0) + 1
    if counts != answer.rejected:
        raise caught("counted other rejections than its statement")
    return dataclasses.replace(answer, statement=statement, commitments=commitments)


async def _read_receipt(reader: asyncio.StreamReader, state: RoundState, owner: str) -> Receipt:
    """The owner's signed receipt of our parts; Caught (on our word) for anything else."""
    frame, _ = await read_frame(reader, state.meter, max_header=RECEIPT_HEADER_BYTES, max_body=0)
    try:
        signed = Signed.from_wire(frame.get("rc"), max_body=RECEIPT_HEADER_BYTES)
        receipt = Receipt.parse(signed, state.ring, round=state.group.round, group_id=state.group.group_id)
    except BadStatement as e:
        raise _fault(owner, f"gave no valid receipt of our parts: {e}") from e
    if state.own is None or receipt.owner != owner or receipt.member != state.own.peer:
        raise _fault(owner, "gave a receipt of someone else's parts")
    if receipt.commitment != state.own.signed.digest:
        raise _fault(owner, "gave a receipt of another commitment than ours")
    state.meter.checks_received += signed.size
    return receipt


async def _write_chunks_staged(
    writer: asyncio.StreamWriter,
    payloads: list[bytes],
    chunk_bytes: int,
    state: RoundState,
    on_stage: Callable[[str, int], None],
) -> None:
    """`write_chunks` with the "sending" stage after its first frame: the same frames (a payload's
    first chunk, then its rest, cut the same way), so a test can kill a member mid-send."""
    first = payloads[0]
    await write_chunks(writer, [first[:chunk_bytes]], chunk_bytes, state.meter)
    on_stage("sending", state.group.round)
    await write_chunks(writer, [first[chunk_bytes:], *payloads[1:]], chunk_bytes, state.meter)


def _answer_sizes(
    response: dict[str, Any], *, owner: str, keys: list[str], bounds: Mapping[str, int], members: int
) -> list[int]:
    """The part sizes an answer header announces, each within its bound; RoundFailed otherwise."""
    if not response.get("ok"):
        raise _refused(owner, response, members)
    try:
        sizes = size_list(response.get("s"), len(keys))
    except ValueError as e:
        raise _fault(owner, f"answered with a malformed header: {e}") from e
    over = [k for k, size in zip(keys, sizes, strict=True) if size > bounds[k]]
    if over:
        raise _fault(owner, f"announced oversized parts {over[:3]}")
    return sizes


def _parse_answer(
    response: dict[str, Any], body: list[bytes], *, owner: str, keys: list[str], with_metadata: bool
) -> Answer:
    gathered = response.get("gm")
    try:
        answered_keys = str_list(response.get("k"))
        contributors = tuple(str_list(response.get("c")))
    except ValueError as e:
        raise _fault(owner, f"answered with a malformed header: {e}") from e
    metadata_ok = isinstance(gathered, list) and all(isinstance(m, bytes) for m in gathered)
    if answered_keys != keys or len(body) != len(keys) or (with_metadata and not metadata_ok):
        raise _fault(owner, "answered with the wrong parts")
    rejected = parse_rejected(response.get("x"), contributors, len(keys))
    if rejected is None:
        raise _fault(owner, "answered with a malformed list of rejected parts")
    metadata = tuple(gathered) if with_metadata and gathered is not None else None
    return Answer(contributors, dict(zip(keys, body, strict=True)), metadata, rejected)


def omission(state: RoundState, peer_id: str, answers: Mapping[str, Answer]) -> Caught | None:
    """The owners that left this member's contribution out of their answers, as a `Caught` (None when
    every answer holds it): `proven` when each of them had signed its receipt of our parts
    (`statements.Receipt`) before the answer statement that leaves them out; the two signatures
    prove the drop to anyone (`Caught.evidence`). An owner that answered on the stream our parts
    came in on had taken them."""
    dropping = [o for o, a in answers.items() if peer_id not in a.contributors]
    if not dropping:
        return None
    evidence = [
        (state.receipts[o], answers[o].statement)
        for o in dropping
        if o in state.receipts
        and answers[o].statement is not None
        and dropped_after_receipt(state.receipts[o], answers[o].statement)  # type: ignore[arg-type]
    ]
    caught = Caught(
        "our contribution was not included",
        dict.fromkeys(dropping, "left out our contribution it had taken"),
        proven=len(evidence) == len(dropping),
    )
    caught.evidence = [Evidence.dropped(r.signed, st.signed) for r, st in evidence if st is not None]
    return caught


async def assemble(
    state: RoundState,
    *,
    peer_id: str,
    keys: list[str],
    owners: Mapping[str, str],
    answers: Mapping[str, Answer],
    idle_timeout_s: float,
    exchange_s: float,
    stand_ins: Mapping[str, str] | None = None,
) -> MemberResult:
    """The round's result from every owner's answer; RoundFailed when they do not fit together.

    Owners may have admitted different contributors: a member can break a rule with one owner only
    (a claim it makes there alone), which that owner refuses while another admits it. Each part is
    its owner's reduction over its own contributors and every member receives the same bytes of it,
    so θ stays identical; the round's members are those every owner admitted, and only their
    reports count. (Failing the round instead would let one member stop every round by lying to one
    owner.) A member that some owner did not admit (its exchange there broke) fails, as before.

    `stand_ins`: owner -> the member that reduced that owner's parts in its place (`answers` stays
    keyed by the owner). Those parts may also have been reduced by their owner for members that
    reached it, over other contributors; so a member takes a stand-in's parts only when every
    answer names the very same contributors and the replaced owner is not among them: then no
    member can have received other bytes for those parts and completed the round.
    Conversely a member fails when an owner it got its parts from contributed to no other owner:
    that is the owner someone else may have stood in for.

    A member whose contribution an owner left out after signing its receipt (`omission`, proven)
    takes the round all the same: its bytes are the ones every other member applies, and the member
    is not among the round's members (its report does not count). Failing it left the member a
    round behind, late for the rounds after while it caught up, its Δs dropped (a founder's
    owner-omit, stop 54). One left out without that proof (its exchange there broke) fails.
    """
    contributor_sets = [set(answer.contributors) for answer in answers.values()]
    dropped = omission(state, peer_id, answers)
    if dropped is not None and not dropped.proven:
        raise dropped
    outsiders = {o for o, a in answers.items() if not set(a.contributors) <= set(state.group.members)}
    if outsiders:
        # Its signed statement lists them.
        raise Caught(
            "an owner included peers outside the group",
            dict.fromkeys(outsiders, "included peers outside the group"),
            proven=True,
        )
    stand_ins = stand_ins or {}
    anyone: set[str] = set().union(*contributor_sets)
    if stand_ins and (len(set(map(frozenset, contributor_sets))) > 1 or anyone & set(stand_ins)):
        replaced = sorted(owner[-8:] for owner in stand_ins)
        raise RoundFailed(f"stand-ins for unreachable owners {replaced} reduced over other contributors")
    for owner in answers:
        others = [set(a.contributors) for o, a in answers.items() if o != owner]
        if owner not in (peer_id, *stand_ins) and others and all(owner not in c for c in others):
            # An owner that reached no other owner is what a stand-in replaces: another member may
            # hold a stand-in's bytes for its parts (and, with theirs, a different θ). It answered
            # (it is alive) and gave no other owner its parts: every member sees that alike.
            raise Caught(
                f"owner {owner[-8:]} contributed to no other owner",
                {owner: "sent no other owner its parts"},
                proven=False,
                silent=True,
            )
    everywhere = set.intersection(*contributor_sets)
    described = answers[owners[keys[0]]]
    metadata = described.metadata
    if metadata is None or len(metadata) != len(described.contributors):
        raise RoundFailed("metadata missing or incomplete")
    reports, malformed = gather_reports(described.contributors, metadata)
    if len(set(map(frozenset, contributor_sets))) > 1:
        left_out = sorted(p[-8:] for p in set.union(*contributor_sets) - everywhere)
        logger.warning("round %d: not every owner admitted %s", state.group.round, left_out)
        reports = tuple(r for r in reports if r.peer_id in everywhere)
        malformed = {peer: why for peer, why in malformed.items() if peer in everywhere}
    contributors = tuple(peer for peer in described.contributors if peer in everywhere)
    if state.session is not None:
        # Wait until our answers to the other members are written, so the byte counts are final.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.session.idle.wait(), timeout=idle_timeout_s)
    traffic = state.meter.traffic(exchange_s)
    return MemberResult(
        averaged={k: answers[owners[k]].payloads[k] for k in keys},
        reports=reports,
        members=contributors,
        owners={key: stand_ins.get(owner, owner) for key, owner in owners.items()},
        sent_bytes={peer_id: traffic.wire_sent},
        received_bytes={peer_id: traffic.wire_received},
        rejected=merge_rejected([answer.rejected for answer in answers.values()]),
        malformed=malformed,
        peer_id=peer_id,
        traffic=traffic,
    )
