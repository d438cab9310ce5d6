"""Adaptive batch-size tests: the norm test and the augmented inner-product test.

AdLoCo's stage 2 (arXiv 2508.18182) grows each instance's batch b once per round with the norm test of
Byrd et al. (2012) as used by AdAdaGrad (arXiv 2402.11215), or with the augmented inner-product test
of Bollapragada et al. (2018). Both need only a few scalars computed from M gradients g_m, each the
mean gradient over n samples; `GradStats` holds those scalars so they can ride in the gathered
metadata of an all-reduce, and `pool_stats` combines them across peers the same way on every peer.
Fixes of research/algorithms.md §2.10 applied here: a batch cap (item 6), ϑ for the inner-product
test and ν for orthogonality, the same n/(M−1) scaling as the norm test, and the trace of the
covariance rather than a scalar variance over all entries (item 7).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "GradStats",
    "augmented_ip_test",
    "grad_stats",
    "next_batch",
    "norm_test",
    "pool_stats",
]

BatchTest = Literal["norm", "augmented", "none"]

# Below this ||ḡ||² every ratio is noise over noise; AdLoCo's calc_batch.py uses the same bound.
MIN_MEAN_SQ_NORM = 1e-12

_INT_FIELDS = ("num_grads", "samples_per_grad", "num_groups")
_FLOAT_FIELDS = ("sq_dev_sum", "mean_sq_norm", "ip_dev_sum", "ortho_dev_sum")


@dataclass(frozen=True, kw_only=True)
class GradStats:
    """Scalars from M gradients g_m, each a mean over n samples, that the batch tests need.

    num_grads: M. samples_per_grad: n. sq_dev_sum: S = Σ_m ||g_m − ḡ||². mean_sq_norm: ||ḡ||².
    ip_dev_sum: Σ_m (⟨g_m, ḡ⟩ − mean_m ⟨g_m, ḡ⟩)². ortho_dev_sum: Σ_m ||o_m − ō||² with
    o_m = g_m − (⟨g_m, ḡ⟩/||ḡ||²) ḡ, the part of g_m orthogonal to ḡ.
    num_groups: how many independent groups (peers, instances) were pooled into these sums; each
    group's own mean costs one degree of freedom, so dof = M − num_groups (M − 1 for one group).
    """

    num_grads: int
    samples_per_grad: int
    sq_dev_sum: float
    mean_sq_norm: float
    ip_dev_sum: float
    ortho_dev_sum: float
    num_groups: int = 1

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GradStats.{name} must be an int >= 1, got {value!r}")
        if self.num_groups > self.num_grads:
            raise ValueError(f"GradStats.num_groups ({self.num_groups}) exceeds num_grads ({self.num_grads})")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"GradStats.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"GradStats.{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def dof(self) -> int:
        """Degrees of freedom of the pooled within-group variance, Σ_groups (M_group − 1)."""
        return self.num_grads - self.num_groups

    def to_dict(self) -> dict[str, int | float]:
        """Plain dict of ints and floats for gathered metadata (JSON and msgpack safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GradStats:
        """Inverse of `to_dict`; raises ValueError on missing, unknown or invalid fields."""
        required = set(_INT_FIELDS + _FLOAT_FIELDS) - {"num_groups"}
        allowed = set(_INT_FIELDS + _FLOAT_FIELDS)
        missing, unknown = required - data.keys(), data.keys() - allowed
        if missing or unknown:
            raise ValueError(f"GradStats: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        return cls(**dict(data))


def grad_stats(grads: Sequence[Tensor] | Sequence[Sequence[Tensor]], samples_per_grad: int) -> GradStats:
    """Compute `GradStats` from M gradients, each a mean over `samples_per_grad` samples.

    Each g_m is a tensor (any shape, flattened) or a list of per-parameter tensors in a shared order.
    Sums run per parameter tensor in float64, so memory stays at M × the largest tensor. Uses
    ortho_dev_sum = S − ip_dev_sum/||ḡ||² (the deviation of g_m splits into a part along ḡ and a part
    orthogonal to it; mean_m ⟨g_m, ḡ⟩ = ||ḡ||²). Raises ValueError on no gradients, mismatched
    shapes, n < 1, or non-finite gradients.
    """
    if not grads:
        raise ValueError("grad_stats needs at least one gradient")
    parts = [[g] if isinstance(g, Tensor) else list(g) for g in grads]
    num_parts = len(parts[0])
    if any(len(p) != num_parts for p in parts):
        raise ValueError("every gradient must have the same number of tensors")
    m = len(parts)
    sq_dev, sq_norm = 0.0, 0.0
    ip = torch.zeros(m, dtype=torch.float64)
    with torch.no_grad():
        for j in range(num_parts):
            if any(p[j].numel() != parts[0][j].numel() for p in parts):
                raise ValueError(f"tensor {j} differs in size between gradients")
            g = torch.stack([p[j].detach().reshape(-1).to(device="cpu", dtype=torch.float64) for p in parts])
            mean = g.mean(dim=0)
            sq_dev += float((g - mean).square().sum())
            sq_norm += float(mean.square().sum())
            ip += g @ mean
    return stats_from_sums(sq_dev=sq_dev, sq_norm=sq_norm, ip=ip.tolist(), samples_per_grad=samples_per_grad)


def stats_from_sums(
    *, sq_dev: float, sq_norm: float, ip: Sequence[float], samples_per_grad: int
) -> GradStats:
    """`GradStats` from the sums however they were gathered: S = Σ_m ||g_m − ḡ||², ||ḡ||², and
    ip_m = ⟨g_m, ḡ⟩ for each of the M gradients. ValueError if any is not finite."""
    if not (math.isfinite(sq_dev) and math.isfinite(sq_norm) and all(math.isfinite(v) for v in ip)):
        raise ValueError("grad_stats: gradients contain inf or NaN")
    mean_ip = math.fsum(ip) / len(ip)
    ip_dev = math.fsum((v - mean_ip) ** 2 for v in ip)
    ortho_dev = max(0.0, sq_dev - ip_dev / sq_norm) if sq_norm > 0 else sq_dev
    return GradStats(
        num_grads=len(ip),
        samples_per_grad=samples_per_grad,
        sq_dev_sum=sq_dev,
        mean_sq_norm=sq_norm,
        ip_dev_sum=ip_dev,
        ortho_dev_sum=ortho_dev,
    )


def pool_stats(stats: Sequence[GradStats | None]) -> GradStats | None:
    """Combine statistics from several peers or instances; None entries are skipped.

    Returns None when nothing is left. Deviation sums, M and num_groups add up, so the pooled
    variance is the within-group one with dof = Σ_p (M_p − 1); between-group differences of the
    means ḡ_p are not seen (they would need the vectors, not scalars). ||ḡ||² is the M-weighted mean
    of the groups' ||ḡ_p||². n becomes the M-weighted mean of the n_p rounded half up, and each
    group's deviation sums are rescaled by n_p/n so that n·S/dof = Σ_p n_p·S_p / Σ_p dof_p exactly
    (the factor is 1.0 when all n_p agree). Sums use math.fsum, which is exactly rounded, so the
    result is bit-identical for any order of `stats`.
    """
    present = [s for s in stats if s is not None]
    if not present:
        return None
    total_m = sum(s.num_grads for s in present)
    n_num = sum(s.num_grads * s.samples_per_grad for s in present)
    n = max(1, (2 * n_num + total_m) // (2 * total_m))
    return GradStats(
        num_grads=total_m,
        samples_per_grad=n,
        sq_dev_sum=_rescaled_sum(present, "sq_dev_sum", n),
        mean_sq_norm=math.fsum(sorted(s.mean_sq_norm * (s.num_grads / total_m) for s in present)),
        ip_dev_sum=_rescaled_sum(present, "ip_dev_sum", n),
        ortho_dev_sum=_rescaled_sum(present, "ortho_dev_sum", n),
        num_groups=sum(s.num_groups for s in present),
    )


def norm_test(stats: GradStats | None, batch: int, *, eta: float, cap: int, global_factor: int = 1) -> int:
    """Return the next batch size from the norm test (η in the AdLoCo norm test, `ETA`).

    V = n·S/dof estimates the per-sample variance trace; the test asks V/T ≤ η²·||ḡ||², so
    T = ⌈V / (η²·||ḡ||²·global_factor)⌉ and b' = min(cap, max(b, T)). With n = b, dof = M − 1 and
    global_factor = M this is AdLoCo's per-node form b' = max(b, ⌈b·S/((M−1)·M·η²·||ḡ||²)⌉): there
    the M node gradients are averaged into one global batch M·b', so each node needs only T/M.
    Keep global_factor = 1 when b is the batch of one step that is not averaged with others.
    b never decreases except that the cap always wins (a b above a lowered cap comes down to it).
    With no statistics, dof < 1 or ||ḡ||² < 1e-12 the batch is kept.
    """
    _check_batch_args(batch, cap=cap, global_factor=global_factor)
    _check_positive("eta", eta)
    if not _usable(stats):
        return min(batch, cap)
    assert stats is not None
    variance = stats.samples_per_grad * stats.sq_dev_sum / stats.dof
    target = variance / (eta * eta * stats.mean_sq_norm * global_factor)
    return _grow(batch, target, cap=cap)


def augmented_ip_test(
    stats: GradStats | None, batch: int, *, theta: float, nu: float, cap: int, global_factor: int = 1
) -> int:
    """Return the next batch size from the augmented inner-product test (Bollapragada et al. 2018).

    Inner-product test with ϑ (`theta`, AdLoCo's `vartheta`): T_ip = n·(ip_dev_sum/dof)/(ϑ²·||ḡ||⁴).
    Orthogonality test with ν (`nu`): T_orth = n·(ortho_dev_sum/dof)/(ν²·||ḡ||²), the trace of the
    covariance of the orthogonal parts. Both are divided by global_factor as in `norm_test`, and
    b' = min(cap, max(b, ⌈max(T_ip, T_orth)⌉)). The AdLoCo code used ν for both tests, no n/(M−1)
    scaling and a scalar variance over all entries (research/algorithms.md §2.10.7); this does not.
    Degenerate statistics keep the batch, as in `norm_test`.
    """
    _check_batch_args(batch, cap=cap, global_factor=global_factor)
    _check_positive("theta", theta)
    _check_positive("nu", nu)
    if not _usable(stats):
        return min(batch, cap)
    assert stats is not None
    n, dof, q = stats.samples_per_grad, stats.dof, stats.mean_sq_norm
    t_ip = n * (stats.ip_dev_sum / dof) / (theta * theta * q * q * global_factor)
    t_orth = n * (stats.ortho_dev_sum / dof) / (nu * nu * q * global_factor)
    return _grow(batch, max(t_ip, t_orth), cap=cap)


def next_batch(
    stats: GradStats | None,
    batch: int,
    *,
    test: BatchTest,
    eta: float,
    theta: float,
    nu: float,
    cap: int,
    global_factor: int = 1,
) -> int:
    """Dispatch to `norm_test`, `augmented_ip_test`, or keep b ("none", AdLoCo's constant batch)."""
    if test == "norm":
        return norm_test(stats, batch, eta=eta, cap=cap, global_factor=global_factor)
    if test == "augmented":
        return augmented_ip_test(stats, batch, theta=theta, nu=nu, cap=cap, global_factor=global_factor)
    if test == "none":
        _check_batch_args(batch, cap=cap, global_factor=global_factor)
        return min(batch, cap)
    raise ValueError(f"unknown batch test {test!r}: use 'norm', 'augmented' or 'none'")


def _rescaled_sum(stats: Sequence[GradStats], field: str, n: int) -> float:
    # Exactly 1.0 when n_p == n, so equal-n pools (and a pool of one) add the raw sums.
    values = [getattr(s, field) * (s.samples_per_grad / n if s.samples_per_grad != n else 1.0) for s in stats]
    return math.fsum(sorted(values))


def _usable(stats: GradStats | None) -> bool:
    return stats is not None and stats.dof >= 1 and stats.mean_sq_norm >= MIN_MEAN_SQ_NORM


def _grow(batch: int, target: float, *, cap: int) -> int:
    # Compare before ceil: a huge ratio (tiny ||ḡ||²) may be inf, and ceil(inf) raises.
    if not target < cap:
        return cap
    return min(cap, max(batch, math.ceil(target)))


def _check_batch_args(batch: int, *, cap: int, global_factor: int) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if cap < 1:
        raise ValueError(f"batch cap must be >= 1, got {cap}")
    if global_factor < 1:
        raise ValueError(f"global_factor must be >= 1, got {global_factor}")


def _check_positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
