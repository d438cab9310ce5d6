"""Splitting one all-reduce among the members of an averaging group.

Each tensor ("part") of the pseudo-gradient is owned by one member: every other member sends it
their encoded copy, the owner decodes and averages them (`reduce_part`) and sends the same encoded
average back to everyone. `assign_parts` balances owners by bytes deterministically, so all
members derive the same assignment from the same sizes without talking; `round_traffic` counts the
exact bytes each member sends and receives in such a round.

Screening (DESIGN §3 step 5): before averaging, the owner rejects, part by part, every payload that
decodes to a NaN or inf, and, when at least `MIN_OUTLIER_GROUP` finite payloads remain, every one
whose L2 norm exceeds `DEFAULT_OUTLIER_FACTOR` (configurable) × their median norm (`screen_part`).
The norms compared are per unit of work, each divided by the tokens its contributor claims (at most
the round's reference work, `work_cap`): under DyLU a fast peer runs H steps where the slow ones run
H/15, and its Δ, 13.5× their norm, was rejected whole, its work thrown away (in the simulator's sync
rounds, 5 peers at speeds 1 and 1/15, H = 30). Capped at the reference, a claim beyond an honest
round's work buys no room. A rejected payload is left out of the weighted sum and its tokens out of
the normalizer; if nothing is left the part averages to zeros. Rejection is per part: the member
stays a contributor.

Robust aggregation (issue 10 §3, `Aggregate`): what passes the screening is combined by the weighted
mean (the default), a coordinate-wise trimmed mean, or CenteredClip (Karimireddy et al., as BTARD
runs it per part). Every owner applies the run's rule to its own parts, and every member receives
the owner's bytes, so θ stays identical whatever the rule.

Scoring (issue 10 §3, `scoring.py`): given a `scorer`, `reduce_parts` first judges each contributor
by the loss change its Δ over these parts makes on a batch the owner holds, and leaves the ones it
excludes out of every part, reported as rejections like the screening's, before the screening and
the aggregate rule see the rest.

Over 500 lines, one idea: what an owner does with its parts (assignment, screening, the aggregation
rules, the reduction) and the bytes that costs (`round_traffic`); the verifiable form of
CenteredClip lives beside the rule it must reproduce bit for bit.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .codecs import SPAN, Codec, decode, decoded_spans, payload_shape
from .downlink import Gather
from .scoring import Scorer

logger = logging.getLogger(__name__)

DEFAULT_OUTLIER_FACTOR = 10.0
"""How far above the part's median L2 norm a payload's norm may be before its owner rejects it.

