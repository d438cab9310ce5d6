"""Outer Nesterov in both conventions against torch.optim.SGD and hand-computed values."""

from collections.abc import Sequence
from typing import Any, Literal

import pytest
import torch
from torch import Tensor

from adloco.protocol.algorithms.outer import OuterConfig, outer_step


def test_n1_matches_torch_sgd_nesterov() -> None:
    torch.manual_seed(0)
    theta0 = torch.randn(5, 3)
    deltas = [torch.randn(5, 3) for _ in range(3)]
    ref = theta0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours, mom = theta0.clone(), torch.zeros_like(theta0)
    cfg = OuterConfig(lr=0.7, momentum=0.9, convention="n1")
    for d in deltas:
        ref.grad = d.clone()
        opt.step()
        outer_step([ours], [mom], [d], cfg)
    # Not bit for bit: SGD fuses products into sums (FMA) where its kernel can, outer_step never.
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(mom, opt.state[ref]["momentum_buffer"])  # μ m + Δ: nothing to fuse


def _two_steps(
    convention: Literal["n1", "n2"],
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    theta, mom = torch.tensor([1.0, 2.0]), torch.zeros(2)
    cfg = OuterConfig(lr=0.5, momentum=0.5, convention=convention)
    outer_step([theta], [mom], [torch.tensor([1.0, -2.0])], cfg)
    first = (theta.clone(), mom.clone())
    outer_step([theta], [mom], [torch.tensor([0.5, 1.0])], cfg)
    return first, (theta, mom)


def test_n1_hand_values() -> None:
    # η = μ = 0.5, θ0 = [1, 2], Δ1 = [1, −2], Δ2 = [0.5, 1]
    # m1 = Δ1 = [1, −2];  θ1 = θ0 − 0.5(Δ1 + 0.5 m1) = [1, 2] − 0.5[1.5, −3] = [0.25, 3.5]
    # m2 = 0.5 m1 + Δ2 = [1, 0];  θ2 = θ1 − 0.5(Δ2 + 0.5 m2) = [0.25, 3.5] − 0.5[1, 1] = [−0.25, 3]
    (theta1, m1), (theta2, m2) = _two_steps("n1")
    assert torch.equal(m1, torch.tensor([1.0, -2.0]))
    assert torch.equal(theta1, torch.tensor([0.25, 3.5]))
    assert torch.equal(m2, torch.tensor([1.0, 0.0]))
    assert torch.equal(theta2, torch.tensor([-0.25, 3.0]))


def test_n2_hand_values() -> None:
    # m1 = 0.5·0 + 0.5 Δ1 = [0.5, −1];  θ1 = [1, 2] − 0.5([1, −2] + [0.25, −0.5]) = [0.375, 3.25]
    # m2 = 0.5 m1 + 0.5 Δ2 = [0.25, −0.5] + [0.25, 0.5] = [0.5, 0]
    # θ2 = θ1 − 0.5([0.5, 1] + [0.25, 0]) = [0.375 − 0.375, 3.25 − 0.5] = [0, 2.75]
    (theta1, m1), (theta2, m2) = _two_steps("n2")
    assert torch.equal(m1, torch.tensor([0.5, -1.0]))
    assert torch.equal(theta1, torch.tensor([0.375, 3.25]))
    assert torch.equal(m2, torch.tensor([0.5, 0.0]))
    assert torch.equal(theta2, torch.tensor([0.0, 2.75]))


def test_outer_step_does_not_track_grad() -> None:
    theta = torch.zeros(2, requires_grad=True)
    outer_step([theta], [torch.zeros(2)], [torch.ones(2)], OuterConfig())
    assert theta.grad_fn is None


@pytest.mark.parametrize(
    "kwargs", [{"lr": 0.0}, {"lr": float("inf")}, {"momentum": 1.0}, {"momentum": -0.1}, {"convention": "n3"}]
)
def test_config_validation(kwargs: dict[str, Any]) -> None:  # bad values on purpose
    with pytest.raises(ValueError):
        OuterConfig(**kwargs)


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError):
        outer_step([torch.zeros(2)], [torch.zeros(3)], [torch.zeros(2)], OuterConfig())
    with pytest.raises(ValueError):
        outer_step([torch.zeros(2)], [], [torch.zeros(2)], OuterConfig())


def _dn_reference(
    theta: Tensor, deltas: Sequence[Tensor], *, lr: float, mu: float, n: int, dampened: bool
) -> tuple[Tensor, Tensor]:
    """Delayed Nesterov as research/algorithms.md §6.2 writes it (forgather's form): a separate
    buffer of the cycle's Δ, m updated from it only at the cycle's last push."""
    theta, m, buffer = theta.clone(), torch.zeros_like(theta), torch.zeros_like(theta)
    for k, g in enumerate(deltas, start=1):
        buffer += g
        if k % n == 0:
            m = mu * m + (1 - mu if dampened else 1.0) * buffer / n
            theta -= lr * (g / n + mu * m)
            buffer.zero_()
        else:
            theta -= lr * g / n
    return theta, m


