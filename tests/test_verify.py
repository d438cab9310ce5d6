"""The math of checking an owner's answer (protocol/algorithms/verify.py), with no network.

An honest owner's answer passes, for every codec, screening and rule; a lying one fails: scaled,
replaced by noise, zeroed under an inflated block scale, screened otherwise than the committed
norms say, a forwarded or gathered contribution swapped. The directions are reproducible from the
seed alone, whatever the chunking.
"""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import pytest
import torch

from adloco.protocol.algorithms import verify
from adloco.protocol.algorithms.codecs import SPAN, Int8Codec, decode, error_bound, make_codec, sum_payload
from adloco.protocol.algorithms.downlink import Gather
from adloco.protocol.algorithms.parts import MEAN, SCREENED, Aggregate, Clip, reduce_part, tensor_norm
from adloco.protocol.algorithms.verify import Claim, Misanswer, Misprojection

SEED = b"\x07" * 32
SHAPE = (96, 130)  # 12,480 values: 195 int8 blocks, a partial last direction chunk


def _members(n: int, spec: str, *, seed: int, scale: float = 1.0) -> tuple[list[bytes], list[Claim]]:
    g = torch.Generator().manual_seed(seed)
    codec = make_codec(spec)
    payloads, claims = [], []
    for i in range(n):
        payload = codec.encode("w", torch.randn(*SHAPE, generator=g) * scale * (1 + 0.1 * i))
        payloads.append(payload)
        tokens = 100.0 * (i + 1)
        claims.append(Claim(tokens, tokens, tensor_norm(decode(payload)), verify.payload_digest(payload)))
    return payloads, claims


def _check(
    payload: bytes,
    payloads: list[bytes],
    claims: list[Claim],
    codes: dict[int, str],
    aggregate: Aggregate = MEAN,
) -> None:
    """What a member does with one part's answer (verify's steps 1-4), all projections known."""
    factors = verify.expected_factors(claims, codes, outlier_factor=10.0, work_cap=None)
    decoded = decode(payload)
    if verify.check_exact(payload, claims, factors):
        return
    assert factors is not None
    facts = verify.answer_facts(payload, SEED, "w")
    verify.check_bound(facts, claims, factors, aggregate)
    tolerance = verify.mean_tolerance(facts, claims, factors)
    if aggregate.rule != "mean" or tolerance is None:
        return
    projections = {i: verify.project_payload(p, SEED, "w") for i, p in enumerate(payloads)}
    for i, s in projections.items():
        verify.check_projection(s, claims[i])
    verify.check_mean(verify.project(decoded, SEED, "w"), projections, claims, factors, tolerance)


def _honest(
    payloads: list[bytes], claims: list[Claim], spec: str, aggregate: Aggregate = MEAN
) -> tuple[bytes, dict[int, str]]:
    part = reduce_part(
        payloads,
        [c.weight for c in claims],
        make_codec(spec),
        "w",
        tokens=[c.tokens for c in claims],
        aggregate=aggregate,
        claimed_norms=[c.norm for c in claims],
    )
    return part.payload, part.codes


def test_the_direction_is_the_seeds_alone_whatever_the_chunking() -> None:
    numel = 3 * verify.PROJECTION_CHUNK + 17
    whole = torch.cat(list(verify.direction(SEED, "w", numel)))
    assert whole.dtype == torch.float64 and whole.numel() == numel
    assert float(whole.min()) >= -1.0 and float(whole.max()) < 1.0
    assert torch.equal(whole, torch.cat(list(verify.direction(SEED, "w", numel))))
    # A shorter part's direction is the start of a longer one's; another key or seed is another z.
    assert torch.equal(torch.cat(list(verify.direction(SEED, "w", 1000))), whole[:1000])
    assert not torch.equal(torch.cat(list(verify.direction(SEED, "v", 1000))), whole[:1000])
    assert abs(float(whole.mean())) < 0.01 and abs(float(whole.var()) - 1 / 3) < 0.01
    x = torch.randn(numel)
    assert verify.project(x, SEED, "w") == pytest.approx(float(torch.dot(x.double(), whole)), rel=1e-12)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_an_honest_mean_passes_for_every_codec(spec: str, n: int) -> None:
    for seed in range(4):
        payloads, claims = _members(n, spec, seed=seed, scale=10.0 ** (seed - 2))
        answer, codes = _honest(payloads, claims, spec)
        _check(answer, payloads, claims, codes)