Honest Δs of one round differ by data noise and by the work behind them (in the simulator's sync
and async tests the largest is at most 1.5× the median); a scaled or corrupted one (a bit flip in
an exponent, a diverged peer) is off by orders of magnitude. The work is divided out where it is
claimed (norms per token, see the module doc), so unequal H (DyLU) is not an outlier. Lower it if
poisoned rounds get through (watch the owners' "rejected" warnings and the loss spikes); raise it,
or set 0 / None to disable the test, if honest peers still get rejected. Non-finite payloads are
rejected regardless.
"""
MIN_OUTLIER_GROUP = 3
"""The outlier test needs this many finite payloads of a part: with two, the median cannot say
which of them is off."""
# Coordinates combined at a time by the robust rules: their (n, slice) temporaries stay small.
_ROBUST_SLICE = 1 << 18
CLIP_MAX_ITERATIONS = 100
"""The most fixed-point iterations CenteredClip runs before it answers (it stops once its clip
factors and radius hold at its answer, `_centered_clip`; a few iterations where few are clipped)."""
CLIP_AGREEMENT = 1e-2
"""How far (relative) a stated clip factor may be from the one recomputed at the answer: the owner
iterates until its factors hold to a quarter of this, a member accepts this much (`verify`)."""
CLIP_RADIUS_AGREEMENT = 0.1
"""How far (relative) a stated clip radius τ may be from c × the median distance of the accepted
payloads from the answer: the owner iterates until it holds to half of this."""


@dataclass(frozen=True)
class Clip:
    """What an owner's CenteredClip answer states of one part: the radius τ and each accepted
    payload's clip factor ρ_i = min(1, τ / ‖x_i − v‖) (by index among the part's payloads). The
    answer is then the weighted mean with the factors `clip_weights` gives, which every member can
    check by projection like any mean, and the factors against the distances (`verify.check_clip`)."""

    tau: float
    rhos: dict[int, float]


@dataclass(frozen=True)
class Aggregate:
    """How an owner combines the payloads of a part that passed the screening.

    "mean": Σ f_i x_i with f_i the normalized weights (w / Σw, or w / Σ tokens). "trimmed:β":
    per coordinate the ⌊β·n⌋ largest and smallest values are left out and the rest averaged by
    their weights, rescaled to Σ f_i (so a late, down-weighted group shrinks as under the mean).
    "clip:c": CenteredClip's fixed point, from the coordinate-wise median: v = Σ p_i ρ_i x_i / Σ p_i
    ρ_i with p_i = f_i / Σ f, ρ_i = min(1, τ / ‖x_i − v‖) and τ = c × the median of the distances
    ‖x_i − v‖, then times Σ f (`_centered_clip`). With fewer than `MIN_OUTLIER_GROUP` payloads, the
    robust rules are the mean: two cannot outvote each other.
    """

    rule: str = "mean"
    param: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Aggregate:
        """ "mean", "trimmed:β" (0 < β < 0.5) or "clip:c" (c > 0); ValueError naming the forms."""
        name, _, value = spec.partition(":")
        if name == "mean" and not value:
            return cls()
        try:
            param = float(value)
        except ValueError:
            param = math.nan
        if name == "trimmed" and 0 < param < 0.5:
            return cls("trimmed", param)
        if name == "clip" and math.isfinite(param) and param > 0:
            return cls("clip", param)
        raise ValueError(f"aggregate: {spec!r} is not mean, trimmed:β with 0 < β < 0.5, or clip:c with c > 0")

    def __str__(self) -> str:
        return self.rule if self.rule == "mean" else f"{self.rule}:{self.param:g}"

    def combine(self, tensors: Sequence[torch.Tensor], factors: Sequence[float]) -> torch.Tensor:
        """The part's aggregate of `tensors` (one shape, finite) with the normalized `factors`."""
        return self.combine_stated(tensors, factors)[0]

    def combine_stated(
        self, tensors: Sequence[torch.Tensor], factors: Sequence[float]
    ) -> tuple[torch.Tensor, Clip | None]:
        """`combine`, and what a CenteredClip answer states (None for the other rules, and below
        `MIN_OUTLIER_GROUP` payloads, where every rule is the mean)."""
        flat = [t.reshape(-1) for t in tensors]
        numel = flat[0].numel() if flat else 0

        def spans() -> Iterator[Sequence[torch.Tensor]]:
            return ([t[at : at + SPAN] for t in flat] for at in range(0, numel, SPAN))

        answer, clip = self.combine_spans(spans, factors)
        pieces = list(answer)
        whole = torch.cat(pieces) if pieces else torch.empty(0, dtype=tensors[0].dtype)
        return whole.view_as(tensors[0]), clip

    def combine_spans(
        self, spans: Callable[[], Iterator[Sequence[torch.Tensor]]], factors: Sequence[float]
    ) -> tuple[Iterator[torch.Tensor], Clip | None]:
        """`combine_stated` of payloads read a span at a time, never whole: `spans()` yields, span
        after span, each payload's values there (flat; every span but the last a multiple of
        `_ROBUST_SLICE` long), and is called once per pass over them (CenteredClip's fixed point
        takes a few). Returns the aggregate's spans, to be read once in order, and the clip."""
        if self.rule == "mean" or len(factors) < MIN_OUTLIER_GROUP:
            return (weighted_sum(values, factors) for values in spans()), None
        if self.rule == "trimmed":
            return (_trimmed_mean(values, factors, self.param) for values in spans()), None
        return _centered_clip(spans, factors, self.param)


MEAN = Aggregate()


def _trimmed_mean(flat: Sequence[torch.Tensor], factors: Sequence[float], beta: float) -> torch.Tensor:
    n, cut = len(flat), int(beta * len(flat))
    weights = torch.tensor(factors, dtype=torch.float32)
    out = torch.empty_like(flat[0])
    for start in range(0, out.numel(), _ROBUST_SLICE):
        values = torch.stack([t[start : start + _ROBUST_SLICE] for t in flat])  # (n, slice)
        ordered, order = values.sort(dim=0, stable=True)
        kept = weights[order[cut : n - cut]]  # each coordinate's own survivors' weights
        total = kept.sum(dim=0)
        mean = (ordered[cut : n - cut] * kept).sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny)
        out[start : start + _ROBUST_SLICE] = mean * float(weights.sum())
    return out


