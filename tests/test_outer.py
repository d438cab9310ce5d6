"""Outer Nesterov in both conventions against torch.optim.SGD and hand-computed values."""

import pytest
import torch

from adloco.protocol.algorithms.outer import OuterConfig, outer_step


def test_n1_matches_torch_sgd_nesterov():
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


def _two_steps(convention):
    theta, mom = torch.tensor([1.0, 2.0]), torch.zeros(2)
    cfg = OuterConfig(lr=0.5, momentum=0.5, convention=convention)
    outer_step([theta], [mom], [torch.tensor([1.0, -2.0])], cfg)
    first = (theta.clone(), mom.clone())
    outer_step([theta], [mom], [torch.tensor([0.5, 1.0])], cfg)
    return first, (theta, mom)


def test_n1_hand_values():
    # η = μ = 0.5, θ0 = [1, 2], Δ1 = [1, −2], Δ2 = [0.5, 1]
    # m1 = Δ1 = [1, −2];  θ1 = θ0 − 0.5(Δ1 + 0.5 m1) = [1, 2] − 0.5[1.5, −3] = [0.25, 3.5]
    # m2 = 0.5 m1 + Δ2 = [1, 0];  θ2 = θ1 − 0.5(Δ2 + 0.5 m2) = [0.25, 3.5] − 0.5[1, 1] = [−0.25, 3]
    (theta1, m1), (theta2, m2) = _two_steps("n1")
    assert torch.equal(m1, torch.tensor([1.0, -2.0]))
    assert torch.equal(theta1, torch.tensor([0.25, 3.5]))
    assert torch.equal(m2, torch.tensor([1.0, 0.0]))
    assert torch.equal(theta2, torch.tensor([-0.25, 3.0]))


def test_n2_hand_values():
    # m1 = 0.5·0 + 0.5 Δ1 = [0.5, −1];  θ1 = [1, 2] − 0.5([1, −2] + [0.25, −0.5]) = [0.375, 3.25]
    # m2 = 0.5 m1 + 0.5 Δ2 = [0.25, −0.5] + [0.25, 0.5] = [0.5, 0]
    # θ2 = θ1 − 0.5([0.5, 1] + [0.25, 0]) = [0.375 − 0.375, 3.25 − 0.5] = [0, 2.75]
    (theta1, m1), (theta2, m2) = _two_steps("n2")
    assert torch.equal(m1, torch.tensor([0.5, -1.0]))
    assert torch.equal(theta1, torch.tensor([0.375, 3.25]))
    assert torch.equal(m2, torch.tensor([0.5, 0.0]))
    assert torch.equal(theta2, torch.tensor([0.0, 2.75]))


def test_outer_step_does_not_track_grad():
    theta = torch.zeros(2, requires_grad=True)
    outer_step([theta], [torch.zeros(2)], [torch.ones(2)], OuterConfig())
    assert theta.grad_fn is None


@pytest.mark.parametrize(
    "kwargs", [{"lr": 0.0}, {"lr": float("inf")}, {"momentum": 1.0}, {"momentum": -0.1}, {"convention": "n3"}]
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        OuterConfig(**kwargs)


def test_shape_mismatch():
    with pytest.raises(ValueError):
        outer_step([torch.zeros(2)], [torch.zeros(3)], [torch.zeros(2)], OuterConfig())
    with pytest.raises(ValueError):
        outer_step([torch.zeros(2)], [], [torch.zeros(2)], OuterConfig())
