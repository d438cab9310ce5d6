"""Adaptive compression: the cheapest codec whose measured error meets a bound within a byte budget.

`choose_codec` ranks candidate specs by their exact wire bytes (from shapes alone), measures each
one's relative round-trip error ‖Δ − D(C(Δ))‖/‖Δ‖ with a fresh codec, and returns the cheapest that
meets `max_rel_error` within `byte_budget`, with fallbacks when none does. Every peer of a group
runs it on the same averaged Δ̄, so all pick the same codec for the next round without a message.
It reads its tensors one at a time: given `Payloads` (the encoded Δ̄), no more than one is decoded
at once, where a model's whole Δ̄ and a candidate's round trip of it were held (1 GB at GPT-2 124M).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .codecs import decode, make_codec, payload_shape
from .fixed_order import sum_of_squares

DEFAULT_CANDIDATES: tuple[str, ...] = (
    "none",
    "fp16",
    "int8",
    "int4",
    "lowrank:1",
    "lowrank:2",
    "lowrank:4",
    "lowrank:8",
    "lowrank:16",
    "lowrank:32",
)

_TINY = torch.finfo(torch.float32).tiny

TensorOrDict = torch.Tensor | Mapping[str, torch.Tensor]

REASON_MEETS_BOTH = "cheapest meeting max_rel_error within byte_budget"
REASON_LOWEST_ERROR = "none meets max_rel_error; lowest error within byte_budget"
REASON_OVER_BUDGET = "none within byte_budget; cheapest overall"


@dataclass(frozen=True)
class CodecChoice:
    """Outcome of `choose_codec`: the spec, its exact wire bytes and measured relative error."""

    spec: str
    wire_bytes: int
    rel_error: float
    reason: str


class Payloads(Mapping[str, torch.Tensor]):
    """Encoded tensors read as the decoded ones, each decoded when it is asked for and not kept (the
    reader holds it as long as it needs it); their shapes come from the payloads' headers."""

    def __init__(self, payloads: Mapping[str, bytes]) -> None:
        self.payloads = payloads

    def __getitem__(self, key: str) -> torch.Tensor:
        return decode(self.payloads[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.payloads)

    def __len__(self) -> int:
        return len(self.payloads)

    def shape(self, key: str) -> tuple[int, ...]:
        return payload_shape(self.payloads[key])


def _shapes(tensors: Mapping[str, torch.Tensor]) -> list[tuple[int, ...]]:
    if isinstance(tensors, Payloads):
        return [tensors.shape(key) for key in tensors]
    return [tuple(t.shape) for t in tensors.values()]


def predicted_wire_bytes(spec: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """Exact total payload bytes of `tensors` under `spec`, from shapes alone."""
    codec = make_codec(spec)
    return sum(codec.wire_bytes(shape) for shape in _shapes(tensors))


def measured_error(spec: str, tensors: Mapping[str, torch.Tensor]) -> float:
    """Relative round-trip error with a fresh codec, so it does not depend on warm-start state; a
    tensor at a time (`relative_error`'s sums, in its order: the same value as over the whole)."""
    return _error(*_round_trip(spec, tensors))


def _round_trip(
    spec: str, tensors: Mapping[str, torch.Tensor], norm: float | None = None
) -> tuple[float, float]:
    """(Σ ‖x − x̂‖², Σ ‖x‖²) over `tensors` in their order, x̂ their round trip through a fresh
    `spec` codec; the second is `norm` where given (it does not depend on the codec: `choose_codec`
    sums it once for all its candidates)."""
    codec = make_codec(spec)
    diff = total = 0.0
    for key in tensors:
        x = tensors[key].detach().cpu()
        x_hat = decode(codec.encode(key, x))
        if x.shape != x_hat.shape:
            raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
        diff += sum_of_squares(x, minus=x_hat)
        if norm is None:
            total += sum_of_squares(x)
    return diff, total if norm is None else norm


def _error(diff: float, norm: float) -> float:
    error = math.sqrt(diff) / max(math.sqrt(norm), _TINY)
    return math.inf if math.isnan(error) else error


def choose_codec(
    tensors: Mapping[str, torch.Tensor],
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    max_rel_error: float,
    byte_budget: float | None = None,
) -> CodecChoice:
    """Cheapest candidate whose error is <= `max_rel_error` and bytes <= `byte_budget`.

    Candidates are tried by predicted bytes ascending (ties keep the given order). If none meets
    both bounds, the lowest-error candidate within budget wins (ties: fewer bytes); if none is
    within budget, the cheapest overall. Each error costs one encode+decode of all `tensors`, one
    at a time (pass `Payloads` to decode them one at a time too), their norm summed once.
    Deterministic: same input, same choice.
    """
    if not candidates:
        raise ValueError("choose_codec needs at least one candidate spec")
    budget = math.inf if byte_budget is None else byte_budget
    ranked = sorted(candidates, key=lambda spec: predicted_wire_bytes(spec, tensors))
    within: list[CodecChoice] = []
    norm = None
    for spec in ranked:
        size = predicted_wire_bytes(spec, tensors)
        if size > budget:
            break
        diff, norm = _round_trip(spec, tensors, norm)
        error = _error(diff, norm)
        if error <= max_rel_error:
            return CodecChoice(spec, size, error, REASON_MEETS_BOTH)
        within.append(CodecChoice(spec, size, error, REASON_LOWEST_ERROR))
    if within:
        return min(within, key=lambda choice: (choice.rel_error, choice.wire_bytes))
    cheapest = ranked[0]
    return CodecChoice(
        cheapest,
        predicted_wire_bytes(cheapest, tensors),
        measured_error(cheapest, tensors),
        REASON_OVER_BUDGET,
    )


def relative_error(x: TensorOrDict, x_hat: TensorOrDict) -> float:
    """‖x − x̂‖ / max(‖x‖, tiny), the norms taken over all tensors of a dict together."""
    pairs = _paired(x, x_hat)
    # Fixed-order sums: every member of a group computes this apart and must choose alike.
    diff = sum(sum_of_squares(a, minus=b) for a, b in pairs)
    norm = sum(sum_of_squares(a) for a, _ in pairs)
    return math.sqrt(diff) / max(math.sqrt(norm), _TINY)


def _paired(x: TensorOrDict, x_hat: TensorOrDict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(x, torch.Tensor) and isinstance(x_hat, torch.Tensor):
        pairs = [(x, x_hat)]
    elif isinstance(x, Mapping) and isinstance(x_hat, Mapping):
        if set(x) != set(x_hat):
            raise ValueError(f"key sets differ: {sorted(set(x) ^ set(x_hat))}")
        pairs = [(x[key], x_hat[key]) for key in x]
    else:
        raise ValueError("relative_error needs two tensors or two dicts of tensors")
    for a, b in pairs:
        if a.shape != b.shape:
            raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    return [(a.detach().cpu(), b.detach().cpu()) for a, b in pairs]