def weighted_sum(tensors: Sequence[torch.Tensor], factors: Sequence[float]) -> torch.Tensor:
    """Σ f_i x_i, accumulated in float32 in the order given (what a member's check of a mean assumes)."""
    total = torch.zeros_like(tensors[0])
    for t, f in zip(tensors, factors, strict=True):
        total.add_(t, alpha=f)
    return total


def clip_weights(factors: Sequence[float], rhos: Sequence[float]) -> list[float]:
    """The factors of CenteredClip's answer as a weighted mean: Σ f × f_i ρ_i / Σ f_j ρ_j (the fixed
    point v = Σ p_i ρ_i x_i / Σ p_j ρ_j, rescaled to Σ f as the other rules are). One function for
    the owner that answers and the members that check it, so both compute the same floats."""
    total = math.fsum(factors)
    clipped = math.fsum(f * r for f, r in zip(factors, rhos, strict=True))
    if clipped <= 0:
        raise ValueError("clip factors leave no weight")
    return [total * f * r / clipped for f, r in zip(factors, rhos, strict=True)]


def clip_factor(distance: float, tau: float) -> float:
    """ρ = min(1, τ / d): 1 within the radius (and where τ is 0: nothing to scale by)."""
    return 1.0 if distance <= tau or tau <= 0 else tau / distance


def _distances(
    spans: Callable[[], Iterator[Sequence[torch.Tensor]]],
    center: Callable[[Sequence[torch.Tensor]], torch.Tensor],
) -> list[float]:
    """‖x_i − v‖ for each payload, v formed a span at a time by `center` from the payloads' values
    there (so v is never whole), in slices of `_ROBUST_SLICE` (no whole-part temporary): each
    slice's squares summed in float32 (~1e-6 relative, far inside `CLIP_AGREEMENT`), the slices in
    float64."""
    squares: list[float] = []
    for values in spans():
        v = center(values)
        squares = squares or [0.0] * len(values)
        diff = torch.empty(min(_ROBUST_SLICE, v.numel()), dtype=v.dtype)
        for start in range(0, v.numel(), _ROBUST_SLICE):
            at = v[start : start + _ROBUST_SLICE]
            part = diff[: len(at)]
            for i, t in enumerate(values):
                torch.sub(t[start : start + _ROBUST_SLICE], at, out=part)
                squares[i] += float(torch.dot(part, part))
    return [math.sqrt(s) for s in squares]