_G = torch.Generator().manual_seed(0)
LIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "scaled-50": lambda v: v * -50.0,  # the attack: the true average scaled by -50
    "1e30": lambda v: v * 1e30,
    "sign": lambda v: -v,  # a sign flip: the norm it may have
    "noise": lambda v: torch.randn_like(v) * float(v.abs().mean()),  # noise of the average's size
    "shuffled": lambda v: v.reshape(-1)[
        torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))
    ].view_as(v),
}


@pytest.mark.parametrize("spec", ["int8", "none", "fp16", "int4"])
@pytest.mark.parametrize("lie", ["scaled-50", "1e30"])
def test_a_lie_beyond_the_contributions_norm_always_fails(spec: str, lie: str) -> None:
    for seed in range(5):
        payloads, claims = _members(3, spec, seed=seed)
        honest, codes = _honest(payloads, claims, spec)
        told = make_codec(spec).encode("w", LIES[lie](decode(honest)))
        with pytest.raises(Misanswer):
            _check(told, payloads, claims, codes)


def _pass_rate(
    told: bytes, payloads: list[bytes], claims: list[Claim], codes: dict[int, str], trials: int
) -> float:
    """How often `told` passes the projection check over `trials` independent directions."""
    factors = verify.expected_factors(claims, codes, outlier_factor=10.0, work_cap=None)
    assert factors is not None
    decoded = decode(told)
    facts = verify.answer_facts(told, None, "w")
    verify.check_bound(facts, claims, factors, MEAN)  # within the norm: only z can tell
    tolerance = verify.mean_tolerance(facts, claims, factors)
    assert tolerance is not None
    passed = 0
    for trial in range(trials):
        seed = trial.to_bytes(32, "little")
        projections = {i: verify.project_payload(p, seed, "w") for i, p in enumerate(payloads)}
        try:
            verify.check_mean(verify.project(decoded, seed, "w"), projections, claims, factors, tolerance)
            passed += 1
        except Misanswer:
            pass
    return passed / trials


@pytest.mark.parametrize("spec", ["int8", "none", "fp16"])
@pytest.mark.parametrize("lie", ["sign", "noise", "shuffled"])
def test_a_lie_within_the_norm_passes_as_rarely_as_its_size_says(spec: str, lie: str) -> None:
    """A lie e within the norm the contributions allow passes when |<e, z>| is within the tolerance
    t: for <e, z> ~ N(0, |e|^2 / 3), with probability erf(t √3 / (|e| √2)). Measured over 100
    directions, the pass rate is within that plus four standard errors (one-sided)."""
    trials = 100
    payloads, claims = _members(3, spec, seed=11)
    honest, codes = _honest(payloads, claims, spec)
    told = make_codec(spec).encode("w", LIES[lie](decode(honest)))
    factors = verify.expected_factors(claims, codes, outlier_factor=10.0, work_cap=None)
    assert factors is not None
    tolerance = verify.mean_tolerance(verify.answer_facts(told, None, "w"), claims, factors) or 0.0
    mean = sum(f * decode(payloads[i]) for i, f in factors)
    error = float((decode(told) - mean).norm())
    predicted = math.erf(tolerance * math.sqrt(3) / (error * math.sqrt(2)))
    rate = _pass_rate(told, payloads, claims, codes, trials)
    print(f"{spec} {lie}: passed {rate:.0%}, predicted {predicted:.1%}")
    assert rate <= predicted + 4 * math.sqrt(max(predicted, 1 / trials) / trials)


def test_a_small_lie_passes_as_often_as_its_size_says() -> None:
    """A lie of 10 % of the answer under int8 (a few times its rounding) passes often: the check
    catches lies by their size against the answer's own rounding, not every change."""
    payloads, claims = _members(3, "int8", seed=2)
    honest, codes = _honest(payloads, claims, "int8")
    told = make_codec("int8").encode("w", decode(honest) * 1.1)
    rate = _pass_rate(told, payloads, claims, codes, 100)
    print(f"a 10 % lie passed {rate:.0%} of 100 directions")
    assert 0.1 < rate < 1.0


