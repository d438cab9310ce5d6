"""Parts: deterministic owner assignment, screened weighted reduction of payloads, exact traffic."""

from __future__ import annotations

import math
import tracemalloc

import pytest
import torch

from adloco.protocol.algorithms.codecs import SPAN, decode, make_codec
from adloco.protocol.algorithms.parts import (
    DEFAULT_OUTLIER_FACTOR,
    Aggregate,
    assign_parts,
    most_bytes_moved,
    reduce_part,
    round_traffic,
    screen_part,
    screening_work,
)

NONE = make_codec("none")


def encoded(*values: float) -> bytes:
    return NONE.encode("t", torch.tensor(values))


# --- assign_parts -------------------------------------------------------------------------------


def test_assign_parts_hand_computed() -> None:
    # Order by size: t2 (8), t0 (5), t1 (3), t3 (3, higher index), t4 (1).
    # Loads: t2 -> m0 (8, 0); t0 -> m1 (8, 5); t1 -> m1 (8, 8); t3 -> m0 on tie (11, 8); t4 -> m1.
    assert assign_parts([5, 3, 8, 3, 1], 2) == [1, 1, 0, 0, 1]


def test_assign_parts_edge_cases() -> None:
    assert assign_parts([4, 4], 3) == [0, 1]
    assert assign_parts([], 4) == []
    assert assign_parts([0, 0, 0], 2) == [0, 0, 0]  # loads only; zero bytes never break the tie
    assert assign_parts([7, 1, 1, 1, 1], 1) == [0] * 5
    with pytest.raises(ValueError):
        assign_parts([1], 0)
    with pytest.raises(ValueError):
        assign_parts([1, -1], 2)


def test_assign_parts_is_deterministic_and_balanced() -> None:
    sizes = [int(s) for s in torch.randint(1, 10_000, (200,), generator=torch.Generator().manual_seed(0))]
    owners = assign_parts(sizes, 5)
    assert owners == assign_parts(list(sizes), 5) == assign_parts(tuple(sizes), 5)
    loads = [sum(size for size, owner in zip(sizes, owners, strict=True) if owner == m) for m in range(5)]
    assert max(loads) - min(loads) <= max(sizes)


# --- reduce_part --------------------------------------------------------------------------------


def test_reduce_part_weighted_average_hand_computed() -> None:
    out = reduce_part([encoded(1.0, 2.0), encoded(3.0, 4.0)], [1.0, 3.0], NONE, "t")
    assert out.payload == encoded(2.5, 3.5) and out.rejected == {}
    assert reduce_part([encoded(1.0, 2.0), encoded(3.0, 4.0)], [2, 2], NONE, "t").payload == encoded(2.0, 3.0)


def test_reduce_part_accepts_mixed_codecs_and_reencodes() -> None:
    x, y = torch.tensor([0.5, -1.0, 0.25, 1.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])
    payloads = [make_codec("int8").encode("t", x), make_codec("fp16").encode("t", y)]
    out = reduce_part(payloads, [1.0, 1.0], make_codec("int8"), "t").payload
    assert out == reduce_part(payloads, [1.0, 1.0], make_codec("int8"), "t").payload
    expected = (decode(payloads[0]) + decode(payloads[1])) / 2
    torch.testing.assert_close(decode(out), expected, atol=1 / 254, rtol=0)


def test_reduce_part_zero_weight_member_is_ignored() -> None:
    out = reduce_part([encoded(1.0), encoded(100.0)], [1.0, 0.0], NONE, "t")
    assert decode(out.payload).tolist() == [1.0]


@pytest.mark.parametrize("weights", [[], [1.0, -1.0], [0.0, 0.0], [math.nan, 1.0], [math.inf, 1.0], [1.0]])
def test_reduce_part_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        reduce_part([encoded(1.0), encoded(2.0)], weights, NONE, "t")


def test_reduce_part_rejects_shape_mismatch_and_bad_payload() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        reduce_part([encoded(1.0, 2.0), encoded(1.0)], [1.0, 1.0], NONE, "t")
    with pytest.raises(ValueError):
        reduce_part([encoded(1.0), encoded(2.0)[:-1]], [1.0, 1.0], NONE, "t")


@pytest.mark.parametrize(
    "tokens, factor", [([1.0], 10.0), ([1.0, -1.0], 10.0), ([1.0, math.nan], 10.0), ([1.0, 1.0], -1.0)]
)
def test_reduce_part_rejects_bad_tokens_and_outlier_factor(tokens: list[float], factor: float) -> None:
    with pytest.raises(ValueError):
        reduce_part([encoded(1.0), encoded(2.0)], [1.0, 1.0], NONE, "t", tokens=tokens, outlier_factor=factor)