def _median(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of the payloads' values of a span, `_ROBUST_SLICE` at a time."""
    out = torch.empty_like(values[0])
    for start in range(0, out.numel(), _ROBUST_SLICE):
        stacked = torch.stack([t[start : start + _ROBUST_SLICE] for t in values])
        out[start : start + _ROBUST_SLICE] = stacked.median(dim=0).values
    return out


def _centered_clip(
    spans: Callable[[], Iterator[Sequence[torch.Tensor]]], factors: Sequence[float], c: float
) -> tuple[Iterator[torch.Tensor], Clip]:
    """CenteredClip's fixed point as a verifiable weighted mean (`Clip`): from the coordinate-wise
    median, v ← Σ p_i ρ_i x_i / Σ p_j ρ_j (the M-estimator's reweighting step: CenteredClip's
    v + Σ p_i ρ_i (x_i − v) with the step normalized, the same fixed point) with ρ_i and τ taken at
    v, until the factors taken at the new v agree with the ones that made it to a quarter of
    `CLIP_AGREEMENT` and τ to half of `CLIP_RADIUS_AGREEMENT`, at most `CLIP_MAX_ITERATIONS` times.
    Each payload moves v by at most p_i τ / Σ p_j ρ_j however it was crafted. The answer is Σ g_i x_i
    with `clip_weights`: at the fixed point, what the iteration converges to (its spans, as
    `Aggregate.combine_spans` gives them). Each iteration is one pass over the payloads' spans: v
    is a weighted mean of them, so its span is formed where its distances are summed."""
    total = math.fsum(factors)
    shares = [f / total for f in factors] if total > 0 else [1.0 / len(factors)] * len(factors)
    distances = _distances(spans, _median)
    for _ in range(CLIP_MAX_ITERATIONS):
        tau = c * statistics.median(distances)
        rhos = [clip_factor(d, tau) for d in distances]
        distances = _distances(spans, functools.partial(weighted_sum, factors=clip_weights(shares, rhos)))
        held = [clip_factor(d, tau) for d in distances]
        radius = c * statistics.median(distances)
        if (
            all(abs(a - b) <= CLIP_AGREEMENT / 4 * b for a, b in zip(rhos, held, strict=True))
            and abs(tau - radius) <= CLIP_RADIUS_AGREEMENT / 2 * radius
        ):
            break
    else:  # members may find the factors off and refuse the answer: say why, on the owner's side
        logger.warning(
            "CenteredClip did not settle in %d iterations (factors %s at the answer %s, radius %.6g"
            " against %.6g)",
            CLIP_MAX_ITERATIONS,
            rhos,
            held,
            tau,
            radius,
        )
    weights = clip_weights(factors, rhos)
    return (weighted_sum(values, weights) for values in spans()), Clip(tau, dict(enumerate(rhos)))


def assign_parts(sizes: Sequence[int], num_members: int) -> list[int]:
    """Owner member index per tensor: greedy largest-first onto the least-loaded member.

    Tensors are taken by size descending (ties: lower index first) and each goes to the member
    with the smallest load so far (ties: lower member index). Depends on nothing but the inputs.
    """
    if num_members < 1:
        raise ValueError(f"num_members must be >= 1, got {num_members}")
    if any(size < 0 for size in sizes):
        raise ValueError("tensor sizes must be non-negative")
    loads = [0] * num_members
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        member = min(range(num_members), key=lambda j: (loads[j], j))
        owners[index] = member
        loads[member] += sizes[index]
    return owners


def deal_parts(sizes: Sequence[int], members: Sequence[str], owners: Sequence[str]) -> list[int]:
    """Owner per tensor, as an index into `members`: `assign_parts` over `owners` (distinct members,
    in the order the group deals parts to them). ValueError for owners that are not that."""
    if not owners or not set(owners) <= set(members) or len(set(owners)) != len(owners):
        raise ValueError("owners must be distinct members of the group")
    at = {p: i for i, p in enumerate(members)}
    return [at[owners[i]] for i in assign_parts(sizes, len(owners))]


def check_outlier_factor(factor: float | None) -> float | None:
    """`factor` if it is a valid outlier factor (None or >= 0, finite); ValueError otherwise."""
    if factor is not None and not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"outlier_factor must be None or a finite number >= 0, got {factor}")
    return factor


_NORM_CHUNK = 1 << 16


def tensor_norm(tensor: torch.Tensor) -> float:
    """The L2 norm screening compares: a member commits to this number for each of its payloads
    (`verify`), and its owner compares it with its own (`norms_agree`). Finite exactly when every
    value is: the squares are summed in float32 per chunk of 2**16 values (30x faster than a float64
    pass; ~1e-7 relative) and the chunks in float64, and a chunk whose float32 sum overflows is summed
    again in float64, where the squares of finite float32 values cannot overflow."""
    norm = Norm()
    norm.add(tensor.reshape(-1))
    return norm.value


def payload_norm(payload: bytes) -> float:
    """`tensor_norm(decode(payload))`, bit for bit, from its decoded spans (never decoded whole)."""
    norm = Norm()
    for span in decoded_spans(payload):
        norm.add(span)
    return norm.value


class Norm:
    """`tensor_norm` of the values `add`ed so far, in order: the same number whether they come
    whole or in spans of whole chunks (as `codecs.decoded_spans` yields them)."""

    def __init__(self) -> None:
        self._squares = 0.0

    def add(self, flat: torch.Tensor) -> None:
        for start in range(0, flat.numel(), _NORM_CHUNK):
            chunk = flat[start : start + _NORM_CHUNK].float()
            squares = float(torch.dot(chunk, chunk))
            if not math.isfinite(squares):
                wide = chunk.to(torch.float64)
                squares = float(torch.dot(wide, wide))
            self._squares += squares

    @property
    def value(self) -> float:
        return math.sqrt(self._squares)


def screen_part(
    tensors: Sequence[torch.Tensor], outlier_factor: float | None, work: Sequence[float] | None = None
) -> dict[int, str]:
    """Why each rejected tensor of one part is rejected, by index: `screen_norms` of their norms."""
    return screen_norms([tensor_norm(t) for t in tensors], outlier_factor, work)


