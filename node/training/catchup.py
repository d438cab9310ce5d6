"""Catching up with the swarm: replay the averaged updates a peer missed, else download the state.

A peer that missed rounds reaches the swarm's round before it contributes, so a late Δ is corrected
against the current momentum (HeLoCo) and its θ matches everyone's. The simulator and the swarm run
this same function; only the `StateSource` differs: in the simulator the most advanced virtual peer,
in the swarm a peer that holds the swarm's published state, reached over the network. What the
result is checked against, `expected_hash`, is always the θ hash the caller trusts (the swarm's
published majority), never one the source states about itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from .peer import Peer
from .replica import PeerState, Update


class StateSource(Protocol):
    """Where a lagging peer takes the rounds it missed from."""

    def updates(self, from_round: int) -> Sequence[Update]:
        """The averaged updates the source keeps from `from_round` on, in order (possibly none)."""
        ...

    def state(self) -> PeerState:
        """The source's replicated state (θ, m, round, schedule), to adopt whole."""
        ...


@dataclass(frozen=True)
class CatchUp:
    """How a peer reached the source's round: `rounds` advanced, `bytes` moved to get there."""

    how: Literal["replay", "download"]
    rounds: int
    bytes: int


def catch_up(
    peer: Peer,
    source: StateSource,
    *,
    expected_hash: str,
    replay: bool = True,
    lock: AbstractContextManager[object] | None = None,
    to_round: int | None = None,
    on_refused: Callable[[], None] | None = None,
) -> CatchUp:
    """Bring `peer` to the source's state: replay the kept updates if they start at the peer's round
    and end at `expected_hash` (worked out before any is applied: `Peer.replayed_hash`), otherwise
    (or with `replay` False: a fork) download the full state.

    `to_round`: the round `expected_hash` is θ's at. A holder that moved on since the caller read
    it keeps updates past that round; only those before it are replayed (what lies beyond is
    nothing the caller can check), rather than found not to end at the hash and downloaded.

    `on_refused` is called when the source's updates start at the peer's round and do not lead to
    `expected_hash` (a holder serving poisoned ones): the caller may ask another next time.

    Fetching runs outside `lock`, changing the peer inside it (the swarm's state server reads the
    peer from another thread). Raises ValueError when the downloaded θ does not match
    `expected_hash` (the peer is then unchanged by the download), and whatever the source raises.
    """
    guard = lock if lock is not None else contextlib.nullcontext()
    start = peer.state.round
    if replay:
        end = to_round if to_round is not None else float("inf")
        updates = [u for u in source.updates(start) if start <= u.round < end]
        if updates and updates[0].round == start:
            # Checked before it is committed: updates that do not lead to `expected_hash` (a holder
            # serving poisoned ones, say) are worked out on copies, one tensor at a time, and never
            # applied; the peer then downloads the state instead.
            with guard:
                try:
                    matches = peer.replayed_hash(updates) == expected_hash
                except ValueError:
                    matches = False
                if matches:
                    peer.catch_up(updates)
            if not matches and on_refused is not None:
                on_refused()
            if matches:
                moved = sum(len(p) for u in updates for p in u.averaged.values())
                return CatchUp("replay", peer.state.round - start, moved)
    state = source.state()
    with guard:
        peer.adopt_state(state, expected_hash=expected_hash)
    moved = sum(t.numel() * t.element_size() for t in (*state.theta, *state.momentum))
    return CatchUp("download", peer.state.round - start, moved)
