"""Adaptive compression: the cheapest codec whose measured error meets a bound within a byte budget.

`choose_codec` ranks candidate specs by their exact wire bytes (from shapes alone), measures each
one's relative round-trip error ‖Δ − D(C(Δ))‖/‖Δ‖ with a fresh codec, and returns the cheapest that
meets `max_rel_error` within `byte_budget`, with fallbacks when none does. Every peer of a group
runs it on the same averaged Δ̄, so all pick the same codec for the next round without a message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .codecs import decode_tensors, encode_tensors, make_codec
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


def predicted_wire_bytes(spec: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """Exact total payload bytes of `tensors` under `spec`, from shapes alone."""
    codec = make_codec(spec)
    return sum(codec.wire_bytes(tuple(t.shape)) for t in tensors.values())


def measured_error(spec: str, tensors: Mapping[str, torch.Tensor]) -> float:
    """Relative round-trip error with a fresh codec, so it does not depend on warm-start state."""
    error = relative_error(tensors, decode_tensors(encode_tensors(make_codec(spec), tensors)))
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
    within budget, the cheapest overall. Each error costs one encode+decode of all `tensors`, so
    pass a sample of layers for large models. Deterministic: same input, same choice.
    """
    if not candidates:
        raise ValueError("choose_codec needs at least one candidate spec")
    budget = math.inf if byte_budget is None else byte_budget
    ranked = sorted(candidates, key=lambda spec: predicted_wire_bytes(spec, tensors))
    within: list[CodecChoice] = []
    for spec in ranked:
        size = predicted_wire_bytes(spec, tensors)
        if size > budget:
            break
        error = measured_error(spec, tensors)
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