def screen_norms(
    norms: Sequence[float], outlier_factor: float | None, work: Sequence[float] | None = None
) -> dict[int, str]:
    """Why each rejected payload of one part is rejected, by index, from the payloads' L2 norms.

    A payload whose norm is not finite (it holds a NaN or inf) is rejected. Among the finite ones,
    when there are at least `MIN_OUTLIER_GROUP` of them and `outlier_factor` is neither None nor 0,
    one whose norm exceeds `outlier_factor` × their median norm is rejected too (with a median of 0,
    any payload that is not all zeros). With `work` (the work behind each payload, each ≥ 0), the
    norms compared are norm / work: a payload may be as much larger than the others as its work is;
    one that claims no work is left out (it weighs nothing) before the median. A function of these
    numbers alone, so anyone holding them (a member checking its owner's answer, `verify`) reaches
    the same decisions.
    """
    if work is not None and (len(work) != len(norms) or not all(w >= 0 for w in work)):
        raise ValueError(f"work must be one number >= 0 per tensor, got {list(work)}")
    rejected = {i: "non-finite values" for i, norm in enumerate(norms) if not math.isfinite(norm)}
    scale = list(work) if work is not None else [1.0] * len(norms)
    # A payload that claims no work counts for nothing (its weight is 0 too), and is left out before
    # the median: one such claim cannot change how the others are judged, nor the mean's scale.
    for i in range(len(norms)):
        if i not in rejected and scale[i] == 0:
            rejected[i] = "claims no work"
    finite = {i: norm / scale[i] for i, norm in enumerate(norms) if i not in rejected and scale[i] > 0}
    if not outlier_factor or len(finite) < MIN_OUTLIER_GROUP:
        return rejected
    median = statistics.median(finite.values())
    what = "norm per unit of work" if work is not None else "norm"
    for i, norm in finite.items():
        if norm > outlier_factor * median:
            rejected[i] = (
                f"{what} {norm / median:.1f}x the median"
                if median > 0
                else f"{what} {norm:.3g} while the median is 0"
            )
    return dict(sorted(rejected.items()))


def screening_work(tokens: Sequence[float] | None, work_cap: float | None) -> list[float] | None:
    """The work `screen_part` divides each norm by: the claimed tokens, each at most `work_cap`
    (the round's reference work; None: no cap). None, so raw norms, without tokens or when no
    claim is above 0 (nothing says what any payload's work was). A claim of 0 is judged alone
    (`screen_norms`): it no longer switches everyone to raw norms, as one zero-token claim did."""
    if tokens is None or not any(t > 0 for t in tokens):
        return None
    if work_cap is not None and not work_cap > 0:
        raise ValueError(f"work_cap must be > 0, got {work_cap!r}")
    return [min(t, work_cap) if work_cap is not None else float(t) for t in tokens]


SCORED, MISMATCH, SCREENED = "scored", "mismatch", "screened"
"""Why an owner left a payload out, as its signed answer states it (`verify`): its scorer excluded
the contributor (judged on a batch only the owner holds); the payload's norm differs from the one its
member committed to (only that member can check it); or the screening rejected it (every member
recomputes that from the committed norms)."""
NORM_AGREEMENT = 1e-5
"""Relative difference within which an owner's norm of a payload and the member's committed one
agree: both are `tensor_norm` of the same decoded values, so only the summation order of another
machine's kernels can set them apart (~1e-7). What it leaves a member is a norm shaded by 1e-5."""


def norms_agree(actual: float, claimed: float) -> bool:
    """Whether `claimed` is the norm `actual` (both `tensor_norm`s): equal to `NORM_AGREEMENT`, or
    both not finite."""
    if not (math.isfinite(actual) and math.isfinite(claimed)):
        return not math.isfinite(actual) and not math.isfinite(claimed)
    return abs(actual - claimed) <= NORM_AGREEMENT * max(abs(actual), abs(claimed))


@dataclass(frozen=True)
class ReducedPart:
    """One part as its owner reduced it: the bytes sent to every member, and what was left out.

    `rejected` maps the index of each payload left out of the average to the reason, `codes` to its
    kind (`SCORED`, `MISMATCH` or `SCREENED`); `clip`, what a CenteredClip answer states (its
    factors by payload index), else None.
    """

    payload: bytes
    rejected: dict[int, str]
    codes: dict[int, str] = field(default_factory=dict)
    clip: Clip | None = None