def test_an_int8_block_zeroed_under_an_inflated_scale_is_refused() -> None:
    """Zeroing a block's values while keeping a large absmax would widen the bound to cover the
    lie; no honest encoder makes such a block, so the answer is refused outright."""
    payloads, claims = _members(3, "int8", seed=3)
    honest, codes = _honest(payloads, claims, "int8")
    header = len(honest) - 195 * 4 - SHAPE[0] * SHAPE[1]
    data_at = header + 195 * 4
    forged = bytearray(honest)
    forged[data_at : data_at + 64] = bytes(64)  # block 0 decodes to zeros, its absmax unchanged
    with pytest.raises(ValueError, match="absmax"):
        _check(bytes(forged), payloads, claims, codes)


def test_screening_is_recomputed_from_the_committed_norms() -> None:
    """A poisoned member (100x) is screened out by an honest owner and every member agrees; an
    owner that screens out an honest one instead, or keeps the poisoned one, is caught."""
    payloads, claims = _members(4, "int8", seed=4)
    g = torch.Generator().manual_seed(9)
    poisoned = make_codec("int8").encode("w", torch.randn(*SHAPE, generator=g) * 100)
    payloads[3] = poisoned
    claims[3] = Claim(
        claims[3].weight, claims[3].tokens, tensor_norm(decode(poisoned)), verify.payload_digest(poisoned)
    )
    answer, codes = _honest(payloads, claims, "int8")
    assert codes == {3: SCREENED}
    _check(answer, payloads, claims, codes)
    with pytest.raises(Misanswer, match="screened out"):
        verify.expected_factors(claims, {0: SCREENED}, outlier_factor=10.0, work_cap=None)
    with pytest.raises(Misanswer, match="screened out"):
        verify.expected_factors(claims, {}, outlier_factor=10.0, work_cap=None)


def test_exact_answers_forwarded_gathered_or_zero() -> None:
    payloads, claims = _members(3, "int8", seed=5)
    # One contribution accepted: forwarded as is, and any other bytes are a lie.
    codes = {1: "scored", 2: "scored"}
    factors = verify.expected_factors(claims, codes, outlier_factor=10.0, work_cap=None)
    assert factors == [(0, 1.0)]
    assert verify.check_exact(payloads[0], claims, factors)
    with pytest.raises(Misanswer):
        verify.check_exact(payloads[1], claims, factors)
    # Gathered: the accepted contributions with their factors.
    factors = verify.expected_factors(claims, {}, outlier_factor=10.0, work_cap=None)
    assert factors is not None
    gathered = Gather(make_codec("int8")).gather(payloads, [f for _, f in factors])
    assert verify.check_exact(gathered, claims, factors)
    swapped = sum_payload([payloads[0], payloads[0], payloads[2]], [f for _, f in factors])
    with pytest.raises(Misanswer):
        verify.check_exact(swapped, claims, factors)
    reweighed = sum_payload(payloads, [1.0, 0.0, 0.0])
    with pytest.raises(Misanswer):
        verify.check_exact(reweighed, claims, factors)
    # Nothing weighs: zeros, and anything else is a lie.
    zero = [Claim(0.0, 0.0, c.norm, c.digest) for c in claims]
    assert verify.expected_factors(zero, {}, outlier_factor=10.0, work_cap=None) is None
    zeros = make_codec("int8").encode("w", torch.zeros(*SHAPE))
    assert verify.check_exact(zeros, zero, None)
    with pytest.raises(Misanswer):
        verify.check_exact(payloads[0], zero, None)


@pytest.mark.parametrize(
    "spec, aggregate",
    [("lowrank:2", "mean"), ("sparse", "mean"), ("int8", "trimmed:0.2"), ("int8", "clip:1")],
)
def test_answers_checked_for_their_size_only(spec: str, aggregate: str) -> None:
    """Low-rank and sparse answers, and the robust rules: an honest answer is within its bound, one
    scaled by -50 is not."""
    rule = Aggregate.parse(aggregate)
    payloads, claims = _members(5, spec, seed=6)
    answer, codes = _honest(payloads, claims, spec, rule)
    _check(answer, payloads, claims, codes, rule)
    told = make_codec("none").encode("w", decode(answer) * -50)
    with pytest.raises(Misanswer, match="norm"):
        _check(told, payloads, claims, codes, rule)


