"""Batch-size tests (norm, augmented inner-product) and statistics pooling, on hand-computed values."""

import itertools
import json
import random
from typing import Any

import pytest
import torch

from adloco.protocol.algorithms.batchtest import (
    GradStats,
    augmented_ip_test,
    grad_stats,
    next_batch,
    norm_test,
    pool_stats,
)

# Two gradients g1 = [2, 0], g2 = [0, 1], each a mean over n = 4 samples:
#   ḡ = [1, 0.5], ||ḡ||² = 1.25
#   g1 − ḡ = [1, −0.5], g2 − ḡ = [−1, 0.5]  →  S = 1.25 + 1.25 = 2.5
#   ⟨g1, ḡ⟩ = 2, ⟨g2, ḡ⟩ = 0.5, mean 1.25  →  ip_dev = 0.75² + 0.75² = 1.125
#   o1 = g1 − (2/1.25) ḡ = [0.4, −0.8], o2 = g2 − (0.5/1.25) ḡ = [−0.4, 0.8], ō = 0
#   →  ortho_dev = 0.8 + 0.8 = 1.6
HAND = GradStats(
    num_grads=2, samples_per_grad=4, sq_dev_sum=2.5, mean_sq_norm=1.25, ip_dev_sum=1.125, ortho_dev_sum=1.6
)


def test_grad_stats_hand_example() -> None:
    s = grad_stats([torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])], samples_per_grad=4)
    assert (s.num_grads, s.samples_per_grad, s.num_groups, s.dof) == (2, 4, 1, 1)
    assert s.sq_dev_sum == 2.5
    assert s.mean_sq_norm == 1.25
    assert s.ip_dev_sum == 1.125
    assert s.ortho_dev_sum == pytest.approx(1.6, rel=1e-12)


def test_grad_stats_accepts_per_tensor_lists() -> None:
    flat = grad_stats([torch.tensor([2.0, 0.0, 3.0]), torch.tensor([0.0, 1.0, 1.0])], samples_per_grad=4)
    split = grad_stats(
        [
            [torch.tensor([[2.0], [0.0]]), torch.tensor([3.0])],
            [torch.tensor([[0.0], [1.0]]), torch.tensor([1.0])],
        ],
        samples_per_grad=4,
    )
    assert flat.to_dict() == pytest.approx(split.to_dict())


def test_grad_stats_ortho_matches_definition() -> None:
    torch.manual_seed(1)
    grads = [torch.randn(7, dtype=torch.float64) for _ in range(5)]
    s = grad_stats(grads, samples_per_grad=3)
    g = torch.stack(grads)
    mean = g.mean(0)
    q = mean @ mean
    ortho = g - torch.outer(g @ mean / q, mean)
    expected = float((ortho - ortho.mean(0)).square().sum())
    assert s.ortho_dev_sum == pytest.approx(expected, rel=1e-9)


def test_grad_stats_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        grad_stats([], samples_per_grad=1)
    with pytest.raises(ValueError):
        grad_stats([torch.zeros(2), torch.zeros(3)], samples_per_grad=1)
    with pytest.raises(ValueError):
        grad_stats([torch.zeros(2), torch.tensor([float("nan"), 0.0])], samples_per_grad=1)
    with pytest.raises(ValueError):
        grad_stats([torch.zeros(2)], samples_per_grad=0)


def test_norm_test_hand_example() -> None:
    # V = n·S/dof = 4·2.5/1 = 10; η = 0.5: η²·||ḡ||² = 0.25·1.25 = 0.3125; T = ⌈10/0.3125⌉ = 32
    assert norm_test(HAND, 3, eta=0.5, cap=1000) == 32
    assert norm_test(HAND, 40, eta=0.5, cap=1000) == 40  # never decreases
    assert norm_test(HAND, 3, eta=0.5, cap=20) == 20  # capped
    # AdLoCo per-node form, M = 2 nodes: b·S/((M−1)·M·η²·||ḡ||²) = 4·2.5/(1·2·0.3125) = 16
    assert norm_test(HAND, 3, eta=0.5, cap=1000, global_factor=2) == 16