def reduce_part(
    payloads: Sequence[bytes],
    weights: Sequence[float],
    codec: Codec,
    key: str,
    *,
    tokens: Sequence[float] | None = None,
    outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
    aggregate: Aggregate = MEAN,
    excluded: Mapping[int, str] | None = None,
    work_cap: float | None = None,
    claimed_norms: Sequence[float] | None = None,
) -> ReducedPart:
    """Decode every member's payload of one tensor, screen them, average the rest, re-encode.

    Payloads that `screen_part` rejects are left out of the sum and of its normalizer. The weighted
    sum runs in float32 in the order given; the returned payload is what the owner sends to every
    member. The sum is divided by the accepted payloads' Σ weights, or, when `tokens` is given and
    every accepted payload has tokens > 0, by their Σ tokens: the weights are then tokens ×
    staleness weight, so a down-weighted late contribution is smaller in absolute terms, not only
    relative to the others. When nothing is left (every payload rejected, or the accepted ones all
    weigh 0) the average is zeros. A single accepted payload that is its own average is forwarded
    unchanged. `excluded` (index -> why, from a scorer) are rejected before the screening looks at the
    others. The screening compares norms per claimed token, each claim capped at `work_cap`
    (`screening_work`). With `claimed_norms` (the norms the members committed to, `verify`), a
    payload whose norm differs from its claim is rejected (`MISMATCH`) and the screening decides on
    the claimed norms, so that every member can recompute it. With a `downlink.Gather` codec and the
    mean, the accepted payloads themselves are sent, as one sum payload with the mean's factors; the
    robust rules always encode their result. Raises ValueError on empty, negative, non-finite or
    zero-sum weights, on negative or non-finite tokens, on a count mismatch, on an undecodable
    payload and on differing shapes.
    """
    _check_inputs(payloads, weights, tokens)
    check_outlier_factor(outlier_factor)
    shapes = {payload_shape(payload) for payload in payloads}  # every check decoding makes
    if len(shapes) != 1:
        raise ValueError(f"{key}: payload shapes differ: {sorted(shapes)}")
    (shape,) = shapes
    # A span of each payload at a time, never one decoded whole: the reduction runs beside the next
    # round's training step (overlap), where whole tensors were its peak (issue 28 §2).
    norms = [payload_norm(payload) for payload in payloads]
    excluded = dict(excluded or {})
    codes = dict.fromkeys(excluded, SCORED)
    if claimed_norms is not None:
        if len(claimed_norms) != len(norms):
            raise ValueError(f"{len(claimed_norms)} claimed norms for {len(norms)} payloads")
        for i, (norm, claimed) in enumerate(zip(norms, claimed_norms, strict=True)):
            if i not in excluded and not norms_agree(norm, claimed):
                excluded[i] = f"norm {norm:.9g} differs from its commitment {claimed:.9g}"
                codes[i] = MISMATCH
        norms = [float(n) for n in claimed_norms]
    rejected = _screen(norms, outlier_factor, excluded, screening_work(tokens, work_cap))
    codes = {i: codes.get(i, SCREENED) for i in rejected}
    accepted = [i for i in range(len(payloads)) if i not in rejected]
    normalized = _normalized(
        [weights[i] for i in accepted], None if tokens is None else [tokens[i] for i in accepted]
    )
    if normalized is None:
        return ReducedPart(codec.encode_spans(key, shape, _zero_spans(math.prod(shape))), rejected, codes)
    if normalized == [1.0]:
        # The average of one contribution is that contribution: forward its bytes rather than
        # re-encode them and add a second compression error.
        return ReducedPart(bytes(payloads[accepted[0]]), rejected, codes)
    gather = codec.for_part(key)
    if isinstance(gather, Gather) and aggregate.rule == "mean":
        # The contributions travel as they came, with the factors of their mean (`downlink`).
        return ReducedPart(gather.gather([payloads[i] for i in accepted], normalized), rejected, codes)
    if aggregate.rule == "mean" or len(accepted) < MIN_OUTLIER_GROUP:  # the mean, a span at a time
        spans = zip(*(decoded_spans(payloads[i]) for i in accepted), strict=True)
        sums = (weighted_sum(values, normalized) for values in spans)
        return ReducedPart(codec.encode_spans(key, shape, sums), rejected, codes)

    # The robust rules read the payloads a span at a time too, once per pass (CenteredClip's
    # iterations): a group of three's owner held each tensor of its part decoded three times over
    # and twice more in its answers (0.63 GiB at GPT-2 124M's embedding).
    def read_spans() -> Iterator[Sequence[torch.Tensor]]:
        return zip(*(decoded_spans(payloads[i]) for i in accepted), strict=True)

    average, clip = aggregate.combine_spans(read_spans, normalized)
    if clip is not None:
        clip = Clip(clip.tau, {accepted[j]: rho for j, rho in clip.rhos.items()})
    return ReducedPart(codec.encode_spans(key, shape, average), rejected, codes, clip)