def test_a_projection_beyond_its_committed_norm_is_refused_and_a_missing_one_widens_the_check() -> None:
    payloads, claims = _members(3, "int8", seed=7)
    answer, codes = _honest(payloads, claims, "int8")
    s = verify.project_payload(payloads[0], SEED, "w")
    verify.check_projection(s, claims[0])
    with pytest.raises(Misprojection):
        verify.check_projection(8 * claims[0].norm, claims[0])
    with pytest.raises(Misprojection):
        verify.check_projection(math.nan, claims[0])
    factors = verify.expected_factors(claims, codes, outlier_factor=10.0, work_cap=None)
    assert factors is not None
    decoded = decode(answer)
    tolerance = verify.mean_tolerance(verify.answer_facts(answer, None, "w"), claims, factors)
    assert tolerance is not None
    full = {i: verify.project_payload(p, SEED, "w") for i, p in enumerate(payloads)}
    t = verify.project(decoded, SEED, "w")
    verify.check_mean(t, full, claims, factors, tolerance)
    # Without member 2's projection, whatever it could have said is allowed: never stricter.
    verify.check_mean(t, {**full, 2: None}, claims, factors, tolerance)
    # A colluder's projection (within its norm) that hides a lie it cannot hide fully.
    lie = t + 100 * tolerance
    with pytest.raises(Misanswer):
        verify.check_mean(lie, full, claims, factors, tolerance)


def _clip_round(
    spec: str, *, seed: int, attacker: float | None = -3.0
) -> tuple[list[bytes], list[Claim], bytes, Aggregate, Clip]:
    """Four members' payloads of one part, three honest ones sharing a direction (cosine ~0.5, as Δs
    of one round do) and the last `attacker` × the first's (under the norm screening) claiming twice
    their tokens, and an honest owner's CenteredClip answer of them."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(*SHAPE, generator=g)
    codec = make_codec(spec)
    tensors = [(common + torch.randn(*SHAPE, generator=g)) * 0.7 for _ in range(4)]
    tokens = [200.0, 200.0, 200.0, 400.0]
    if attacker is not None:
        tensors[3] = tensors[0] * attacker
    payloads = [codec.encode("w", t) for t in tensors]
    claims = [
        Claim(t, t, tensor_norm(decode(p)), verify.payload_digest(p))
        for t, p in zip(tokens, payloads, strict=True)
    ]
    aggregate = Aggregate.parse("clip:1")
    part = reduce_part(
        payloads,
        [c.weight for c in claims],
        codec,
        "w",
        tokens=[c.tokens for c in claims],
        aggregate=aggregate,
        claimed_norms=[c.norm for c in claims],
    )
    assert part.clip is not None and not part.codes
    return payloads, claims, part.payload, aggregate, part.clip


def _check_clip(
    payloads: list[bytes],
    claims: list[Claim],
    answer: bytes,
    aggregate: Aggregate,
    clip: Clip,
    *,
    dots: dict[int, float | None] | None = None,
) -> None:
    """A member's check of a CenteredClip answer: the mean its stated factors make it (bound and
    projection), and the factors against the distances the contributors' inner products give."""
    mean = verify.expected_factors(claims, {}, outlier_factor=10.0, work_cap=None)
    factors = verify.stated_factors(clip, mean, aggregate)
    assert mean is not None and factors is not None
    decoded = decode(answer)
    facts = verify.answer_facts(answer, SEED, "w")
    verify.check_bound(facts, claims, factors, MEAN)
    tolerance = verify.mean_tolerance(facts, claims, factors)
    bound = error_bound(answer, decoded)
    assert tolerance is not None and bound is not None
    projections = {i: verify.project_payload(p, SEED, "w") for i, p in enumerate(payloads)}
    verify.check_mean(verify.project(decoded, SEED, "w"), projections, claims, factors, tolerance)
    if dots is None:
        dots = {i: verify.inner(decode(p), decoded) for i, p in enumerate(payloads)}
    norm = tensor_norm(decoded)
    for i, dot in dots.items():
        if dot is not None:
            verify.check_dot(dot, claims[i], norm)
    verify.check_clip(clip, claims, mean, aggregate.param, answer_norm=norm, rounding=bound.l2, dots=dots)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4"])
