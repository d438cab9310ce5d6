"""Sums whose result is the same bits on every CPU kernel path and thread count.

A torch reduction (`sum`, `norm`, `dot`) adds in an order set by its kernel: as many partial sums as
the vector unit has lanes (4 with AVX2, 8 with AVX-512 for float64), one more level per thread. Its
last bits then differ between peers on different hardware. What every peer of a group computes
apart and must agree on (the adaptive codec's measured errors, adaptive.py) sums here instead, by
halving: add the second half of the values onto the first, elementwise, until one is left. Every
step is an elementwise add, which IEEE 754 rounds the same in every lane and on every path, so
the order, and so the result, is fixed by the length alone (issue 9 §3). In float64, pairwise:
about as accurate as torch's own sum, and a few passes over the data.
"""

from __future__ import annotations

import torch

__all__ = ["fixed_order_sum", "sum_of_squares"]


def fixed_order_sum(values: torch.Tensor) -> float:
    """Σ of all values in float64, in an order that depends on their number only."""
    return _halving_sum(values.detach().reshape(-1).to(torch.float64, copy=True))


def sum_of_squares(values: torch.Tensor, minus: torch.Tensor | None = None) -> float:
    """Σ (values − minus)² (or Σ values²) in float64, in a fixed order (`fixed_order_sum`)."""
    x = values.detach().reshape(-1).to(torch.float64, copy=True)
    if minus is not None:
        x.sub_(minus.detach().reshape(-1).to(torch.float64))
    return _halving_sum(x.mul_(x))


def _halving_sum(x: torch.Tensor) -> float:
    """Σ of the 1-d float64 scratch `x` (overwritten), by halving."""
    n = x.numel()
    if n == 0:
        return 0.0
    while n > 1:
        half = (n + 1) // 2
        # x[i] += x[i + half] for i < n - half: the two slices never overlap (n - half <= half).
        x[: n - half].add_(x[half:n])
        n = half
    return float(x[0])