def test_augmented_test_hand_example() -> None:
    # T_ip = n·ip_dev/dof/(ϑ²·||ḡ||⁴) = 4·1.125/(0.25·1.5625) = 11.52 → 12 (ϑ = 0.5)
    # T_orth = n·ortho_dev/dof/(ν²·||ḡ||²) = 4·1.6/(1·1.25) = 5.12 → 6 (ν = 1)
    assert augmented_ip_test(HAND, 1, theta=0.5, nu=1.0, cap=1000) == 12
    # ν = 0.5: T_orth = 6.4/(0.25·1.25) = 20.48 → 21 wins over 11.52
    assert augmented_ip_test(HAND, 1, theta=0.5, nu=0.5, cap=1000) == 21
    # global_factor 2 halves both: max(5.76, 2.56) → 6
    assert augmented_ip_test(HAND, 1, theta=0.5, nu=1.0, cap=1000, global_factor=2) == 6
    assert augmented_ip_test(HAND, 30, theta=0.5, nu=1.0, cap=1000) == 30
    assert augmented_ip_test(HAND, 1, theta=0.5, nu=1.0, cap=10) == 10


def test_next_batch_dispatch() -> None:
    assert next_batch(HAND, 3, test="norm", eta=0.5, theta=0.5, nu=1.0, cap=1000) == 32
    assert next_batch(HAND, 3, test="augmented", eta=0.5, theta=0.5, nu=1.0, cap=1000) == 12
    assert next_batch(HAND, 3, test="none", eta=0.5, theta=0.5, nu=1.0, cap=1000) == 3
    with pytest.raises(ValueError):
        next_batch(HAND, 3, test="bogus", eta=0.5, theta=0.5, nu=1.0, cap=1000)  # type: ignore[arg-type]


def test_degenerate_statistics_keep_batch() -> None:
    single = grad_stats([torch.tensor([1.0, 2.0])], samples_per_grad=4)  # dof 0
    zero_mean = grad_stats([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])], samples_per_grad=4)
    assert zero_mean.mean_sq_norm == 0.0
    for stats in (None, single, zero_mean):
        assert norm_test(stats, 7, eta=0.5, cap=100) == 7
        assert augmented_ip_test(stats, 7, theta=0.5, nu=1.0, cap=100) == 7


def test_tiny_mean_norm_hits_cap_without_overflow() -> None:
    s = GradStats(
        num_grads=2,
        samples_per_grad=1,
        sq_dev_sum=1e300,
        mean_sq_norm=1e-11,
        ip_dev_sum=1e300,
        ortho_dev_sum=1e300,
    )
    assert norm_test(s, 1, eta=0.1, cap=64) == 64
    assert augmented_ip_test(s, 1, theta=0.1, nu=0.1, cap=64) == 64


def test_tests_are_monotone_and_capped() -> None:
    rng = random.Random(0)
    for _ in range(300):
        s = GradStats(
            num_grads=rng.randint(1, 6),
            samples_per_grad=rng.randint(1, 64),
            sq_dev_sum=rng.uniform(0, 10),
            mean_sq_norm=rng.choice([0.0, rng.uniform(0, 2)]),
            ip_dev_sum=rng.uniform(0, 10),
            ortho_dev_sum=rng.uniform(0, 10),
        )
        b, cap = rng.randint(1, 300), rng.randint(1, 300)
        for out in (
            norm_test(s, b, eta=rng.uniform(0.05, 1), cap=cap),
            augmented_ip_test(s, b, theta=rng.uniform(0.05, 1), nu=rng.uniform(0.05, 1), cap=cap),
        ):
            assert out <= cap
            assert out >= min(b, cap)


@pytest.mark.parametrize("kwargs", [{"eta": 0.0}, {"eta": float("nan")}, {"cap": 0}, {"global_factor": 0}])
def test_norm_test_validation(kwargs: dict[str, Any]) -> None:
    args = {"eta": 0.5, "cap": 10, **kwargs}
    with pytest.raises(ValueError):
        norm_test(HAND, 1, **args)
    with pytest.raises(ValueError):
        norm_test(HAND, 0, eta=0.5, cap=10)


def test_pool_of_one_is_itself() -> None:
    assert pool_stats([HAND]) == HAND
    s = grad_stats([torch.tensor([0.3, 0.7]), torch.tensor([0.1, -0.2]), torch.tensor([1.0, 0.5])], 3)
    assert pool_stats([s]) == s
    assert pool_stats([]) is None
    assert pool_stats([None, None]) is None
    assert pool_stats([None, HAND]) == HAND