@pytest.mark.parametrize("attacker", [None, -3.0, 0.5])
def test_an_honest_centered_clip_answer_passes_as_the_weighted_mean_its_factors_make(
    spec: str, attacker: float | None
) -> None:
    """At CenteredClip's fixed point the answer is the mean with factors f_i ρ_i (rescaled): its
    projection checks it as any mean, and the stated ρ_i are min(1, τ / distance) at the answer,
    whatever the codec's rounding; with a contributor's inner product missing it still passes."""
    for seed in range(3):
        payloads, claims, answer, aggregate, clip = _clip_round(spec, seed=seed, attacker=attacker)
        _check_clip(payloads, claims, answer, aggregate, clip)
        dots = {i: verify.inner(decode(p), decode(answer)) for i, p in enumerate(payloads)}
        _check_clip(payloads, claims, answer, aggregate, clip, dots={**dots, 3: None})


def test_centered_clip_clips_the_attacker_and_bounds_its_pull() -> None:
    """−3 × a member's Δ at twice the claimed tokens: under the mean it outweighs the rest (the answer
    points away from the honest mean); clipped, its factor is well under 1 and the answer stays on
    the honest side (measured: ρ 0.3 against 0.86 and 1, the answer at +0.3 of the honest mean
    where the mean is at −0.6)."""
    payloads, claims, answer, _, clip = _clip_round("none", seed=0)
    honest = torch.stack([decode(p) for p in payloads[:3]]).mean(dim=0)
    assert clip.rhos[3] < 0.5 and min(clip.rhos[i] for i in range(3)) > 0.8
    mean = decode(_honest(payloads, claims, "none")[0])
    assert float(torch.dot(mean.reshape(-1), honest.reshape(-1))) < 0
    assert float(torch.dot(decode(answer).reshape(-1), honest.reshape(-1))) > 0


def _restated(clip: Clip, rhos: dict[int, float]) -> Clip:
    return Clip(clip.tau, {**clip.rhos, **rhos})


def _answered(payloads: list[bytes], claims: list[Claim], clip: Clip, spec: str) -> bytes:
    """The answer an owner stating `clip` must give for the projection to pass: the weighted mean."""
    mean = verify.expected_factors(claims, {}, outlier_factor=10.0, work_cap=None)
    assert mean is not None
    factors = verify.stated_factors(clip, mean, Aggregate.parse("clip:1"))
    assert factors is not None
    tensors = [decode(p) for p in payloads]
    total = torch.zeros_like(tensors[0])
    for i, f in factors:
        total.add_(tensors[i], alpha=f)
    return make_codec(spec).encode("w", total)


@pytest.mark.parametrize("spec", ["none", "int8"])
@pytest.mark.parametrize(
    "lie",
    ["attacker unclipped", "honest member halved", "radius doubled", "radius halved"],
)
def test_a_centered_clip_answer_whose_factors_lie_fails_though_its_projection_passes(
    spec: str, lie: str
) -> None:
    """The owner answers exactly the weighted mean its stated factors make (so the projection passes)
    but the factors are not CenteredClip's: the attacker's ρ set to 1 (the mean, colluding), an honest
    member's halved, or τ off by 2×. Only the distances from the contributors' inner products show it."""
    payloads, claims, _, aggregate, clip = _clip_round(spec, seed=1)
    if lie == "attacker unclipped":
        told = _restated(clip, {3: 1.0})
    elif lie == "honest member halved":
        told = _restated(clip, {0: clip.rhos[0] / 2})
    else:
        factor = 2.0 if lie == "radius doubled" else 0.5
        told = Clip(clip.tau * factor, clip.rhos)
    answer = _answered(payloads, claims, told, spec)
    with pytest.raises(Misanswer, match="clip"):
        _check_clip(payloads, claims, answer, aggregate, told)


