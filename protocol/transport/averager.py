"""The averaging interface every driver of a round talks to, and what a member gets back.

A peer calls `Averager.average` once per round with its encoded `Contribution` and gets back the
group's result, a `MemberResult` (a `GroupResult` plus the bytes this member moved), or None when no
group could be formed or the round failed for it. Every member that returns a result holds
bit-identical `averaged` bytes and the same parsed `reports`: each part is reduced once by its owner
with `parts.reduce_parts` (`protocol/algorithms/allreduce.py` has the semantics), non-finite and
outlier parts screened out, the same `rejected` count per peer. Group rule, shared by every
implementation: the members are the peers that call `average` for the same (prefix, round) within
the matchmaking window (opened by the first call in process; over the DHT by the second
registration, `matchmaking.OPEN_QUORUM`, so that one registration dated in the past cannot close
it); a call after the window gets None at once and nobody waits beyond the window. A round
number is single-use: retry a failed round under a new number. (`HivemindAverager` lets a peer take
up again a round it averaged alone or found no group in: a node cut off from the others that went
on alone, then took their state, meets them at that round's number. A registration no other
followed in time closed a round of its own and is in no later group, `matchmaking`.)
None never proves that the others did not apply the round (they may have, with or without this
member's Δ): a peer that gets None must re-check its θ against the group's (catch-up) before it
trusts it. Implementations: `memory.MemoryAverager` (threads of one process: the solo trainer, the
simulator, tests) and `hivemind_averager.HivemindAverager` (peers on hivemind's P2P); one contract
test covers both (tests/test_averager_contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..algorithms.allreduce import Contribution, GroupResult
from ..algorithms.claims import ClaimBounds
from ..algorithms.codecs import Codec


@dataclass(frozen=True)
class Traffic:
    """Bytes one member moved in one round: tensor payloads alone, and everything on the wire.

    `wire_*` counts every byte this member wrote to or read from its streams (payloads, headers,
    metadata, length prefixes); `payload_*` only the encoded tensor bytes. Their difference is the
    protocol's own overhead. The transport beneath the streams (libp2p framing, encryption, TCP) is
    not counted. `exchange_s`: seconds from the group's formation to the last answer (the transfer
    and the reductions, without matchmaking; 0 in process): the bytes over it bound this member's
    link from below. `largest_frame_body`: the most bytes this member read off a stream in one frame,
    what a stream's reader held at once (0 in process). `checks_*`: of the wire bytes, the signed
    statements and the frames of the answers' checks (`verification`; 0 in process): they grow with
    the parts and members, not with the payload.
    """

    payload_sent: int
    payload_received: int
    wire_sent: int
    wire_received: int
    exchange_s: float = 0.0
    largest_frame_body: int = 0
    checks_sent: int = 0
    checks_received: int = 0

    @property
    def overhead(self) -> int:
        """Framing bytes: everything sent and received that is not a tensor payload."""
        return self.wire_sent + self.wire_received - self.payload_sent - self.payload_received


@dataclass(frozen=True)
class MemberResult(GroupResult):
    """A `GroupResult` as one member received it.

    `averaged`, `reports`, `malformed`, `members`, `owners` and `rejected` are identical on every
    member of the group; `sent_bytes[peer_id]` / `received_bytes[peer_id]` are exactly the wire
    bytes this member moved (other entries, where present, are the in-process model's count),
    `traffic` splits them.
    """

    peer_id: str
    traffic: Traffic


class NotOpened(Exception):
    """A join-only call found no round opened by another peer within its wait. It never registered,
    so no group holds this peer: unlike a failed try, nothing of it can still be running elsewhere."""


@dataclass(frozen=True)
class Misconduct:
    """What this peer's owners caught: rule breaks since start, and members banned right now."""

    violations: int = 0
    banned: int = 0


@runtime_checkable
class Policing(Protocol):
    """An averager whose owners ban members that break the protocol (the network one)."""

    def misconduct(self) -> Misconduct: ...


@runtime_checkable
class FailureAware(Protocol):
    """An averager whose members say when their try failed (the network one): a caller waiting
    for a failed try to be over everywhere before the next opens can stop waiting once it is."""

    def failed_everywhere(self, round: int) -> bool: ...


@runtime_checkable
class RoundReader(Protocol):
    """An averager that can say who registered for a round and the group they make (the network
    one): a peer that averaged a round alone asks whether the others formed one without it."""

    def round_view(self, round: int) -> tuple[frozenset[str], tuple[str, ...]] | None: ...


@runtime_checkable
class Averager(Protocol):
    """One peer's handle on the swarm's averaging; `average` blocks the calling (trainer) thread."""

    @property
    def peer_id(self) -> str:
        """The id this peer is known by in groups; contributions must carry it."""
        ...

    def average(
        self,
        contribution: Contribution,
        *,
        round: int,
        codec: Codec,
        timeout: float,
        join_only: bool = False,
        join_wait_s: float | None = None,
        bounds: ClaimBounds | None = None,
        patience_s: float = 0.0,
    ) -> MemberResult | None:
        """Average `contribution` with the peers ready for `round`; None if no group / failed.

        `codec` encodes the averages of the parts this peer owns (its downlink codec). Returns
        within `timeout` seconds. `join_only`: never open the round, only join one another peer
        opened (late contributions: a late peer alone would otherwise apply its stale Δ as a whole
        round, and a group disjoint from the fresh peers' could complete the same round); if no
        other peer has opened it within `join_wait_s` (None: within `timeout`), raises `NotOpened`
        without having registered. `bounds`: what another member's contribution may claim
        (`claims.ClaimBounds`, from the round's schedule); a member claiming more, or a weight or
        token count that is not finite and >= 0 (checked with or without bounds), is left out of
        the round and the others complete it. `patience_s`: a round this call opens stays open at
        least that long for the others (a driver passes its local round's length: peers whose
        rounds drift apart still meet); 0 keeps the averager's own window.
        """
        ...

    @property
    def matchmaking_s(self) -> float:
        """The least time a call spends forming its group (window, plus grace where there is one):
        a driver estimating how long an exchange takes never estimates less."""
        ...

    def shutdown(self) -> None:
        """Stop serving; later calls to `average` raise RuntimeError."""
        ...