# --- screening ----------------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_payload_is_rejected_with_its_tokens(poison: float) -> None:
    # Σ weight·Δ / Σ tokens over the two honest payloads only: (100·[1,2] + 100·[3,4]) / 200. Had
    # the poisoned payload's 100 tokens stayed in the normalizer, the average would be 2/3 of that.
    payloads = [encoded(1.0, 2.0), encoded(0.5, poison), encoded(3.0, 4.0)]
    out = reduce_part(payloads, [100.0] * 3, NONE, "t", tokens=[100.0] * 3)
    assert out.rejected == {1: "non-finite values"}
    assert out.payload == encoded(2.0, 3.0)


def test_non_finite_is_rejected_even_alone_and_with_the_outlier_test_off() -> None:
    for factor in (0.0, None):
        out = reduce_part([encoded(1.0, math.nan)], [1.0], NONE, "t", tokens=[1.0], outlier_factor=factor)
        assert out.rejected == {0: "non-finite values"}


def test_a_nan_block_of_a_quantized_payload_is_rejected() -> None:
    int8 = make_codec("int8")
    poisoned = torch.ones(200)
    poisoned[150] = math.nan  # int8 decodes the whole block of 64 holding it to NaN
    payloads = [int8.encode("t", torch.ones(200)), int8.encode("t", poisoned)]
    out = reduce_part(payloads, [1.0, 1.0], int8, "t", tokens=[1.0, 1.0])
    assert out.rejected == {1: "non-finite values"}
    assert out.payload == payloads[0]  # what is left is one payload, its own average: forwarded


def test_outlier_among_three_is_rejected_with_its_tokens() -> None:
    # Norms 1, 1, 1414: the median is 1, and 1414 > 10 × 1.
    payloads = [encoded(1.0, 0.0), encoded(1000.0, 1000.0), encoded(0.0, 1.0)]
    out = reduce_part(payloads, [1.0, 1.0, 1.0], NONE, "t", tokens=[1.0, 1.0, 1.0])
    assert out.rejected == {1: "norm per unit of work 1414.2x the median"}
    assert out.payload == encoded(0.5, 0.5)


def test_a_payload_as_much_larger_as_the_work_behind_it_is_not_an_outlier() -> None:
    # DyLU: a fast peer runs 15x the steps of two slow ones, and its Δ is 13.5x their norm. Per
    # claimed token it is below theirs: kept. The same norms with equal claims are an outlier.
    payloads = [encoded(1.0, 0.0), encoded(0.0, 1.0), encoded(13.5, 0.0)]
    fast = reduce_part(payloads, [2.0, 2.0, 30.0], NONE, "t", tokens=[2.0, 2.0, 30.0], work_cap=30.0)
    assert fast.rejected == {}
    assert fast.payload == encoded((1.0 + 13.5 * 15) / 17, 1.0 / 17)
    equal = reduce_part(payloads, [2.0, 2.0, 2.0], NONE, "t", tokens=[2.0, 2.0, 2.0], work_cap=30.0)
    assert list(equal.rejected) == [2]


def test_a_claim_beyond_the_rounds_reference_work_buys_no_room() -> None:
    # Three peers did the reference work (1); one claims 2x it, as the claim bounds allow, with 15x
    # the norm. Credited with at most the reference, it is 15x the median per unit of work: rejected.
    # Uncapped, its claim would have halved that to 7.5x and let it through.
    payloads = [encoded(1.0, 0.0), encoded(0.0, 1.0), encoded(1.0, 1.0), encoded(15.0, 0.0)]
    weights, tokens = [1.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 2.0]
    capped = reduce_part(payloads, weights, NONE, "t", tokens=tokens, work_cap=1.0)
    assert list(capped.rejected) == [3]
    assert reduce_part(payloads, weights, NONE, "t", tokens=tokens).rejected == {}


