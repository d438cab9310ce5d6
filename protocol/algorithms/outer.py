"""The outer optimizer: Nesterov SGD on the averaged pseudo-gradient, in two conventions.

DiLoCo (arXiv 2311.08105) applies Nesterov momentum to the averaged pseudo-gradient Δ once per round.
Two forms appear in the sources (research/algorithms.md §0.4) and they are not equivalent:

* N1, PyTorch `SGD(nesterov=True, dampening=0)` as in OpenDiLoCo: m ← μ m + Δ; θ ← θ − η (Δ + μ m).
* N2, the dampened form of the HeLoCo formula sheet: m ← μ m + (1−μ) Δ; θ ← θ − η (Δ + μ m).

N2's momentum is (1−μ) times N1's, so an η tuned for one is wrong for the other.

Delayed Nesterov (DN, Async Local-SGD, arXiv 2401.09135; research/algorithms.md §6.2), for
asynchronous runs where each round's Δ is the push of a few peers: with a delay of N rounds, every
round steps θ by −η Δ/N, and only every N-th round adds the momentum term −η μ m, with m updated
from the mean of those N rounds' Δ. Over N rounds that is one Nesterov step on their average, so
stale pushes do not each drive the momentum. It needs no buffer beyond m: in a cycle of N rounds,
m is first decayed (μ m), then each round adds its Δ/N (w Δ/N under N2), so m holds μ m_old + ΣΔ/N
when the N-th round applies it. A delay of 1 is plain Nesterov, bit for bit. The cycle is the
round number every peer holds alike, so θ and m stay identical across peers, through catch-up and
state transfer (m mid-cycle is part of the state like any m).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["OuterConfig", "outer_step"]


@dataclass(frozen=True)
class OuterConfig:
    """Outer Nesterov settings.

    lr: η, the outer learning rate (DiLoCo: 0.7 synchronous; Async DiLoCo's toy uses 0.07 when
        contributions are stale). Lower it if the loss jumps up right after outer steps.
    momentum: μ, the outer Nesterov momentum (DiLoCo: 0.9). Lower it if late contributions make the
        loss oscillate.
    convention: "n1" (PyTorch/OpenDiLoCo) or "n2" (dampened, HeLoCo). Re-tune lr when switching.
    delay: N of delayed Nesterov: the momentum term is applied every N rounds (1: every round, plain
        Nesterov). Async DiLoCo sets N to about the number of workers.
    """

    lr: float = 0.7
    momentum: float = 0.9
    convention: Literal["n1", "n2"] = "n1"
    delay: int = 1

    def __post_init__(self) -> None:
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"outer lr must be a finite number > 0, got {self.lr!r} (DiLoCo uses 0.7)")
        if not math.isfinite(self.momentum) or not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum!r} (DiLoCo uses 0.9)")
        if self.convention not in ("n1", "n2"):
            raise ValueError(
                f"outer convention must be 'n1' (PyTorch Nesterov) or 'n2' (dampened), "
                f"got {self.convention!r}"
            )
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 1:
            raise ValueError(
                f"outer delay must be a whole number of rounds ≥ 1, got {self.delay!r} (1: plain Nesterov)"
            )


def outer_step(
    params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    delta: Sequence[Tensor],
    cfg: OuterConfig,
    *,
    index: int = 0,
) -> None:
    """Apply one outer Nesterov step in place: update the momentum buffers m, then θ.

    `index` is the number of the outer step (the round every peer holds alike); only delayed
    Nesterov (cfg.delay > 1) reads it, for the place of this round in its cycle of cfg.delay.

    `delta` is the averaged pseudo-gradient Δ (gradient sign). With cfg.convention "n1" this is
    `torch.optim.SGD(lr=η, momentum=μ, nesterov=True)` with grad = Δ and a zero-initialised momentum
    buffer, up to the last bit: SGD fuses products into sums where the kernel can, this rounds
    every operation, so that the result is the same bits on every CPU kernel path and thread count.
    Raises ValueError if the lists or shapes do not line up, or the index is negative.
    """
    if index < 0:
        raise ValueError(f"outer step {index}: outer steps count from 0")
    if not len(params) == len(momentum) == len(delta):
        raise ValueError(f"got {len(params)} params, {len(momentum)} momenta, {len(delta)} deltas")
    for i, (p, m, d) in enumerate(zip(params, momentum, delta, strict=True)):
        if not p.shape == m.shape == d.shape:
            raise ValueError(
                f"tensor {i}: param {tuple(p.shape)}, momentum {tuple(m.shape)}, delta {tuple(d.shape)}"
            )
    mu, lr, dampened = cfg.momentum, cfg.lr, cfg.convention == "n2"
    with torch.no_grad():
        for p, m, d in zip(params, momentum, delta, strict=True):
            for ps, ms, ds in _slices(p, m, d):
                if cfg.delay == 1:
                    _nesterov(ps, ms, ds, mu=mu, lr=lr, dampened=dampened)
                else:
                    at = index % cfg.delay
                    _delayed_nesterov(ps, ms, ds, mu=mu, lr=lr, dampened=dampened, n=cfg.delay, at=at)


# Elements of a tensor stepped at a time: the step's temporaries are a slice this size, not a
# tensor's (GPT-2's 38.6M-element embedding would otherwise hold a 154 MB temporary at the outer
# step). Every operation is elementwise and rounded on its own, so slices give the same bits.
OUTER_SLICE = 1 << 20


def _slices(p: Tensor, m: Tensor, d: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """p, m and d a slice at a time, as views that write through to them (or whole where one of
    them is not contiguous, or small)."""
    n = p.numel()
    if n <= OUTER_SLICE or not (p.is_contiguous() and m.is_contiguous() and d.is_contiguous()):
        yield p, m, d
        return
    flat_p, flat_m, flat_d = p.view(-1), m.view(-1), d.view(-1)
    for a in range(0, n, OUTER_SLICE):
        yield flat_p[a : a + OUTER_SLICE], flat_m[a : a + OUTER_SLICE], flat_d[a : a + OUTER_SLICE]


def _nesterov(p: Tensor, m: Tensor, d: Tensor, *, mu: float, lr: float, dampened: bool) -> None:
    """m ← μ m + w Δ; θ ← θ − η (Δ + μ m), every product and sum its own correctly rounded op.

    No `alpha=` (and no addcmul or lerp): their vectorized kernels fuse a·b + c into one FMA, while
    the scalar tails, ATEN_CPU_CAPABILITY=default and CPUs without FMA round twice, so peers on
    different hardware would hold θ differing in the last bit, and fork healing would download the
    whole state every round (issue 9 §3; bench/kernel_paths.py measures it, docs/experiments.md).
    """
    m.mul_(mu)
    m.add_(d.mul(1.0 - mu) if dampened else d)
    step = torch.mul(m, mu)
    step.add_(d)
    step.mul_(lr)
    p.sub_(step)


def _delayed_nesterov(
    p: Tensor, m: Tensor, d: Tensor, *, mu: float, lr: float, dampened: bool, n: int, at: int
) -> None:
    """Round `at` (0-based) of a cycle of n: m ← μ m first (at 0), m ← m + w Δ/n; θ ← θ − η Δ/n, and
    at the cycle's last round also θ ← θ − η μ m. Each product and sum rounded on its own (see
    `_nesterov`)."""
    if at == 0:
        m.mul_(mu)
    share = d.div(n)
    m.add_(share.mul(1.0 - mu) if dampened else share)
    step = share
    if at == n - 1:
        step = torch.mul(m, mu)
        step.add_(share)
    step.mul_(lr)
    p.sub_(step)
