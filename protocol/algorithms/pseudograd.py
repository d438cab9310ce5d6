"""Pseudo-gradients and the small tensor-list helpers every round uses.

A DiLoCo pseudo-gradient is Δ = θ_start − θ_end (DiLoCo, arXiv 2311.08105): it has the sign of a
gradient, so the outer step θ ← θ − η·Δ moves θ toward the local models. A "vector" here is a list of
tensors, one per parameter, in a fixed order that all peers share. `tensors_hash` is how peers check
that they hold the same θ after an outer step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["flat_norm", "pseudo_gradient", "tensors_hash", "weighted_mean"]


def pseudo_gradient(start: Sequence[Tensor], end: Sequence[Tensor]) -> list[Tensor]:
    """Return Δ = θ_start − θ_end per tensor (the DiLoCo pseudo-gradient, gradient sign).

    Raises ValueError if the lists differ in length or a pair differs in shape.
    """
    _check_same_layout(start, end, what="start/end")
    with torch.no_grad():
        return [s.detach() - e.detach() for s, e in zip(start, end, strict=True)]


def weighted_mean(vectors: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> list[Tensor]:
    """Return Σ_i w_i·v_i / Σ_i w_i per tensor (e.g. the token-weighted node pseudo-gradient).

    Weights are normalized first. Low-precision inputs accumulate in float32 and come back in the
    dtype of the first vector. The result depends on the order of `vectors` in the last bit: callers
    that need bit-identical results across peers must pass them in an agreed order.
    Raises ValueError on no vectors, a length mismatch, a negative or non-finite weight, or a zero
    weight sum.
    """
    if not vectors:
        raise ValueError("weighted_mean needs at least one vector")
    if len(vectors) != len(weights):
        raise ValueError(f"got {len(vectors)} vectors but {len(weights)} weights")
    for w in weights:
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weights must be finite and >= 0, got {w!r}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("weights sum to 0: give at least one vector a positive weight")
    for other in vectors[1:]:
        _check_same_layout(vectors[0], other, what="vectors")
    coefs = [w / total for w in weights]
    with torch.no_grad():
        return [_mix([v[j] for v in vectors], coefs) for j in range(len(vectors[0]))]


def flat_norm(tensors: Iterable[Tensor]) -> float:
    """Return the Euclidean norm of all tensors seen as one flat vector (computed in float64)."""
    sq = math.fsum(float(t.detach().double().square().sum()) for t in tensors)
    return math.sqrt(sq)


def tensors_hash(tensors: Iterable[Tensor]) -> str:
    """Return a sha256 hex digest of the tensors' shapes and float32 values, in order.

    Values are converted to float32 (little-endian on every platform we run) so peers that hold θ
    in different dtypes of equal value still agree; -0.0 and 0.0, or two NaN payloads, differ.
    """
    digest = hashlib.sha256()
    for t in tensors:
        values = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(repr(tuple(values.shape)).encode())
        digest.update(memoryview(values.numpy()).cast("B"))  # type: ignore[arg-type]  # the buffer itself, no copy
    return digest.hexdigest()


def _mix(parts: Sequence[Tensor], coefs: Sequence[float]) -> Tensor:
    out_dtype = parts[0].dtype
    acc_dtype = torch.promote_types(out_dtype, torch.float32)
    acc = torch.zeros(parts[0].shape, dtype=acc_dtype, device=parts[0].device)
    for part, c in zip(parts, coefs, strict=True):
        if c != 0.0:
            acc.add_(part.detach().to(acc_dtype), alpha=c)
    return acc.to(out_dtype)


def _check_same_layout(a: Sequence[Tensor], b: Sequence[Tensor], *, what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} tensors vs {len(b)} tensors")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.shape != y.shape:
            raise ValueError(f"{what}: tensor {i} has shape {tuple(x.shape)} vs {tuple(y.shape)}")