def _zero_spans(numel: int) -> Iterator[torch.Tensor]:
    for start in range(0, numel, SPAN):
        yield torch.zeros(min(SPAN, numel - start))


def _screen(
    norms: Sequence[float],
    outlier_factor: float | None,
    excluded: Mapping[int, str],
    work: Sequence[float] | None,
) -> dict[int, str]:
    """`screen_norms` over the payloads not already `excluded`, with the excluded ones added."""
    if any(not 0 <= i < len(norms) for i in excluded):
        raise ValueError(f"excluded indices must be in [0, {len(norms)}), got {sorted(excluded)}")
    rest = [i for i in range(len(norms)) if i not in excluded]
    screened = screen_norms(
        [norms[i] for i in rest], outlier_factor, None if work is None else [work[i] for i in rest]
    )
    return dict(sorted({**excluded, **{rest[j]: why for j, why in screened.items()}}.items()))


def screened_out(
    norms: Sequence[float],
    tokens: Sequence[float],
    *,
    given: Mapping[int, str],
    outlier_factor: float | None,
    work_cap: float | None,
) -> set[int]:
    """The payloads the screening rejects when the ones in `given` (index -> `SCORED` or
    `MISMATCH`) are left out first: what an owner that screened on these claimed norms must have
    marked `SCREENED`, recomputed by anyone holding the commitments (`verify`)."""
    screened = _screen(norms, outlier_factor, given, screening_work(tokens, work_cap))
    return {i for i in screened if i not in given}


def accepted_factors(
    weights: Sequence[float], tokens: Sequence[float], accepted: Sequence[int]
) -> list[float] | None:
    """The factors an owner's mean gives the `accepted` payloads (`reduce_part`'s arithmetic); None
    when nothing weighs."""
    return _normalized([weights[i] for i in accepted], [tokens[i] for i in accepted])


@dataclass(frozen=True)
class ReducedParts:
    """Several parts as one owner reduced them over the same contributors.

    `averaged`: part -> the bytes sent to every member. `rejected`: contributor -> how many of its
    payloads the screening left out. `rejections`: (part, contributor, reason) for each of them.
    `codes`: part -> {contributor index: `SCORED`, `MISMATCH` or `SCREENED`}, what the owner's signed
    answer states, with `clips`: part -> its CenteredClip statement, where the rule clipped.
    """

    averaged: dict[str, bytes]
    rejected: dict[str, int]
    rejections: list[tuple[str, str, str]]
    codes: dict[str, dict[int, str]] = field(default_factory=dict)
    clips: dict[str, Clip] = field(default_factory=dict)


def reduce_parts(
    keys: Sequence[str],
    contributors: Sequence[str],
    payloads: Callable[[int, str], bytes],
    weights: Sequence[float],
    tokens: Sequence[float],
    codec: Codec,
    *,
    outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
    aggregate: Aggregate = MEAN,
    scorer: Scorer | None = None,
    work_cap: float | None = None,
    claimed_norms: Callable[[int, str], float] | None = None,
) -> ReducedParts:
    """`reduce_part` for each of `keys` over the same contributors: the one reduction every transport
    runs (the in-process `allreduce.reduce_group` for all parts, a network owner for its own).

    `payloads(i, key)` is contributor i's payload of `key`; `weights[i]` / `tokens[i]` its averaging
    weight and tokens. With a `scorer`, each contributor's decoded payloads of `keys` are judged
    first (`scoring.Scorer`) and the excluded ones are left out of every part. `work_cap`: the
    round's reference work, at which each claimed token count is capped for the screening
    (`screening_work`). `claimed_norms(i, key)`: the norm contributor i committed to for its payload
    of `key` (`reduce_part`'s `claimed_norms`). Raises ValueError as `reduce_part` does.
    """
    excluded: dict[int, str] = {}
    if scorer is not None:
        excluded = scorer(len(contributors), lambda i: {key: decode(payloads(i, key)) for key in keys})
    averaged: dict[str, bytes] = {}
    codes: dict[str, dict[int, str]] = {}
    clips: dict[str, Clip] = {}
    rejections: list[tuple[str, str, str]] = []
    for key in keys:
        part = reduce_part(
            [payloads(i, key) for i in range(len(contributors))],
            weights,
            codec,
            key,
            tokens=tokens,
            outlier_factor=outlier_factor,
            aggregate=aggregate,
            excluded=excluded,
            work_cap=work_cap,
            claimed_norms=None
            if claimed_norms is None
            else [claimed_norms(i, key) for i in range(len(contributors))],
        )
        averaged[key] = part.payload
        codes[key] = part.codes
        if part.clip is not None:
            clips[key] = part.clip
        rejections += [(key, contributors[i], reason) for i, reason in part.rejected.items()]
    rejected: dict[str, int] = {}
    for _, peer, _ in rejections:
        rejected[peer] = rejected.get(peer, 0) + 1
    return ReducedParts(averaged, dict(sorted(rejected.items())), rejections, codes, clips)


