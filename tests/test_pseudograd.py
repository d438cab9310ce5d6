"""Pseudo-gradient helpers against hand-computed values."""

import math

import pytest
import torch

from adloco.protocol.algorithms import pseudograd
from adloco.protocol.algorithms.pseudograd import (
    PseudoGradient,
    flat_norm,
    pseudo_gradient,
    tensors_hash,
    weighted_mean,
)


def test_pseudo_gradient_has_gradient_sign() -> None:
    start = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    end = [torch.tensor([0.25, 3.0]), torch.tensor([[1.5]])]
    delta = pseudo_gradient(start, end)
    # start − end: [1−0.25, 2−3] = [0.75, −1]; [[0.5−1.5]] = [[−1]]
    assert torch.equal(delta[0], torch.tensor([0.75, -1.0]))
    assert torch.equal(delta[1], torch.tensor([[-1.0]]))


def test_pseudo_gradient_rejects_mismatch() -> None:
    with pytest.raises(ValueError):
        pseudo_gradient([torch.zeros(2)], [torch.zeros(3)])
    with pytest.raises(ValueError):
        pseudo_gradient([torch.zeros(2)], [])


def test_lazy_pseudo_gradient_reads_what_the_eager_one_computes() -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    end = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    lazy = PseudoGradient(start, end)
    assert len(lazy) == 2 and lazy.is_lazy
    for a, b in zip(lazy, pseudo_gradient(start, end), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(lazy[-1], start[1] - end[1]) and len(lazy[0:2]) == 2
    with pytest.raises(IndexError):
        lazy[2]
    with pytest.raises(ValueError):
        PseudoGradient([torch.zeros(2)], [torch.zeros(3)])


def test_lazy_pseudo_gradient_refuses_a_side_that_moved_and_keeps_a_materialized_one() -> None:
    start, end = [torch.ones(4)], [torch.zeros(4)]
    moved = PseudoGradient(start, end)
    kept = PseudoGradient(start, end)
    kept.materialize()
    assert not kept.is_lazy
    end[0].add_(1.0)  # the instance trains on, or θ takes an outer step
    with pytest.raises(RuntimeError, match="changed in place"):
        moved[0]
    assert torch.equal(kept[0], torch.ones(4))  # the Δ of before the change
    kept.release()
    kept.materialize()  # a no-op once released
    with pytest.raises(RuntimeError, match="release"):
        kept[0]


def test_a_pseudo_gradient_materialized_into_given_tensors_keeps_them_and_hands_each_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`materialize(into, hand_back=...)` computes Δ into the given tensors (the same bits as in
    memory) a span at a time, keeps them as its values, and calls `hand_back(j, start, stop)` as
    each span of tensor j is in and for the whole tensor once a reader is done with it; a misshapen
    `into` is refused before anything is computed."""
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(6, 2, generator=gen), torch.randn(5, generator=gen)]
    end = [torch.randn(6, 2, generator=gen), torch.randn(5, generator=gen)]
    expected = pseudo_gradient(start, end)
    with pytest.raises(ValueError, match="shape"):
        PseudoGradient(start, end).materialize([torch.empty(6, 2), torch.empty(4)])
    into = [torch.full((6, 2), math.nan), torch.full((5,), math.nan)]
    handed: list[tuple[int, int, int]] = []
    delta = PseudoGradient(start, end)
    monkeypatch.setattr(pseudograd, "MATERIALIZE_SPAN", 5)
    delta.materialize(into, hand_back=lambda j, a, b: handed.append((j, a, b)))
    assert handed == [(0, 0, 5), (0, 5, 10), (0, 10, 12), (1, 0, 5)] and not delta.is_lazy
    end[0].add_(1.0)  # a side moves on: the values were computed before
    assert delta[0] is into[0] and all(torch.equal(a, b) for a, b in zip(delta, expected, strict=True))
    handed.clear()
    delta.done_with(1)
    assert handed == [(1, 0, 5)]
    delta.release()
    delta.done_with(0)  # nothing left to hand back
    assert handed == [(1, 0, 5)]


def test_weighted_mean_normalizes_weights() -> None:
    a = [torch.tensor([1.0, 0.0]), torch.tensor([4.0])]
    b = [torch.tensor([0.0, 1.0]), torch.tensor([8.0])]
    out = weighted_mean([a, b], [3.0, 1.0])
    # weights 3/4, 1/4: [0.75, 0.25]; 0.75·4 + 0.25·8 = 3 + 2 = 5
    assert torch.equal(out[0], torch.tensor([0.75, 0.25]))
    assert torch.equal(out[1], torch.tensor([5.0]))


def test_weighted_mean_keeps_dtype() -> None:
    a = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16)]
    b = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16)]
    out = weighted_mean([a, b], [1.0, 1.0])
    # equal weights: [(1+3)/2, (2+4)/2] = [2, 3]
    assert out[0].dtype == torch.bfloat16
    assert torch.equal(out[0], torch.tensor([2.0, 3.0], dtype=torch.bfloat16))


@pytest.mark.parametrize("weights", [[], [1.0, -1.0], [0.0, 0.0], [math.nan, 1.0]])
def test_weighted_mean_rejects_bad_weights(weights: list[float]) -> None:
    vectors = [[torch.zeros(1)] for _ in weights] or []
    with pytest.raises(ValueError):
        weighted_mean(vectors, weights)


def test_weighted_mean_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError):
        weighted_mean([[torch.zeros(1)]], [1.0, 2.0])
    with pytest.raises(ValueError):
        weighted_mean([[torch.zeros(1)], [torch.zeros(2)]], [1.0, 1.0])


def test_flat_norm() -> None:
    # sqrt(3² + 4² + 12²) = sqrt(9 + 16 + 144) = sqrt(169) = 13
    assert flat_norm([torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]) == 13.0
    assert flat_norm([]) == 0.0


def test_tensors_hash_known_digest_and_sensitivity() -> None:
    import hashlib

    t = torch.tensor([1.0, -2.0])
    # repr((2,)) = "(2,)"; 1.0f = 0x3f800000, -2.0f = 0xc0000000, little-endian
    expected = hashlib.sha256(b"(2,)" + bytes.fromhex("0000803f000000c0")).hexdigest()
    assert tensors_hash([t]) == expected
    assert tensors_hash([t.double()]) == expected
    assert tensors_hash([t.reshape(1, 2)]) != expected
    assert tensors_hash([torch.tensor([1.0, -2.5])]) != expected
    assert tensors_hash([t, t]) != expected
