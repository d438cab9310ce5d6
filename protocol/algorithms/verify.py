"""Checking an owner's answer from commitments and one random projection: the math, no transport.

An owner averages the members' payloads of the parts it owns and answers everyone with the same
bytes (`allreduce`); nothing in those bytes shows that they are the average. A member checks them
the way BTARD does (Gorbunov et al. 2021, "Secure Distributed Training at Scale"), for a few
scalars per contributor and part instead of the parts themselves:

1. Before the exchange every member commits (signed, in its request header) to the sha256 of each
   of its payloads and to each one's L2 norm (`parts.tensor_norm` of the decoded values), its weight
   and tokens, and the hash of a secret. The owner checks each norm against the payload it got and
   screens on the committed norms, so every member can recompute the screening (`expected_factors`).
2. The owner answers with a signed statement of its answer's hashes, the contributors it used and
   why it left each rejected payload out.
3. Once every answer is in, the members reveal their secrets. The seed of the direction z (one per
   part, uniform in [-1, 1) per coordinate, `direction`) hashes all of them with the answers
   (`round_seed`): no owner can know z while it can still change its answer, so a lie cannot be
   shaped to be orthogonal to it.
4. Every member sends every other the projections s_j = <x_j, z> of its own payloads (`project`)
   and checks each part of each owner: for the mean, <v, z> = Σ f_j s_j up to the answer's rounding
   (`check_mean`).

Why one projection suffices. z is drawn after the error e = v − Σ f_j x_j is fixed, and its
coordinates are independent and bounded, so <e, z> is a sum of independent terms of variance
e_i²/3: Bernstein's inequality bounds it by about κ‖e‖/√3 but with probability 2 exp(−κ²/2),
4.6e-11 at κ = `KAPPA` = 7 (`bernstein`). An honest answer's error is bounded from the answer
itself (`codecs.error_bound`: 0 for fp32, half a quantization step per value for int8/int4) plus
the float32 arithmetic of the sum, so an honest owner fails the check with that probability per
part. A lie of L times that bound passes with probability about 0.8·κ/L (|<e, z>| is then spread
over ‖e‖/√3 with a bounded density): 6 % at L = 100; one that fails is caught with the statements
that prove it. A lie is thus caught in the round it is told with a probability that grows with its
size, and the liar is excluded from then on: the expected harm before that is a few times the
answer's own rounding. For int8 that rounding is about 1 % of the answer's norm; for int4, 15 %, so
an int4 answer (the downlink of an int4 run) is checked only that coarsely: a lie of its own size
(a sign flip, noise) passes about half the time.

CenteredClip (`parts.Aggregate` "clip:c") is checked as BTARD checks it, by its fixed point. At
the fixed point the answer is a weighted mean, v = Σ p_i ρ_i x_i / Σ p_j ρ_j with ρ_i = min(1, τ /
‖x_i − v‖), so the owner states τ and every ρ_i, the projection checks the answer as the mean with
those factors (`stated_factors`), and `check_clip` checks the factors: each member sends, beside
its projections, the inner product t_i = <x_i, a> of each payload with the answer a it went into,
which with its committed norm and the answer's own norm gives its distance from the answer's center
(‖x_i − v‖² = ‖x_i‖² − 2 t_i / Σf + ‖v‖²); ρ_i must be min(1, τ / that distance) and τ c × their
median, within `parts.CLIP_AGREEMENT` and `parts.CLIP_RADIUS_AGREEMENT` and the answer's rounding.
A member's t_i is its word, like its projection: bounded by its committed norm (Cauchy–Schwarz,
`check_dot`), and an owner framed by a false one shows the payload. An owner that colludes with a
contributor (or contributes to its own parts) can therefore clip that contributor less only as far
as its committed norm allows: its distance from the answer is at least the difference of their
norms.

What is exact instead of projected: a part nobody weighs (all zeros), a part of one contributor
(its payload forwarded: the hashes compare), and a gathered part (`downlink.Gather`: the
contributions themselves travel in a sum payload, each one's hash and factor compared). Every other
answer must also lie within the norm its contributions allow (`check_bound`), which is all that is
checked of an answer of a lossy codec that leaves out part of the average (low rank, sparse:
`codecs.error_bound` is None) and of the trimmed mean (a coordinate-wise rule no projection
resolves); it also caps a
lie under a coarse codec (int4's half step is 1/14 of its block's largest value, so a scaled answer
would widen its own rounding bound); an exclusion by the owner's scorer
(`parts.SCORED`), which rests on a batch only the owner holds, is taken as stated.

A contributor's own projection is its word, checked against its committed norm (|s_j| ≤ κ‖x_j‖,
`check_projection`): one that colludes with an owner can move the check by at most that much, so
the owner's lie through it is bounded by the contributor's own screened norm.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .codecs import ErrorBound, Rounding, decoded_spans, payload_shape, sum_parts
from .parts import (
    CLIP_AGREEMENT,
    CLIP_RADIUS_AGREEMENT,
    MIN_OUTLIER_GROUP,
    MISMATCH,
    SCORED,
    SCREENED,
    Aggregate,
    Clip,
    Norm,
    accepted_factors,
    clip_factor,
    clip_weights,
    screened_out,
)

KAPPA = 7.0
"""How many bounds of the honest error a projection may be off: Hoeffding for z uniform in [-1, 1)
gives P(|<e, z>| ≥ κ‖e‖) ≤ 2 exp(−κ²/2) = 4.6e-11 per part (an honest owner's false alarm)."""
FLOAT32_ROUNDING = 2.0**-24
"""The relative rounding of one float32 operation: an owner's weighted sum adds one per term."""
PROJECTION_CHUNK = 1 << 16
"""Coordinates of z drawn and multiplied at a time: z is never a whole tensor in memory."""
_Z_BITS = 24  # z takes 2**24 values in [-1, 1): the top 24 bits of each 64-bit draw


class Misanswer(ValueError):
    """An owner's answer contradicts the commitments it was made from (a lie, or a rule it does not
    share with this member)."""


class Misprojection(ValueError):
    """A contributor's projection cannot be that of the payload it committed to."""


def payload_digest(payload: bytes) -> bytes:
    """The sha256 a commitment names a payload by."""
    return hashlib.sha256(payload).digest()


def round_seed(group_id: bytes, secrets: Sequence[bytes], answers: Sequence[bytes]) -> bytes:
    """The seed of a round's directions: every member's secret and every answer's digest, in the
    group's order, length-prefixed. Known to nobody before every answer is fixed and every secret
    revealed."""
    h = hashlib.sha256(b"adloco.verify.v1")
    for item in (group_id, *secrets, *answers):
        h.update(len(item).to_bytes(4, "little"))
        h.update(item)
    return h.digest()


def direction(seed: bytes, key: str, numel: int) -> Iterator[torch.Tensor]:
    """z for part `key`: `numel` coordinates uniform on a grid of 2**24 values in [-1, 1), in
    float64 chunks of `PROJECTION_CHUNK`. Drawn from PCG64's raw output (specified bits, the same on
    every machine and numpy version) seeded by sha256(seed, key)."""
    digest = hashlib.sha256(seed + key.encode()).digest()
    bits = np.random.PCG64(int.from_bytes(digest[:16], "little"))
    scale = 2.0 ** (1 - _Z_BITS)
    for start in range(0, numel, PROJECTION_CHUNK):
        raw = bits.random_raw(min(PROJECTION_CHUNK, numel - start))
        z = (raw >> np.uint64(64 - _Z_BITS)).astype(np.float64)
        z *= scale
        z -= 1.0
        yield torch.from_numpy(z)


def project(tensor: torch.Tensor, seed: bytes, key: str) -> float:
    """<tensor, z> for part `key`'s direction, the products and their sum in float64 (exact to
    ~1e-16 relative, far below any tolerance)."""
    flat = tensor.reshape(-1)
    projection = Projection(seed, key, flat.numel())
    projection.add(flat)
    return projection.value


class Projection:
    """`project` of the `numel` values `add`ed in order: the same number whether they come whole or
    in spans of whole `PROJECTION_CHUNK`s (as `codecs.decoded_spans` yields them)."""

    def __init__(self, seed: bytes, key: str, numel: int) -> None:
        self._z = direction(seed, key, numel)
        self.value = 0.0

    def add(self, flat: torch.Tensor) -> None:
        start = 0
        while start < flat.numel():
            z = next(self._z)
            chunk = flat[start : start + len(z)]
            if len(chunk) != len(z):
                raise ValueError(f"a span of {flat.numel()} values, not whole chunks of {len(z)}")
            self.value += float(torch.dot(chunk.to(torch.float64), z))
            start += len(z)


def inner(a: torch.Tensor, b: torch.Tensor) -> float:
    """<a, b> with the products and their sum in float64, in chunks (no whole-part float64 copy)."""
    return _inner_spans([a.reshape(-1)], [b.reshape(-1)])


def _inner_spans(xs: Iterable[torch.Tensor], ys: Iterable[torch.Tensor]) -> float:
    total = []
    for x, y in zip(xs, ys, strict=True):
        if x.numel() != y.numel():
            raise ValueError(f"inner product of {x.numel()} and {y.numel()} values")
        for i in range(0, x.numel(), PROJECTION_CHUNK):
            chunk = x[i : i + PROJECTION_CHUNK].to(torch.float64)
            total.append(float(torch.dot(chunk, y[i : i + PROJECTION_CHUNK].to(torch.float64))))
    return math.fsum(total)


def inner_payloads(a: bytes, b: bytes) -> float:
    """`inner` of two payloads' decoded values, a span of each at a time (never decoded whole)."""
    if payload_shape(a) != payload_shape(b):
        raise ValueError(f"inner product of payloads of shapes {payload_shape(a)} and {payload_shape(b)}")
    return _inner_spans(decoded_spans(a), decoded_spans(b))


def project_payload(payload: bytes, seed: bytes, key: str) -> float:
    """`project` of a payload's decoded values, a span at a time (never decoded whole)."""
    projection = Projection(seed, key, math.prod(payload_shape(payload)))
    for span in decoded_spans(payload):
        projection.add(span)
    return projection.value


@dataclass(frozen=True)
class AnswerFacts:
    """What the checks read of an answer's values, in one pass over its decoded spans: its norm
    (`parts.tensor_norm`'s), its projection on the part's direction (`project`'s; 0.0 when not asked
    for), how far an honest encoding's values may be from what was encoded (`codecs.error_bound`'s;
    None where the payload does not bound it)."""

    norm: float
    projection: float
    rounding: Rounding | None


def answer_facts(payload: bytes, seed: bytes | None, key: str) -> AnswerFacts:
    """`AnswerFacts` of `payload`, its projection on part `key`'s direction for the round's `seed`
    (None: not projected), a span at a time: an answer is never decoded whole beside the training
    step that runs while a round is checked. ValueError where `codecs.error_bound` raises it."""
    norm, rounding = Norm(), ErrorBound(payload)
    projection = None if seed is None else Projection(seed, key, math.prod(payload_shape(payload)))
    for span in decoded_spans(payload):
        norm.add(span)
        rounding.add(span)
        if projection is not None:
            projection.add(span)
    return AnswerFacts(norm.value, 0.0 if projection is None else projection.value, rounding.value)


@dataclass(frozen=True)
class Claim:
    """One contributor's payload of one part as its signed commitment states it."""

    weight: float
    tokens: float
    norm: float
    digest: bytes


def expected_factors(
    claims: Sequence[Claim],
    codes: Mapping[int, str],
    *,
    outlier_factor: float | None,
    work_cap: float | None,
) -> list[tuple[int, float]] | None:
    """The (contributor index, factor) pairs of the mean an owner who stated `codes` (index ->
    `SCORED`, `MISMATCH` or `SCREENED`) must have taken; None when nothing weighs (the answer is
    zeros). Misanswer when the screening it states is not the one the committed norms give."""
    if any(not 0 <= i < len(claims) or code not in (SCORED, MISMATCH, SCREENED) for i, code in codes.items()):
        raise Misanswer(f"rejections {dict(codes)} name no contributor or no reason")
    given = {i: code for i, code in codes.items() if code != SCREENED}
    screened = screened_out(
        [c.norm for c in claims],
        [c.tokens for c in claims],
        given=given,
        outlier_factor=outlier_factor,
        work_cap=work_cap,
    )
    stated = {i for i, code in codes.items() if code == SCREENED}
    if screened != stated:
        raise Misanswer(f"screened out {sorted(stated)}; the committed norms screen out {sorted(screened)}")
    accepted = [i for i in range(len(claims)) if i not in codes]
    factors = accepted_factors([c.weight for c in claims], [c.tokens for c in claims], accepted)
    return None if factors is None else list(zip(accepted, factors, strict=True))


def check_exact(payload: bytes, claims: Sequence[Claim], factors: list[tuple[int, float]] | None) -> bool:
    """Check the answers that need no projection; True when `payload` is one of them and right,
    False when it must be projected (or bounded). Misanswer when it is wrong: nonzero where nothing
    weighs, not the single contribution it stands for, or a sum that does not carry the accepted
    contributions with their factors."""
    if factors is None:
        if any(bool(span.count_nonzero()) for span in decoded_spans(payload)):
            raise Misanswer("nothing weighs in this part, yet the answer is not zeros")
        return True
    if len(factors) == 1 and factors[0][1] == 1.0:
        if payload_digest(payload) != claims[factors[0][0]].digest:
            raise Misanswer("the answer of one contribution is not that contribution")
        return True
    try:
        carried, parts = sum_parts(payload)
    except ValueError:
        return False  # not a sum: an encoded average
    expected = [float(np.float32(f)) for _, f in factors]
    digests = [payload_digest(p) for p in parts]
    if carried != expected or digests != [claims[i].digest for i, _ in factors]:
        raise Misanswer("the gathered contributions or their factors are not the accepted ones")
    return True


def check_projection(projection: float, claim: Claim) -> None:
    """Misprojection unless |projection| ≤ κ × the committed norm: a projection on z of a payload of
    that norm is within it but with probability 4.6e-11 (Hoeffding, as for `KAPPA`)."""
    if not (math.isfinite(projection) and abs(projection) <= KAPPA * claim.norm):
        raise Misprojection(f"projection {projection:.6g} of a payload of norm {claim.norm:.6g}")


def bernstein(l2: float, peak: float, kappa: float = KAPPA) -> float:
    """t with P(|<e, z>| ≥ t) ≤ 2 exp(−κ²/2) for any e with |e_i| ≤ `peak` and ‖e‖ ≤ `l2`, z uniform
    in [-1, 1): Bernstein's inequality for independent terms e_i z_i of variance e_i²/3 and size at
    most `peak`, solved for t. About κ‖e‖/√3 when no coordinate dominates (Hoeffding's κ‖e‖ is √3
    looser)."""
    variance = l2 * l2 / 3
    a = kappa * kappa * peak / 3
    return (a + math.sqrt(a * a + 4 * kappa * kappa * variance)) / 2


def mean_tolerance(
    facts: AnswerFacts, claims: Sequence[Claim], factors: list[tuple[int, float]]
) -> float | None:
    """How far an honest mean's <v, z> may be from Σ f_j s_j: `bernstein` of the answer's rounding
    (`codecs.error_bound`), plus κ × one float32 rounding per term of the owner's sum and of the
    factors (Hoeffding). None for an answer whose payload bounds no error (low rank, sparse)."""
    rounding = facts.rounding
    if rounding is None:
        return None
    weighed = math.fsum(f * claims[i].norm for i, f in factors)
    arithmetic = (len(factors) + 2) * FLOAT32_ROUNDING * (weighed + facts.norm)
    return bernstein(rounding.l2, rounding.peak) + KAPPA * arithmetic


def check_mean(
    answer_projection: float,
    projections: Mapping[int, float | None],
    claims: Sequence[Claim],
    factors: list[tuple[int, float]],
    tolerance: float,
) -> None:
    """Misanswer unless <v, z> is Σ f_j s_j within `tolerance`. A contributor whose projection is
    missing (None: it never sent it) can be anything its committed norm allows (`check_projection`),
    which widens the tolerance by f_j κ ‖x_j‖: a member missing one projection accepts whatever a
    member holding it accepts, never less."""
    known = 0.0
    unknown = 0.0
    for i, f in factors:
        s = projections.get(i)
        if s is None:
            unknown += f * KAPPA * claims[i].norm
        else:
            known += f * s
    # The float64 products and sums of the projections themselves.
    slack = 1e-12 * (
        abs(answer_projection) + math.fsum(abs(f * (projections.get(i) or 0.0)) for i, f in factors)
    )
    off = abs(answer_projection - known)
    if not off <= tolerance + unknown + slack:
        raise Misanswer(f"projection off by {off:.6g}, allowed {tolerance + unknown + slack:.6g}")


CLIP_NORM_SLACK = 1e-4
"""Relative slack of a squared distance worked out from a committed norm, an inner product and the
answer's norm (the committed norm may be off by `parts.NORM_AGREEMENT`, each sum by float32
rounding)."""


def stated_factors(
    clip: Clip | None, factors: list[tuple[int, float]] | None, aggregate: Aggregate
) -> list[tuple[int, float]] | None:
    """The factors of the answer as a weighted mean: the mean's `factors`, or under a clip
    statement those it gives them (`parts.clip_weights`). Misanswer for a clip statement where the
    rule clips nothing, none where it must (CenteredClip over at least `MIN_OUTLIER_GROUP`
    payloads), or one whose factors are not of the accepted payloads."""
    clipping = aggregate.rule == "clip" and factors is not None and len(factors) >= MIN_OUTLIER_GROUP
    if clip is None:
        if clipping:
            raise Misanswer("a CenteredClip answer without its clip factors")
        return factors
    if not clipping or factors is None:
        raise Misanswer("clip factors where the rule clips nothing")
    if set(clip.rhos) != {i for i, _ in factors}:
        raise Misanswer("clip factors of other payloads than the accepted ones")
    weights = clip_weights([f for _, f in factors], [clip.rhos[i] for i, _ in factors])
    return [(i, w) for (i, _), w in zip(factors, weights, strict=True)]


def check_dot(dot: float, claim: Claim, answer_norm: float) -> None:
    """Misprojection unless |<x, a>| ≤ ‖x‖ ‖a‖ (Cauchy–Schwarz, with the committed norm's slack)."""
    if not (math.isfinite(dot) and abs(dot) <= claim.norm * answer_norm * (1 + CLIP_NORM_SLACK)):
        raise Misprojection(f"inner product {dot:.6g} with an answer of norm {answer_norm:.6g}")


def check_clip(
    clip: Clip,
    claims: Sequence[Claim],
    factors: Sequence[tuple[int, float]],
    c: float,
    *,
    answer_norm: float,
    rounding: float,
    dots: Mapping[int, float | None],
) -> None:
    """Misanswer unless `clip` holds at the answer: τ within `CLIP_RADIUS_AGREEMENT` of c × the
    median distance of the accepted payloads from the answer's center v = a / Σf, and each ρ_i within
    `CLIP_AGREEMENT` of min(1, τ / ‖x_i − v‖). `factors` are the mean's (Σf rescales the answer);
    `rounding` bounds the answer's own error in L2 (it moves v by rounding / Σf); `dots[i]` is
    <x_i, a> as contributor i sent it, None where it did not (its distance is then anything its
    norm allows, |‖x_i‖ − ‖v‖| to ‖x_i‖ + ‖v‖)."""
    total = math.fsum(f for _, f in factors)
    center, shift = answer_norm / total, rounding / total
    lows, highs = [], []
    for i, _ in factors:
        norm, dot = claims[i].norm, dots.get(i)
        if dot is None:
            low, high = abs(norm - center), norm + center
        else:
            square = norm * norm - 2 * dot / total + center * center
            slack = CLIP_NORM_SLACK * (norm * norm + center * center)
            low, high = math.sqrt(max(square - slack, 0.0)), math.sqrt(max(square + slack, 0.0))
        lows.append(max(low - shift, 0.0))
        highs.append(high + shift)
    smallest = c * statistics.median(lows) * (1 - CLIP_RADIUS_AGREEMENT)
    largest = c * statistics.median(highs) * (1 + CLIP_RADIUS_AGREEMENT)
    if not smallest <= clip.tau <= largest:
        raise Misanswer(f"clip radius {clip.tau:.6g}, the distances give {smallest:.6g} to {largest:.6g}")
    for (i, _), low, high in zip(factors, lows, highs, strict=True):
        least, most = clip_factor(high, clip.tau), clip_factor(low, clip.tau)
        rho = clip.rhos[i]
        if not least * (1 - CLIP_AGREEMENT) <= rho <= most * (1 + CLIP_AGREEMENT):
            raise Misanswer(
                f"clip factor {rho:.6g} of contributor {i}: its distance gives {least:.6g} to {most:.6g}"
            )


def check_bound(
    facts: AnswerFacts,
    claims: Sequence[Claim],
    factors: list[tuple[int, float]],
    aggregate: Aggregate,
) -> None:
    """Misanswer unless the answer is no larger than its rule allows: for the mean, Σ f_j ‖x_j‖ (the
    triangle inequality; a low-rank projection or a top-k selection of the mean is no larger than the
    mean); for the robust rules (each coordinate within the contributions' range, rescaled by Σ f),
    Σ f × √(Σ ‖x_j‖²); plus the answer's own rounding where it bounds it."""
    total = math.fsum(f for _, f in factors)
    if aggregate.rule == "mean":
        allowed = math.fsum(f * claims[i].norm for i, f in factors)
    else:
        allowed = total * math.sqrt(math.fsum(claims[i].norm ** 2 for i, _ in factors))
    rounding = 0.0 if facts.rounding is None else facts.rounding.l2
    norm = facts.norm
    allowed = allowed * (1 + 1e-6) + rounding
    if not norm <= allowed:
        raise Misanswer(f"the answer's norm {norm:.6g} exceeds the {allowed:.6g} its contributions allow")
