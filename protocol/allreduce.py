"""The semantics of our all-reduce, independent of any transport.

A group of members each contributes encoded pseudo-gradient tensors, a weight (tokens × staleness
weight) and metadata. Each tensor ("part") is owned by one member (`parts.assign_parts`): the owner
decodes every member's copy of it, takes the weighted average, encodes that average once, and sends
the *same bytes* to every member, itself included. Every member therefore decodes identical bytes
and applies an identical outer update, whatever the codec, which is what keeps θ identical across
the group (hivemind's averager, which adds a compressed delta to each member's own exact values,
does not have this property for lossy codecs).

`reduce_group` is that computation done in one place; the in-memory transport of the simulator calls
it directly, and the network transport performs the same steps part by part across peers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adloco.protocol.codecs import Codec, decode_tensors
from adloco.protocol.parts import assign_parts, reduce_part, round_traffic


@dataclass(frozen=True)
class Contribution:
    """One member's input to a round: encoded tensors, averaging weight, gathered metadata.

    weight is tokens × staleness weight ρ(τ); tokens is the unweighted count. When every member
    gives its tokens, the group average is Σ weight·Δ / Σ tokens, so ρ(τ) < 1 shrinks a late
    contribution even in a group of one (Async DiLoCo applies ρ to each arrival the same way).
    """

    peer_id: str
    payloads: Mapping[str, bytes]
    weight: float
    tokens: float = 0.0
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupResult:
    """What every member of the group receives (identical for all) and the traffic it cost each."""

    averaged: dict[str, bytes]
    gathered: tuple[Mapping[str, Any], ...]
    members: tuple[str, ...]
    owners: dict[str, str]
    sent_bytes: dict[str, int]
    received_bytes: dict[str, int]

    def decoded(self) -> dict[str, Any]:
        """The averaged tensors, decoded."""
        return decode_tensors(self.averaged)


def reduce_group(contributions: Sequence[Contribution], *, codec: Codec) -> GroupResult:
    """Average the group's contributions part by part; deterministic in the members' order.

    Members are ordered by peer id, so every member computes the same part ownership and the same
    reduction whatever order the contributions arrived in. Raises ValueError on an empty group,
    mismatched tensor names, or invalid weights.
    """
    if not contributions:
        raise ValueError("cannot reduce an empty group")
    members = sorted(contributions, key=lambda c: c.peer_id)
    keys = list(members[0].payloads)
    for c in members[1:]:
        if list(c.payloads) != keys:
            raise ValueError(f"peer {c.peer_id} sent tensors {sorted(c.payloads)} instead of {sorted(keys)}")
    sizes = [max(len(c.payloads[k]) for c in members) for k in keys]
    owner_index = assign_parts(sizes, len(members))
    weights = [c.weight for c in members]
    tokens = [c.tokens for c in members]
    total = math.fsum(tokens) if all(t > 0 for t in tokens) else None
    averaged = {
        k: reduce_part([c.payloads[k] for c in members], weights, codec, k, total_weight=total) for k in keys
    }
    up_sizes = [[len(c.payloads[k]) for k in keys] for c in members]
    down_sizes = [len(averaged[k]) for k in keys]
    sent, received = round_traffic(owner_index, up_sizes, down_sizes, len(members))
    ids = [c.peer_id for c in members]
    return GroupResult(
        averaged=averaged,
        gathered=tuple(c.metadata for c in members),
        members=tuple(ids),
        owners={k: ids[i] for k, i in zip(keys, owner_index, strict=True)},
        sent_bytes=dict(zip(ids, sent, strict=True)),
        received_bytes=dict(zip(ids, received, strict=True)),
    )