def test_screening_work_is_the_capped_claims_or_none_when_no_claim_says_anything() -> None:
    assert screening_work([1.0, 5.0, 3.0], 4.0) == [1.0, 4.0, 3.0]
    assert screening_work([1.0, 5.0], None) == [1.0, 5.0]
    assert screening_work([1.0, 0.0], 4.0) == [1.0, 0.0]  # a claim of 0 is judged alone
    assert screening_work([0.0, 0.0], 4.0) is None  # no claim says anything: raw norms for all
    assert screening_work(None, 4.0) is None
    with pytest.raises(ValueError, match="work_cap"):
        screening_work([1.0], 0.0)
    with pytest.raises(ValueError, match="work"):
        screen_part([torch.ones(2)] * 3, 10.0, [1.0, -1.0, 1.0])
    assert screen_part([torch.ones(2)] * 3, 10.0, [1.0, 0.0, 1.0]) == {1: "claims no work"}


def test_outlier_threshold_is_factor_times_median() -> None:
    # Norms 1, 2, f: rejected only above DEFAULT_OUTLIER_FACTOR × 2 (the median of three).
    limit = 2 * DEFAULT_OUTLIER_FACTOR
    kept = reduce_part([encoded(1.0), encoded(2.0), encoded(limit)], [1.0] * 3, NONE, "t")
    assert kept.rejected == {}
    cut = reduce_part([encoded(1.0), encoded(2.0), encoded(limit + 0.5)], [1.0] * 3, NONE, "t")
    assert list(cut.rejected) == [2]
    assert (
        reduce_part(
            [encoded(1.0), encoded(2.0), encoded(limit + 0.5)], [1.0] * 3, NONE, "t", outlier_factor=50
        ).rejected
        == {}
    )


@pytest.mark.parametrize("factor", [0.0, None])
def test_outlier_test_can_be_turned_off(factor: float | None) -> None:
    payloads = [encoded(1.0, 0.0), encoded(1000.0, 1000.0), encoded(0.0, 1.0)]
    out = reduce_part(payloads, [1.0] * 3, NONE, "t", outlier_factor=factor)
    assert out.rejected == {}
    assert decode(out.payload).tolist() == pytest.approx([1001 / 3, 1001 / 3])


def test_no_outlier_test_with_fewer_than_three_finite_payloads() -> None:
    # With two, the median cannot tell which one is off; a non-finite third does not count.
    two = reduce_part([encoded(1.0), encoded(1000.0)], [1.0, 1.0], NONE, "t")
    assert two.rejected == {} and two.payload == encoded(500.5)
    three = reduce_part([encoded(1.0), encoded(1000.0), encoded(math.nan)], [1.0] * 3, NONE, "t")
    assert three.rejected == {2: "non-finite values"} and three.payload == encoded(500.5)


@pytest.mark.parametrize("spec", ["none", "int8", "lowrank:2"])
def test_every_payload_rejected_gives_zeros(spec: str) -> None:
    codec = make_codec(spec)
    payloads = [
        NONE.encode("t", torch.full((4, 3), math.nan)),
        NONE.encode("t", torch.full((4, 3), math.inf)),
    ]
    out = reduce_part(payloads, [1.0, 1.0], codec, "t", tokens=[5.0, 5.0])
    assert out.rejected == {0: "non-finite values", 1: "non-finite values"}
    assert out.payload == make_codec(spec).encode("t", torch.zeros(4, 3))
    assert decode(out.payload).shape == (4, 3) and not decode(out.payload).any()


def _reference_average(payloads: list[bytes], weights: list[float], tokens: list[float], spec: str) -> bytes:
    """reduce_part as it was before screening existed (Σ w·Δ / Σ t, normalized as (w/Σw)·(Σw/Σt))."""
    total_weight = math.fsum(weights)
    scale = total_weight / math.fsum(tokens)
    tensors = [decode(p) for p in payloads]
    average = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights, strict=True):
        average.add_(tensor, alpha=weight / total_weight * scale)
    return make_codec(spec).encode("t", average)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "lowrank:2"])
def test_honest_payloads_give_the_same_bytes_as_before_screening(spec: str) -> None:
    g = torch.Generator().manual_seed(3)
    for n in (2, 3, 5):
        payloads = [
            make_codec(spec).encode("t", torch.randn(24, 16, generator=g) * (1 + i)) for i in range(n)
        ]
        weights = [float(w) for w in torch.randint(1, 1000, (n,), generator=g)]
        tokens = [float(t) for t in torch.randint(1, 1000, (n,), generator=g)]
        screened = reduce_part(payloads, weights, make_codec(spec), "t", tokens=tokens)
        unscreened = reduce_part(payloads, weights, make_codec(spec), "t", tokens=tokens, outlier_factor=None)
        assert screened.rejected == {}
        assert screened.payload == unscreened.payload == _reference_average(payloads, weights, tokens, spec)


