"""The semantics of our all-reduce, independent of any transport.

A group of members each contributes encoded pseudo-gradient tensors, a weight (tokens × staleness
weight) and its encoded `PeerReport` (report.py). Each tensor ("part") is owned by one member
(`parts.assign_parts`): the owner decodes every member's copy of it, takes the weighted average,
encodes that average once, and sends the *same bytes* to every member, itself included. Every
member therefore decodes identical bytes and applies an identical outer update, whatever the codec,
which is what keeps θ identical across the group (hivemind's averager, which adds a compressed
delta to each member's own exact values, does not have this property for lossy codecs).

`reduce_group` is that computation done in one place; the in-memory transport calls it directly,
and the network transport's owners run the same `parts.reduce_parts` on the parts they own. The
gathered reports come back parsed by `report.parse_reports`, so every member keeps the same ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .codecs import Codec, decode_tensors
from .parts import DEFAULT_OUTLIER_FACTOR, MEAN, Aggregate, deal_parts, reduce_parts, round_traffic
from .report import PeerReport, parse_reports
from .trust import accepted_work

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    """One member's input to a round: encoded tensors, averaging weight, its encoded report.

    weight is tokens × staleness weight ρ(τ); tokens is the unweighted count. When every member
    gives its tokens, the group average is Σ weight·Δ / Σ tokens, so ρ(τ) < 1 shrinks a late
    contribution even in a group of one (Async DiLoCo applies ρ to each arrival the same way).
    `metadata` is `PeerReport.encode()`: bytes to the transport, parsed by whoever gathers them.
    """

    peer_id: str
    payloads: Mapping[str, bytes]
    weight: float
    tokens: float = 0.0
    metadata: bytes = b""


@dataclass(frozen=True)
class GroupResult:
    """What every member of the group receives (identical for all) and the traffic it cost each.

    `reports`: the members' reports that parsed (member order); `malformed`: member -> why its
    report was dropped (it still contributed its Δ). `rejected`: peer id -> number of its parts the
    owners left out of the average this round (non-finite or outlier, see `parts.screen_part`);
    empty when none. A peer with rejected parts stays in `members`: rejection is per part. `work`:
    member -> the weight it committed to, 0 where all its parts were left out (`trust`); empty
    where a transport does not know the weights.
    """

    averaged: dict[str, bytes]
    reports: tuple[PeerReport, ...]
    members: tuple[str, ...]
    owners: dict[str, str]
    sent_bytes: dict[str, int]
    received_bytes: dict[str, int]
    # Keyword-only: a positional field with a default would forbid MemberResult's fields without one.
    rejected: dict[str, int] = field(default_factory=dict, kw_only=True)
    malformed: dict[str, str] = field(default_factory=dict, kw_only=True)
    work: dict[str, float] = field(default_factory=dict, kw_only=True)

    def decoded(self) -> dict[str, Any]:
        """The averaged tensors, decoded."""
        return decode_tensors(self.averaged)


def gather_reports(
    members: Sequence[str], raw: Sequence[bytes]
) -> tuple[tuple[PeerReport, ...], dict[str, str]]:
    """`report.parse_reports`, with each dropped entry logged: what every transport calls on the
    gathered metadata."""
    reports, malformed = parse_reports(members, raw)
    for peer, reason in malformed.items():
        logger.warning("dropped the report of %s: %s", peer[-8:], reason)
    return reports, malformed


def reduce_group(
    contributions: Sequence[Contribution],
    *,
    codec: Codec,
    outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
    aggregate: Aggregate = MEAN,
    work_cap: float | None = None,
    owners: Sequence[str] | None = None,
) -> GroupResult:
    """Average the group's contributions part by part; deterministic in the members' order.

    Members are ordered by peer id, so every member computes the same reduction whatever order the
    contributions arrived in; parts are dealt (`parts.assign_parts`) to `owners` in that order
    (default: every member, by peer id; the network's groups deal them to the members their work
    lists make eligible, `trust`). Each part is screened by its owner
    (`parts.reduce_parts`; `outlier_factor` 0 or None turns the norm test off, never the non-finite
    one; norms are compared per claimed token, each claim capped at `work_cap`, the round's reference
    work); every rejection is logged and counted in `GroupResult.rejected`. Raises ValueError on an
    empty group, mismatched tensor names, or invalid weights.
    """
    if not contributions:
        raise ValueError("cannot reduce an empty group")
    members = sorted(contributions, key=lambda c: c.peer_id)
    keys = list(members[0].payloads)
    for c in members[1:]:
        if list(c.payloads) != keys:
            raise ValueError(f"peer {c.peer_id} sent tensors {sorted(c.payloads)} instead of {sorted(keys)}")
    sizes = [max(len(c.payloads[k]) for c in members) for k in keys]
    ids = [c.peer_id for c in members]
    owner_index = deal_parts(sizes, ids, ids if owners is None else owners)
    owned = {k: ids[i] for k, i in zip(keys, owner_index, strict=True)}
    reduced = reduce_parts(
        keys,
        ids,
        lambda i, k: members[i].payloads[k],
        [c.weight for c in members],
        [c.tokens for c in members],
        codec,
        outlier_factor=outlier_factor,
        aggregate=aggregate,
        work_cap=work_cap,
    )
    for k, peer, reason in reduced.rejections:
        logger.warning("owner %s rejected part %r of %s: %s", owned[k][-8:], k, peer[-8:], reason)
    up_sizes = [[len(c.payloads[k]) for k in keys] for c in members]
    down_sizes = [len(reduced.averaged[k]) for k in keys]
    sent, received = round_traffic(owner_index, up_sizes, down_sizes, len(members))
    reports, malformed = gather_reports(ids, [c.metadata for c in members])
    return GroupResult(
        averaged=reduced.averaged,
        reports=reports,
        members=tuple(ids),
        owners=owned,
        sent_bytes=dict(zip(ids, sent, strict=True)),
        received_bytes=dict(zip(ids, received, strict=True)),
        rejected=reduced.rejected,
        malformed=malformed,
        work=accepted_work({c.peer_id: c.weight for c in members}, reduced.rejected, len(keys)),
    )