def test_clip_statements_must_be_the_rules() -> None:
    """A clip statement where the rule does not clip (the mean, or under three payloads), none where
    it must, or factors of another set than the accepted payloads: each refused from the statement."""
    _, claims, _, aggregate, clip = _clip_round("int8", seed=2)
    mean = verify.expected_factors(claims, {}, outlier_factor=10.0, work_cap=None)
    assert mean is not None
    with pytest.raises(Misanswer, match="without its clip factors"):
        verify.stated_factors(None, mean, aggregate)
    with pytest.raises(Misanswer, match="clips nothing"):
        verify.stated_factors(clip, mean, MEAN)
    with pytest.raises(Misanswer, match="clips nothing"):
        verify.stated_factors(Clip(clip.tau, {0: 1.0, 1: 1.0}), mean[:2], aggregate)
    with pytest.raises(Misanswer, match="other payloads"):
        verify.stated_factors(Clip(clip.tau, {0: 1.0, 1: 1.0, 2: 1.0}), mean, aggregate)
    assert verify.stated_factors(None, mean[:2], aggregate) == mean[:2]


def test_an_inner_product_beyond_its_committed_norm_is_the_contributors_lie() -> None:
    payloads, claims, answer, _, _ = _clip_round("none", seed=0)
    decoded = decode(answer)
    true = verify.inner(decode(payloads[1]), decoded)
    verify.check_dot(true, claims[1], tensor_norm(decoded))
    with pytest.raises(Misprojection):
        verify.check_dot(claims[1].norm * tensor_norm(decoded) * 1.01, claims[1], tensor_norm(decoded))


@pytest.mark.parametrize("spec", ["int8", "int4", "fp16", "none", "int8:100"])
def test_a_members_check_reads_an_answer_a_span_at_a_time(spec: str) -> None:
    """`answer_facts` reads an answer of 8 Mi + 77 values span by span and finds what the whole
    decode gives: `tensor_norm`, `project` and `error_bound` of it, the norm and projection bit for
    bit (blocks of 100 straddle the spans); the projections and inner products a member sends of
    its own payloads too. Reading it allocates (traced) a few spans, where its whole decode alone
    is 32 MiB: the checks run beside the next round's training step (issue 28 §2)."""
    codec = Int8Codec(100) if spec == "int8:100" else make_codec(spec)
    generator = torch.Generator().manual_seed(9)
    answer = codec.encode("w", torch.randn(8 * SPAN + 77, generator=generator))
    other = codec.encode("w", torch.randn(8 * SPAN + 77, generator=generator))
    decoded = decode(answer)
    tracemalloc.start()
    try:
        facts = verify.answer_facts(answer, SEED, "w")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 4 * SPAN < 4 * decoded.numel()
    assert facts.norm == tensor_norm(decoded)
    assert facts.projection == verify.project(decoded, SEED, "w")
    assert verify.answer_facts(answer, None, "w").projection == 0.0
    bound = error_bound(answer, decoded)
    assert facts.rounding is not None and bound is not None
    assert facts.rounding.l2 == pytest.approx(bound.l2, rel=1e-12)
    assert facts.rounding.peak == pytest.approx(bound.peak, rel=1e-12)
    assert verify.project_payload(other, SEED, "w") == verify.project(decode(other), SEED, "w")
    assert verify.inner_payloads(other, answer) == verify.inner(decode(other), decoded)


def test_a_block_that_no_honest_encoder_made_is_caught_across_spans() -> None:
    """An int8 answer (blocks of 100, which straddle the spans) whose block 10485, split between the
    first and second span, holds a largest value below its scale: `answer_facts` raises as
    `error_bound` does, as it does for a block inside a span."""
    codec = Int8Codec(100)
    tensor = torch.randn(2 * SPAN, generator=torch.Generator().manual_seed(10))
    for block in (10485, 3):  # straddling SPAN (1048576 = 10485 * 100 + 76), and inside the first
        lie = bytearray(codec.encode("w", tensor))
        at = len(lie) - tensor.numel() + block * 100  # the block's values
        lie[at : at + 100] = bytes(100)  # zeros under a nonzero scale
        with pytest.raises(ValueError, match="no honest encoder"):
            error_bound(bytes(lie), decode(bytes(lie)))
        with pytest.raises(ValueError, match="no honest encoder"):
            verify.answer_facts(bytes(lie), SEED, "w")