def merge_rejected(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Sum per-contributor rejection counts (e.g. over the owners of a round), sorted by peer."""
    total: dict[str, int] = {}
    for count in counts:
        for peer, n in count.items():
            total[peer] = total.get(peer, 0) + n
    return dict(sorted(total.items()))


def _check_inputs(
    payloads: Sequence[bytes], weights: Sequence[float], tokens: Sequence[float] | None
) -> None:
    if not weights:
        raise ValueError("reduce_part needs at least one weight")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    if math.fsum(weights) <= 0:
        raise ValueError("weights sum to 0")
    if len(payloads) != len(weights):
        raise ValueError(f"{len(payloads)} payloads but {len(weights)} weights")
    if tokens is not None:
        if len(tokens) != len(weights):
            raise ValueError(f"{len(tokens)} token counts but {len(weights)} weights")
        if any(not math.isfinite(t) or t < 0 for t in tokens):
            raise ValueError(f"tokens must be finite and non-negative, got {list(tokens)}")


def _normalized(weights: Sequence[float], tokens: Sequence[float] | None) -> list[float] | None:
    """Per-payload factors of the average (w / Σ weights, or w / Σ tokens); None if nothing weighs."""
    total = math.fsum(weights)
    if total <= 0:
        return None
    normalized = [w / total for w in weights]
    if tokens is not None and all(t > 0 for t in tokens):
        # (w / Σw) · (Σw / Σt) rather than w / Σt: the arithmetic of the first release, kept so that
        # a round with nothing rejected gives the same bytes as it always did.
        scale = total / math.fsum(tokens)
        normalized = [w * scale for w in normalized]
    return normalized


def round_traffic(
    owners: Sequence[int], up_sizes: Sequence[Sequence[int]], down_sizes: Sequence[int], num_members: int
) -> tuple[list[int], list[int]]:
    """Exact (sent, received) bytes per member for one owner-reduces all-reduce round.

    Member i sends its payload of tensor t (`up_sizes[i][t]` bytes) to `owners[t]` unless it is
    the owner; the owner sends the reduced payload (`down_sizes[t]` bytes) to every other member.
    """
    _check_traffic_shapes(owners, up_sizes, down_sizes, num_members)
    sent = [0] * num_members
    received = [0] * num_members
    for part, owner in enumerate(owners):
        for member in range(num_members):
            if member == owner:
                continue
            sent[member] += up_sizes[member][part]
            received[owner] += up_sizes[member][part]
            sent[owner] += down_sizes[part]
            received[member] += down_sizes[part]
    return sent, received


def most_bytes_moved(
    sizes: Sequence[int], owners: Sequence[int], num_members: int, answers: Sequence[int] | None = None
) -> int:
    """The most payload bytes one member sends or receives in a round where every member's payload
    of tensor t is `sizes[t]` bytes and the average `answers[t]` (default: `sizes[t]`), both phases
    together: what the slowest link of the group must carry, and what the exchange's deadlines are
    sized for."""
    down = sizes if answers is None else answers
    sent, received = round_traffic(owners, [sizes] * num_members, down, num_members)
    return max(*sent, *received)


def _check_traffic_shapes(
    owners: Sequence[int], up_sizes: Sequence[Sequence[int]], down_sizes: Sequence[int], num_members: int
) -> None:
    if len(up_sizes) != num_members:
        raise ValueError(f"up_sizes has {len(up_sizes)} rows for {num_members} members")
    if any(len(row) != len(owners) for row in up_sizes) or len(down_sizes) != len(owners):
        raise ValueError(f"every size list must have one entry per tensor ({len(owners)})")
    if any(not 0 <= owner < num_members for owner in owners):
        raise ValueError(f"owners must be member indices in [0, {num_members})")
