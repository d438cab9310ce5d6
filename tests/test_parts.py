"""Parts: deterministic owner assignment, weighted reduction of payloads, exact per-member traffic."""

from __future__ import annotations

import math

import pytest
import torch

from adloco.protocol.codecs import decode, make_codec
from adloco.protocol.parts import assign_parts, reduce_part, round_traffic

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
    assert out == encoded(2.5, 3.5)
    assert reduce_part([encoded(1.0, 2.0), encoded(3.0, 4.0)], [2, 2], NONE, "t") == encoded(2.0, 3.0)


def test_reduce_part_accepts_mixed_codecs_and_reencodes() -> None:
    x, y = torch.tensor([0.5, -1.0, 0.25, 1.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])
    payloads = [make_codec("int8").encode("t", x), make_codec("fp16").encode("t", y)]
    out = reduce_part(payloads, [1.0, 1.0], make_codec("int8"), "t")
    assert out == reduce_part(payloads, [1.0, 1.0], make_codec("int8"), "t")
    expected = (decode(payloads[0]) + decode(payloads[1])) / 2
    torch.testing.assert_close(decode(out), expected, atol=1 / 254, rtol=0)


def test_reduce_part_zero_weight_member_is_ignored() -> None:
    out = reduce_part([encoded(1.0), encoded(100.0)], [1.0, 0.0], NONE, "t")
    assert decode(out).tolist() == [1.0]


@pytest.mark.parametrize("weights", [[], [1.0, -1.0], [0.0, 0.0], [math.nan, 1.0], [math.inf, 1.0], [1.0]])
def test_reduce_part_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        reduce_part([encoded(1.0), encoded(2.0)], weights, NONE, "t")


def test_reduce_part_rejects_shape_mismatch_and_bad_payload() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        reduce_part([encoded(1.0, 2.0), encoded(1.0)], [1.0, 1.0], NONE, "t")
    with pytest.raises(ValueError):
        reduce_part([encoded(1.0), encoded(2.0)[:-1]], [1.0, 1.0], NONE, "t")


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
