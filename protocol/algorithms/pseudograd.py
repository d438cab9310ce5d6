"""Pseudo-gradients and the small tensor-list helpers every round uses.

A DiLoCo pseudo-gradient is Δ = θ_start − θ_end (DiLoCo, arXiv 2311.08105): it has the sign of a
gradient, so the outer step θ ← θ − η·Δ moves θ toward the local models. A "vector" here is a list of
tensors, one per parameter, in a fixed order that all peers share. `tensors_hash` is how peers check
that they hold the same θ after an outer step. A `PseudoGradient` is Δ read tensor by tensor from the
two models it is the difference of, so a round's Δ never needs a copy of the model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

import torch
from torch import Tensor

from .codecs import span_bounds

__all__ = ["PseudoGradient", "flat_norm", "pseudo_gradient", "tensors_hash", "weighted_mean"]


def pseudo_gradient(start: Sequence[Tensor], end: Sequence[Tensor]) -> list[Tensor]:
    """Return Δ = θ_start − θ_end per tensor (the DiLoCo pseudo-gradient, gradient sign).

    Raises ValueError if the lists differ in length or a pair differs in shape.
    """
    _check_same_layout(start, end, what="start/end")
    with torch.no_grad():
        return [s.detach() - e.detach() for s, e in zip(start, end, strict=True)]


# Values of a tensor of Δ computed at a time into the caller's tensors (`PseudoGradient.materialize`).
MATERIALIZE_SPAN = 1 << 20


class PseudoGradient(Sequence[Tensor]):
    """Δ = start − end per tensor, each computed when it is read: a pseudo-gradient without a copy.

    Holds the two lists of tensors themselves, so reading tensor j costs one tensor, and a reader
    that encodes Δ tensor by tensor never holds all of it. Its values are those of
    `pseudo_gradient(start, end)` as long as neither side changes: whoever is about to change one in
    place calls `materialize()` first (Δ is then computed whole and kept: in memory, or in tensors
    the caller gives, mapped from a file, say), or `release()` if Δ will not be read again. Reading a
    tensor whose sides changed in place since, or after `release()`, raises RuntimeError rather than
    returning another Δ. A reader done with tensor j calls `done_with(j)`.
    """

    def __init__(self, start: Sequence[Tensor], end: Sequence[Tensor]) -> None:
        _check_same_layout(start, end, what="start/end")
        self._pairs: list[tuple[Tensor, Tensor]] | None = [
            (s.detach(), e.detach()) for s, e in zip(start, end, strict=True)
        ]
        # In-place changes bump a tensor's version counter (shared with its views and detached twins).
        self._versions = [(s._version, e._version) for s, e in self._pairs]
        self._values: list[Tensor] | None = None
        self._hand_back: Callable[[int, int, int], None] | None = None
        self._len = len(self._pairs)

    @property
    def is_lazy(self) -> bool:
        """Still read from its two sides (not materialized, not released)."""
        return self._pairs is not None

    def materialize(
        self,
        into: Sequence[Tensor] | None = None,
        *,
        hand_back: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Compute and keep every tensor of Δ now, before either side changes (no-op once released):
        into new tensors, or into `into` (one per tensor, of Δ's shapes, contiguous), the same
        values bit for bit, `MATERIALIZE_SPAN` values at a time. `hand_back(j, start, stop)` gives
        back what holding values `start` to `stop` of tensor j (flat) costs, on both sides and in
        `into` (the pages of tensors mapped from files): called as each span is computed, and by
        `done_with(j)` for the whole tensor."""
        if self._pairs is None:
            return
        if into is None:
            values = [self._compute(j) for j in range(self._len)]
        else:
            _check_same_layout([s for s, _ in self._pairs], into, what="Δ/into")
            values = list(into)
            for j in range(self._len):
                s, e = (side.reshape(-1) for side in self._sides(j))
                out = values[j].view(-1)
                for at, stop in span_bounds(out.numel(), MATERIALIZE_SPAN):
                    with torch.no_grad():
                        torch.sub(s[at:stop], e[at:stop], out=out[at:stop])
                    if hand_back is not None:
                        hand_back(j, at, stop)
        self._values, self._pairs, self._hand_back = values, None, hand_back

    def done_with(self, j: int) -> None:
        """A reader is done with tensor j for now: what holding it costs goes back (the pages of a
        Δ materialized into mapped tensors; a no-op otherwise)."""
        if self._values is not None and self._hand_back is not None:
            self._hand_back(j, 0, self._values[j].numel())

    def release(self) -> None:
        """Drop Δ: it will not be read again (reading raises RuntimeError)."""
        self._pairs, self._values, self._hand_back = None, None, None

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[Tensor]: ...
    def __getitem__(self, index: int | slice) -> Tensor | list[Tensor]:
        if isinstance(index, slice):
            return [self[j] for j in range(*index.indices(self._len))]
        if not -self._len <= index < self._len:
            raise IndexError(f"pseudo-gradient index {index} out of range ({self._len} tensors)")
        j = index % self._len
        if self._values is not None:
            return self._values[j]
        return self._compute(j)

    def __iter__(self) -> Iterator[Tensor]:
        return (self[j] for j in range(self._len))

    def _compute(self, j: int) -> Tensor:
        s, e = self._sides(j)
        with torch.no_grad():
            return s - e

    def _sides(self, j: int) -> tuple[Tensor, Tensor]:
        """Tensor j's start and end, unchanged since Δ was taken; RuntimeError otherwise."""
        if self._pairs is None:
            raise RuntimeError("pseudo-gradient read after release()")
        s, e = self._pairs[j]
        if (s._version, e._version) != self._versions[j]:
            raise RuntimeError(f"pseudo-gradient tensor {j}: a side changed in place; materialize() before")
        return s, e


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
    digest = TensorsHash()
    for t in tensors:
        digest.update(t)
    return digest.hexdigest()


class TensorsHash:
    """`tensors_hash` fed one tensor at a time (a θ worked out tensor by tensor is never whole)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def update(self, tensor: Tensor) -> None:
        self.update_spans(tensor.shape, [tensor.detach().reshape(-1)])

    def update_spans(self, shape: Sequence[int], spans: Iterable[Tensor]) -> None:
        """`update` with a tensor of `shape` whose values come flat, a span at a time in order: the
        same digest."""
        self._digest.update(repr(tuple(shape)).encode())
        for span in spans:
            values = span.detach().to(device="cpu", dtype=torch.float32).contiguous()
            self._digest.update(memoryview(values.numpy()).cast("B"))  # type: ignore[arg-type]  # the buffer itself, no copy

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


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
