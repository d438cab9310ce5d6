"""Splitting one all-reduce among the members of an averaging group.

Each tensor ("part") of the pseudo-gradient is owned by one member: every other member sends it
their encoded copy, the owner decodes and averages them (`reduce_part`) and sends the same encoded
average back to everyone. `assign_parts` balances owners by bytes deterministically, so all
members derive the same assignment from the same sizes without talking; `round_traffic` counts the
exact bytes each member sends and receives in such a round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from adloco.protocol.codecs import Codec, decode


def assign_parts(sizes: Sequence[int], num_members: int) -> list[int]:
    """Owner member index per tensor: greedy largest-first onto the least-loaded member.

    Tensors are taken by size descending (ties: lower index first) and each goes to the member
    with the smallest load so far (ties: lower member index). Depends on nothing but the inputs.
    """
    if num_members < 1:
        raise ValueError(f"num_members must be >= 1, got {num_members}")
    if any(size < 0 for size in sizes):
        raise ValueError("tensor sizes must be non-negative")
    loads = [0] * num_members
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        member = min(range(num_members), key=lambda j: (loads[j], j))
        owners[index] = member
        loads[member] += sizes[index]
    return owners


def reduce_part(
    payloads: Sequence[bytes],
    weights: Sequence[float],
    codec: Codec,
    key: str,
    *,
    total_weight: float | None = None,
) -> bytes:
    """Decode every member's payload of one tensor, average with normalized weights, re-encode.

    The weighted sum runs in float32 in the order given; the returned bytes are what the owner
    sends to every member. With `total_weight` the sum is divided by it instead of by Σ weights:
    the weights are then tokens × staleness weight and the total is the group's tokens, so a
    down-weighted late contribution is smaller in absolute terms, not only relative to the others.
    A single payload with no total is forwarded unchanged. Raises ValueError on empty, negative,
    non-finite or zero-sum weights, on a payload/weight count mismatch and on differing shapes.
    """
    normalized = _normalized_weights(weights)
    if total_weight is not None:
        if not math.isfinite(total_weight) or total_weight <= 0:
            raise ValueError(f"total_weight must be finite and > 0, got {total_weight}")
        scale = math.fsum(weights) / total_weight
        normalized = [w * scale for w in normalized]
    if len(payloads) != len(normalized):
        raise ValueError(f"{len(payloads)} payloads but {len(normalized)} weights")
    if len(payloads) == 1 and normalized == [1.0]:
        # The average of one contribution is that contribution: forward its bytes rather than
        # re-encode them and add a second compression error.
        decode(payloads[0])  # still validate it
        return bytes(payloads[0])
    tensors = [decode(payload) for payload in payloads]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"{key}: payload shapes differ: {sorted(shapes)}")
    average = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, normalized, strict=True):
        average.add_(tensor, alpha=weight)
    return codec.encode(key, average)


def _normalized_weights(weights: Sequence[float]) -> list[float]:
    if not weights:
        raise ValueError("reduce_part needs at least one weight")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("weights sum to 0")
    return [w / total for w in weights]


def round_traffic(
    owners: Sequence[int], up_sizes: Sequence[Sequence[int]], down_sizes: Sequence[int], num_members: int
) -> tuple[list[int], list[int]]:
    """Exact (sent, received) bytes per member for one owner-reduces all-reduce round.

    Member i sends its payload of tensor t (`up_sizes[i][t]` bytes) to `owners[t]` unless it is
    the owner; the owner sends the reduced payload (`down_sizes[t]` bytes) to every other member.
    """
    _check_traffic_shapes(owners, up_sizes, down_sizes, num_members)
    sent = [0] * num_members
    received = [0] * num_members
    for part, owner in enumerate(owners):
        for member in range(num_members):
            if member == owner:
                continue
            sent[member] += up_sizes[member][part]
            received[owner] += up_sizes[member][part]
            sent[owner] += down_sizes[part]
            received[member] += down_sizes[part]
    return sent, received


def _check_traffic_shapes(
    owners: Sequence[int], up_sizes: Sequence[Sequence[int]], down_sizes: Sequence[int], num_members: int
) -> None:
    if len(up_sizes) != num_members:
        raise ValueError(f"up_sizes has {len(up_sizes)} rows for {num_members} members")
    if any(len(row) != len(owners) for row in up_sizes) or len(down_sizes) != len(owners):
        raise ValueError(f"every size list must have one entry per tensor ({len(owners)})")
    if any(not 0 <= owner < num_members for owner in owners):
        raise ValueError(f"owners must be member indices in [0, {num_members})")
