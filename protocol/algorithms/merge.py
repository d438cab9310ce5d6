"""AdLoCo multi-instance training (MIT): when to merge two instances, and how.

AdLoCo (arXiv 2508.18182) trains several model instances and merges them over time: every
`merge_every` rounds the two instances with the smallest batch demand merge ("worst_with_worst" in
the official code), the survivor's parameters becoming the demand-weighted average of both
(research/algorithms.md §2.3). Every peer runs `choose_merge` on the same agreed numbers, so the
decision needs no extra message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MergePolicy", "choose_merge", "merge_weighted"]


def merge_weighted(
    a: Mapping[str, Tensor], b: Mapping[str, Tensor], *, weight_a: float, weight_b: float
) -> dict[str, Tensor]:
    """Return the AdLoCo MIT merge x = (w_a·x_a + w_b·x_b) / (w_a + w_b) for every key.

    Weights are batch demands (AdLoCo paper: b; code: #nodes·b). Both zero means (1, 0), as in the
    AdLoCo code. Non-floating tensors (step counters) are copied from `a`. Results have a's dtype
    and are new tensors. Raises ValueError on different keys or shapes, or negative/non-finite
    weights.
    """
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())[:5]}")
    for w in (weight_a, weight_b):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"merge weights must be finite and >= 0, got {weight_a!r}, {weight_b!r}")
    if weight_a == 0 and weight_b == 0:
        weight_a = 1.0
    total = weight_a + weight_b
    with torch.no_grad():
        return {key: _merge_one(key, a[key], b[key], weight_a / total, weight_b / total) for key in a}


def _merge_one(key: str, x_a: Tensor, x_b: Tensor, c_a: float, c_b: float) -> Tensor:
    if x_a.shape != x_b.shape:
        raise ValueError(f"{key}: shape {tuple(x_a.shape)} vs {tuple(x_b.shape)}")
    if not x_a.is_floating_point() or c_b == 0.0:
        return x_a.detach().clone()
    if c_a == 0.0:
        return x_b.detach().to(dtype=x_a.dtype, device=x_a.device, copy=True)
    acc_dtype = torch.promote_types(x_a.dtype, torch.float32)
    mixed = x_a.detach().to(acc_dtype) * c_a + x_b.detach().to(device=x_a.device, dtype=acc_dtype) * c_b
    return mixed.to(x_a.dtype)


@dataclass(frozen=True)
class MergePolicy:
    """When MIT instances merge.

    merge_every: rounds between merges (AdLoCo `merge_frequency`, 2). Raise it if instances merge
        before their batch sizes have separated (demands still equal at merge time).
    min_instances: stop merging at this many instances (the AdLoCo code merges down to 1). Raise it
        to keep parallel instances when one instance cannot use the node's compute.
    """

    merge_every: int = 2
    min_instances: int = 1

    def __post_init__(self) -> None:
        if self.merge_every < 1:
            raise ValueError(f"merge_every must be >= 1 round, got {self.merge_every} (AdLoCo uses 2)")
        if self.min_instances < 1:
            raise ValueError(f"min_instances must be >= 1, got {self.min_instances}")


def choose_merge(demands: Sequence[float], *, round: int, policy: MergePolicy) -> tuple[int, int] | None:
    """Return (victim, survivor) instance indices to merge after `round`, or None.

    Merges when there are more than policy.min_instances instances, round > 0 and
    round % merge_every == 0. "worst_with_worst" (AdLoCo default): sort by (demand, index); the
    smallest-demand instance is the victim and merges into the second smallest, the reasoning being
    that a small adaptive batch marks a trajectory that is not yet in the low-noise regime.
    Ties go to the lower index, so every peer picks the same pair.
    """
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    for d in demands:
        if not math.isfinite(d) or d < 0:
            raise ValueError(f"demands must be finite and >= 0, got {d!r}")
    if len(demands) <= policy.min_instances or round == 0 or round % policy.merge_every != 0:
        return None
    order = sorted(range(len(demands)), key=lambda i: (demands[i], i))
    return order[0], order[1]