def test_pool_hand_example() -> None:
    other = GradStats(
        num_grads=3, samples_per_grad=4, sq_dev_sum=1.0, mean_sq_norm=0.5, ip_dev_sum=0.25, ortho_dev_sum=0.5
    )
    p = pool_stats([HAND, other])
    assert p is not None
    # M = 2 + 3, groups 2, dof = 1 + 2 = 3; sums add; ||ḡ||² = (2·1.25 + 3·0.5)/5 = 0.8
    assert (p.num_grads, p.num_groups, p.dof, p.samples_per_grad) == (5, 2, 3, 4)
    assert p.sq_dev_sum == 3.5
    assert p.ip_dev_sum == 1.375
    assert p.ortho_dev_sum == pytest.approx(2.1)
    assert p.mean_sq_norm == pytest.approx(0.8)
    # norm test on the pool, η = 1: V = 4·3.5/3 = 14/3; T = ⌈(14/3)/0.8⌉ = ⌈5.83⌉ = 6
    assert norm_test(p, 1, eta=1.0, cap=100) == 6


def test_pool_rescales_unequal_samples_per_grad() -> None:
    a = GradStats(
        num_grads=2, samples_per_grad=4, sq_dev_sum=3.0, mean_sq_norm=1.0, ip_dev_sum=0.0, ortho_dev_sum=3.0
    )
    b = GradStats(
        num_grads=2, samples_per_grad=8, sq_dev_sum=1.5, mean_sq_norm=1.0, ip_dev_sum=0.0, ortho_dev_sum=1.5
    )
    p = pool_stats([a, b])
    assert p is not None
    # n = (2·4 + 2·8)/4 = 6; S = 3·4/6 + 1.5·8/6 = 2 + 2 = 4; n·S/dof = 6·4/2 = 12 = (4·3 + 8·1.5)/2
    assert p.samples_per_grad == 6
    assert p.sq_dev_sum == pytest.approx(4.0)
    # n values 1 and 2 with equal M: mean 1.5 rounds half up to 2
    c = GradStats(
        num_grads=2, samples_per_grad=1, sq_dev_sum=1.0, mean_sq_norm=1.0, ip_dev_sum=0.0, ortho_dev_sum=1.0
    )
    d = GradStats(
        num_grads=2, samples_per_grad=2, sq_dev_sum=1.0, mean_sq_norm=1.0, ip_dev_sum=0.0, ortho_dev_sum=1.0
    )
    pooled = pool_stats([c, d])
    assert pooled is not None and pooled.samples_per_grad == 2


def test_pool_is_permutation_invariant() -> None:
    rng = random.Random(3)
    stats = [
        GradStats(
            num_grads=rng.randint(1, 5),
            samples_per_grad=rng.randint(1, 9),
            sq_dev_sum=rng.uniform(0, 1) * 10 ** rng.randint(-8, 8),
            mean_sq_norm=rng.uniform(0, 1) * 10 ** rng.randint(-8, 8),
            ip_dev_sum=rng.uniform(0, 1) * 10 ** rng.randint(-8, 8),
            ortho_dev_sum=rng.uniform(0, 1) * 10 ** rng.randint(-8, 8),
        )
        for _ in range(5)
    ]
    reference = pool_stats(stats)
    for perm in itertools.permutations(stats):
        assert pool_stats(list(perm)) == reference


def test_grad_stats_round_trip_json_and_msgpack() -> None:
    s = pool_stats([HAND, HAND])
    assert s is not None and s.num_groups == 2
    assert GradStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    msgpack = pytest.importorskip("msgpack")
    assert GradStats.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict()))) == s


@pytest.mark.parametrize(
    "change",
    [
        {"num_grads": 0},
        {"samples_per_grad": 1.5},
        {"sq_dev_sum": -1.0},
        {"mean_sq_norm": float("nan")},
        {"ortho_dev_sum": float("inf")},
        {"num_groups": 3},
        {"num_grads": True},
        {"extra": 1},
    ],
)
def test_grad_stats_from_dict_rejects_bad_metadata(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GradStats.from_dict({**HAND.to_dict(), **change})
    with pytest.raises(ValueError):
        GradStats.from_dict({"num_grads": 2})