# --- round_traffic ------------------------------------------------------------------------------


def test_round_traffic_hand_computed() -> None:
    # Tensor 0 owned by m0: m1 sends 11, m2 sends 12; m0 sends 5 to m1 and m2.
    # Tensor 1 owned by m2: m0 sends 20, m1 sends 21; m2 sends 7 to m0 and m1.
    up = [[10, 20], [11, 21], [12, 22]]
    sent, received = round_traffic([0, 2], up, [5, 7], 3)
    assert sent == [20 + 2 * 5, 11 + 21, 12 + 2 * 7]
    assert received == [11 + 12 + 7, 5 + 7, 5 + 20 + 21]
    assert sum(sent) == sum(received)


def test_round_traffic_single_member_sends_nothing() -> None:
    assert round_traffic([0, 0], [[10, 20]], [5, 7], 1) == ([0], [0])


def test_round_traffic_rejects_inconsistent_sizes() -> None:
    with pytest.raises(ValueError):
        round_traffic([0, 1], [[1, 2], [3, 4]], [5], 2)
    with pytest.raises(ValueError):
        round_traffic([0, 1], [[1, 2]], [5, 6], 2)
    with pytest.raises(ValueError):
        round_traffic([0, 1], [[1, 2], [3]], [5, 6], 2)
    with pytest.raises(ValueError):
        round_traffic([0, 2], [[1, 2], [3, 4]], [5, 6], 2)


def test_most_bytes_moved_is_the_busiest_link_of_the_round() -> None:
    # Three members; member 0 owns the 100-byte part, member 1 the two 30-byte ones, member 2 none.
    # Member 0 receives 2 x 100 and sends 60 up + 2 x 100 down: 260 out; member 1 sends 100 + 2 x 60.
    owners = assign_parts([100, 30, 30], 3)
    assert owners == [0, 1, 2]
    owners = [0, 1, 1]
    assert most_bytes_moved([100, 30, 30], owners, 3) == 260
    assert most_bytes_moved([100, 30, 30], [0, 0, 0], 1) == 0  # alone: nothing on the wire


def test_a_zero_token_claim_is_left_out_and_does_not_change_how_the_others_are_screened() -> None:
    """One claim of 0 tokens used to switch the owner's screening to raw norms for everyone. It is
    now left out (it weighs nothing) and the others are judged per token as before."""
    from adloco.protocol.algorithms.parts import screen_norms, screening_work

    norms, tokens = [1.0, 1.0, 13.5, 0.0], [2.0, 2.0, 30.0, 0.0]  # a DyLU fast peer, and a zero claim
    work = screening_work(tokens, None)
    assert work == [2.0, 2.0, 30.0, 0.0]
    assert screen_norms(norms, 10.0, work) == {3: "claims no work"}
    assert screen_norms(norms[:3], 10.0, work[:3]) == {}  # the same verdicts on the others
    assert screening_work([0.0, 0.0], None) is None  # nobody says what any work was: raw norms


@pytest.mark.parametrize("rule", ["mean", "clip:0.5", "trimmed:0.25"])
def test_an_owners_answer_reads_a_span_of_each_payload_never_one_decoded_whole(rule: str) -> None:
    """Three int8 payloads of 16 Mi values: the owner's answer, under the mean and the robust rules
    alike, is what the rule's combination of their decoded tensors encodes to, bit for bit, and
    reducing them allocates (numpy's and Python's allocations, traced) about its answer's bytes,
    twice, and a few spans, where one whole decode alone is 64 MiB. It runs beside the next round's
    training step (issue 28 §2); CenteredClip reads the payloads once per iteration."""
    aggregate = Aggregate.parse(rule)
    numel = 16 * SPAN
    int8 = make_codec("int8")
    generator = torch.Generator().manual_seed(8)
    payloads = [int8.encode("w", torch.randn(numel, generator=generator) * (1 + i)) for i in range(3)]
    tracemalloc.start()
    try:
        part = reduce_part(
            payloads, [1.0, 2.0, 3.0], int8, "w", tokens=[10.0, 20.0, 30.0], aggregate=aggregate
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not part.rejected
    combined, clip = aggregate.combine_stated([decode(p) for p in payloads], [1 / 60, 2 / 60, 3 / 60])
    assert part.payload == int8.encode("w", combined)
    assert (part.clip is None) == (clip is None) == (rule != "clip:0.5")
    assert part.clip == clip
    assert peak < 2 * len(part.payload) + 6 * 4 * SPAN < 4 * numel
