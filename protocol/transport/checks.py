"""The checks of a round's answers a member runs (verification.py, steps 1 and 3), from the signed
statements and its own payloads alone: no stream, no waiting.

`check_statements` checks each owner's statement against the commitments it names and the round's
rules; `parts_to_check` lists the parts this member did not reduce, with what each contributor
claimed; `check_part` decodes one answer and bounds it; `finish_check` checks it by projection once
the members' projections are in. `own_projections` and `own_dots` are what this member says of its
own payloads. A failure raises `Caught` naming the culprit, with the evidence its signatures make
where they prove it (`evidence`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..algorithms import verify
from ..algorithms.codecs import payload_codec, sum_count
from ..algorithms.parts import MIN_OUTLIER_GROUP, MISMATCH, SCORED, Aggregate, Clip
from ..algorithms.verify import Claim, Misanswer, Misprojection
from .evidence import Evidence
from .matchmaking import Caught
from .owner import Answer
from .statements import (
    COMMIT,
    Commitment,
    Projections,
    digest,
)

logger = logging.getLogger(__name__)


Shown = tuple[float, float | None]
"""What a contributor said of its payload of one part: its projection, and its inner product with
the part's answer (None where it sent none)."""


def statements_of(payloads: Mapping[str, bytes], answer: bytes, seed: bytes, key: str) -> dict[str, Shown]:
    """What each of `payloads` truly gives: its projection and its inner product with `answer`."""
    return {
        peer: (verify.project_payload(payload, seed, key), verify.inner_payloads(payload, answer))
        for peer, payload in payloads.items()
    }


def agree_all(true: Shown, claimed: Shown) -> bool:
    """Whether a contributor's claims are what its payload gives (an inner product it did not send
    claims nothing)."""
    return _agree(true[0], claimed[0]) and (claimed[1] is None or _agree(true[1] or 0.0, claimed[1]))


def _agree(a: float, b: float) -> bool:
    """Two float64 projections of the same payload on the same direction (another machine's
    summation order moves them by ~1e-16 relative)."""
    return abs(a - b) <= 1e-9 * (abs(a) + abs(b)) + 1e-300


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


def blame(culprit: str, why: str, *, proven: bool, evidence: Evidence | None = None) -> Caught:
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
            raise blame(slot, "answered without a signed statement", proven=False)
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
            raise blame(reducer, why, proven=flags)
        for commitment in answer.commitments:
            held = commitments.setdefault(commitment.peer, commitment)
            if held.signed.body != commitment.signed.body:
                raise blame(
                    commitment.peer,
                    "committed to different contributions with different owners",
                    proven=True,
                    evidence=Evidence.equivocated(COMMIT, held.signed, commitment.signed),
                )
        if statement.reports and answer.metadata is not None:  # the reducer relays the reports
            for commitment, report in zip(answer.commitments, answer.metadata, strict=True):
                # An empty report is one elided for its size (`owner_streams.Request`): dropped alike.
                if report and digest(report) != commitment.report:
                    raise blame(reducer, f"relayed another report of {commitment.peer[-8:]}", proven=True)
        scored = [frozenset(i for i, code in codes.items() if code == SCORED) for codes in statement.codes]
        if any(scored) and not settings.scoring:
            raise blame(reducer, "left contributors out by a scorer this run does not run", proven=True)
        if len(set(scored)) > 1:  # a scorer judges a contributor over all the owner's parts at once
            raise blame(reducer, "its scorer left out different contributors in different parts", proven=True)
        if own.peer in answer.contributors:
            mine = answer.contributors.index(own.peer)
            for key, codes in zip(statement.keys, statement.codes, strict=True):
                if codes.get(mine) == MISMATCH:
                    raise blame(reducer, f"rejected our {key!r} as unlike our commitment", proven=True)
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
                raise blame(reducer, f"{key!r}: {e}", proven=True) from e
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
    it decodes the answer, a span at a time); Caught (proven) when the answer is wrong on its face."""
    try:
        codec = payload_codec(part.payload)
        if codec == "sum" and len(part.contributors) < sum_count(part.payload):
            raise Misanswer("a sum of more payloads than contributors")
        if verify.check_exact(part.payload, part.claims, part.factors):
            return Checked(part)
        assert part.factors is not None
        # A weighted mean: the mean, CenteredClip with its factors, any rule below its minimum.
        weighted = (
            settings.aggregate.rule == "mean"
            or part.clip is not None
            or len(part.factors) < MIN_OUTLIER_GROUP
        )
        rule = Aggregate() if weighted else settings.aggregate
        # One pass over the answer's spans: its norm, rounding and (for a weighted mean) projection.
        facts = verify.answer_facts(part.payload, seed if weighted else None, part.key)
        verify.check_bound(facts, part.claims, part.factors, rule)
        if not weighted:
            return Checked(part)
        tolerance = verify.mean_tolerance(facts, part.claims, part.factors)
        if tolerance is None or facts.rounding is None:
            return Checked(part)
        return Checked(part, tolerance, facts.projection, facts.norm, facts.rounding.l2)
    except ValueError as e:  # Misanswer, or an answer no honest encoder makes
        raise blame(part.owner, f"{part.key!r}: {e}", proven=True) from e


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
        dots.append(None if key not in clipped else verify.inner_payloads(payloads[key], clipped[key]))
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
            raise blame(peer, f"{part.key!r}: {e}", proven=True) from e
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
        raise blame(part.owner, f"{part.key!r}: {e}", proven=False) from e