@pytest.mark.parametrize("convention", ["n1", "n2"])
def test_delayed_nesterov_matches_the_buffered_form_without_its_buffer(
    convention: Literal["n1", "n2"],
) -> None:
    """Over 3 cycles of 3 and a partial one, θ matches the two-buffer form of Async DiLoCo's DN;
    at each cycle's end our m (which doubles as the buffer) equals its momentum."""
    torch.manual_seed(1)
    theta0, deltas = torch.randn(6, 4), [torch.randn(6, 4) for _ in range(11)]
    cfg = OuterConfig(lr=0.35, momentum=0.9, convention=convention, delay=3)
    ours, mom = theta0.clone(), torch.zeros_like(theta0)
    for i, d in enumerate(deltas):
        outer_step([ours], [mom], [d], cfg, index=i)
        ref_theta, ref_m = _dn_reference(
            theta0, deltas[: i + 1], lr=0.35, mu=0.9, n=3, dampened=convention == "n2"
        )
        torch.testing.assert_close(ours, ref_theta, rtol=1e-5, atol=1e-6)
        if i % 3 == 2:
            torch.testing.assert_close(mom, ref_m, rtol=1e-5, atol=1e-6)


def test_a_cycle_of_delayed_nesterov_is_one_nesterov_step_on_the_mean() -> None:
    torch.manual_seed(2)
    theta0, deltas = torch.randn(5), [torch.randn(5) for _ in range(4)]
    delayed, m_delayed = theta0.clone(), torch.zeros(5)
    for i, d in enumerate(deltas):
        outer_step([delayed], [m_delayed], [d], OuterConfig(lr=0.5, momentum=0.8, delay=4), index=8 + i)
    plain, m_plain = theta0.clone(), torch.zeros(5)
    outer_step([plain], [m_plain], [torch.stack(deltas).mean(0)], OuterConfig(lr=0.5, momentum=0.8))
    torch.testing.assert_close(delayed, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m_delayed, m_plain, rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_hand_values() -> None:
    # η = μ = 0.5, N = 2, θ0 = [1, 2], Δ1 = [1, −2], Δ2 = [0.5, 1] (the N1 example above)
    # round 0: m = 0.5·0 + Δ1/2 = [0.5, −1];  θ = θ0 − 0.5 Δ1/2 = [0.75, 2.5]
    # round 1: m = [0.5, −1] + Δ2/2 = [0.75, −0.5];  θ = [0.75, 2.5] − 0.5([0.25, 0.5] + 0.5 m)
    #          = [0.75, 2.5] − 0.5[0.625, 0.25] = [0.4375, 2.375]
    theta, mom = torch.tensor([1.0, 2.0]), torch.zeros(2)
    cfg = OuterConfig(lr=0.5, momentum=0.5, delay=2)
    outer_step([theta], [mom], [torch.tensor([1.0, -2.0])], cfg, index=0)
    assert torch.equal(mom, torch.tensor([0.5, -1.0]))
    assert torch.equal(theta, torch.tensor([0.75, 2.5]))
    outer_step([theta], [mom], [torch.tensor([0.5, 1.0])], cfg, index=1)
    assert torch.equal(mom, torch.tensor([0.75, -0.5]))
    assert torch.equal(theta, torch.tensor([0.4375, 2.375]))


@pytest.mark.parametrize("delay", [0, -1, 1.5, True])
def test_delay_must_be_whole_rounds(delay: Any) -> None:  # not always an int, on purpose
    with pytest.raises(ValueError, match="outer delay"):
        OuterConfig(delay=delay)


def test_a_negative_index_is_refused() -> None:
    with pytest.raises(ValueError, match="count from 0"):
        outer_step([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], OuterConfig(), index=-1)


@pytest.mark.parametrize("cfg", [OuterConfig(), OuterConfig(convention="n2"), OuterConfig(delay=3)])
def test_a_large_tensor_stepped_a_slice_at_a_time_holds_the_whole_steps_bits(
    cfg: OuterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor above `OUTER_SLICE` elements is stepped in slices (its temporaries a slice's size):
    θ and m are the bits of the step on the whole tensor, a slice boundary inside a row included."""
    from adloco.protocol.algorithms import outer

    torch.manual_seed(0)
    theta0, m0 = torch.randn(1000, 77), torch.randn(1000, 77)
    deltas = [torch.randn(1000, 77) for _ in range(4)]
    runs = []
    for slice_elements in (10**6, 4096 + 3):
        monkeypatch.setattr(outer, "OUTER_SLICE", slice_elements)
        theta, mom = theta0.clone(), m0.clone()
        for index, d in enumerate(deltas):
            outer_step([theta], [mom], [d], cfg, index=index)
        runs.append((theta, mom))
    (whole_theta, whole_m), (sliced_theta, sliced_m) = runs
    assert torch.equal(whole_theta, sliced_theta) and torch.equal(whole_m, sliced_m)
    assert not torch.equal(whole_theta, theta0)
