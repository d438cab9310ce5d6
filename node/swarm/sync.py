"""Staying in step with the swarm: publish where this node is, find where the swarm is, catch up.

After every applied round a node publishes a signed state record (round, θ hash, schedule) and a
beacon (progress, for the bootstrap's metrics). Before contributing it reads everyone's records: the
head of the swarm is the latest round any peer published and the majority θ hash of the other peers
at it. A node behind the head catches up from a peer holding it, with the simulator's own code
(`training.catchup`: replay the averaged updates it keeps, else download its state), checked against
that published hash. A node at the head with another θ than a strict majority of the others (it
averaged a round apart from them) downloads the majority's state: the fork heals toward it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ...protocol.algorithms.schedule import Schedule
from ...protocol.transport.records import BeaconRecord, RunRecords, StateRecord, dht_time
from ...protocol.transport.state_transfer import StateServer, StateSnapshot, UpdateRecord
from ..operations.metrics import NodeMetrics
from ..training.catchup import catch_up
from ..training.peer import Peer
from ..training.replica import PeerState, Update
from .ops import NodeOps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmHead:
    """The latest round any peer published, the other peers' majority θ hash at it, the others that
    hold that hash, and how many others hold each hash there."""

    round: int
    theta_hash: str
    holders: list[str]
    hashes: Counter[str]


@dataclass(frozen=True)
class RemoteSource:
    """A peer holding the swarm's state, as a catch-up source over the network. `names`: our
    model's parameter names, the order θ and m are in."""

    server: StateServer
    holder: str
    names: Sequence[str]

    def updates(self, from_round: int) -> Sequence[Update]:
        records = self.server.fetch_updates(self.holder, from_round=from_round)
        return [Update(r.round, r.averaged, Schedule.from_dict(r.schedule), r.merge) for r in records]

    def state(self) -> PeerState:
        snap = self.server.fetch_state(self.holder)
        return PeerState(
            theta=[snap.theta[n] for n in self.names],
            momentum=[snap.momentum[n] for n in self.names],
            round=snap.round,
            schedule=Schedule.from_dict(snap.schedule),
        )


def snapshot_of(peer: Peer, lock: threading.Lock) -> StateSnapshot:
    """What this node serves a joiner (called on the state server's thread: copies, under the lock)."""
    with lock:
        state = peer.state
        return StateSnapshot(
            round=state.round,
            schedule=state.schedule.to_dict(),
            theta={n: t.detach().cpu().clone() for n, t in zip(peer.names, state.theta, strict=True)},
            momentum={n: t.detach().cpu().clone() for n, t in zip(peer.names, state.momentum, strict=True)},
            theta_hash=state.theta_hash(),
        )


def updates_of(peer: Peer, lock: threading.Lock, from_round: int) -> list[UpdateRecord]:
    """The averaged updates this node keeps from `from_round` on (for a laggard to replay)."""
    with lock:
        return [
            UpdateRecord(u.round, dict(u.averaged), u.schedule.to_dict(), u.merge)
            for u in peer.state.history
            if u.round >= from_round
        ]


class SwarmSync:
    """One node's publishing, reading and catching up (see the module docstring)."""

    def __init__(
        self,
        *,
        peer: Peer,
        lock: threading.Lock,
        records: RunRecords,
        server: StateServer,
        ops: NodeOps,
        metrics: NodeMetrics,
    ) -> None:
        self.peer, self.lock, self.records, self.server = peer, lock, records, server
        self.ops, self.metrics = ops, metrics

    def publish(self) -> None:
        """Announce (round, θ hash, schedule), signed, so joiners and laggards know where the swarm is."""
        state = self.peer.state
        record = StateRecord(
            peer_id=self.peer.peer_id,
            round=state.round,
            theta_hash=state.theta_hash(),
            schedule=json.dumps(state.schedule.to_dict(), sort_keys=True),
        )
        self.records.publish_state(record)
        counters = self.ops.counters
        beacon = BeaconRecord(
            round=state.round,
            tokens=counters.tokens_total,
            tokens_per_s=float(counters.tokens_per_s),
            updated=dht_time(),
        )
        self.records.publish_beacon(beacon)

    def head(self) -> SwarmHead | None:
        """Where the swarm is, from the state records (None: no records yet)."""
        records = self.records.states()
        self.ops.peers_visible = len({r.peer_id for r in records})
        self.metrics.peers.set(self.ops.peers_visible)
        if not records:
            return None
        me = self.peer.peer_id
        top = max(r.round for r in records)
        hashes = Counter(r.theta_hash for r in records if r.round == top and r.peer_id != me)
        if not hashes:
            return SwarmHead(top, "", [], hashes)
        best = hashes.most_common(1)[0][0]
        holders = sorted({r.peer_id for r in records if r.round == top and r.theta_hash == best} - {me})
        return SwarmHead(top, best, holders, hashes)

    def sync(self) -> int:
        """Reach the swarm's published round (or heal a fork at it); returns the rounds advanced."""
        head = self.head()
        if head is None or not head.holders:
            return 0
        behind = head.round - self.peer.state.round
        if behind <= 0:
            mine = self.peer.state.theta_hash()
            if behind < 0 or head.theta_hash == mine or head.hashes[head.theta_hash] <= head.hashes[mine] + 1:
                return 0
            logger.warning(
                "[%s round=%d] θ differs from %d peers' at the same round: taking theirs",
                *self._tag(),
                len(head.holders),
            )
            self._catch_up(head, replay=False, event="fork_healed")
            return 0
        return (
            head.round - self.peer.state.round if self._catch_up(head, replay=True, event="catch_up") else 0
        )

    def _catch_up(self, head: SwarmHead, *, replay: bool, event: str) -> bool:
        """Catch up from the first holder that serves a state matching the published hash."""
        start = self.peer.state.round
        for holder in head.holders:
            try:
                done = catch_up(
                    self.peer,
                    RemoteSource(self.server, holder, self.peer.names),
                    expected_hash=head.theta_hash,
                    replay=replay,
                    lock=self.lock,
                )
            except Exception as e:  # a holder that left or answered badly: try the next one
                logger.warning("[%s round=%d] catch-up from %s failed: %s", *self._tag(), holder[-6:], e)
                continue
            (self.metrics.replays if done.how == "replay" else self.metrics.downloads).inc()
            if done.how == "download":
                self.ops.status.write("state_download", round=self.peer.state.round, source=holder)
            self.ops.status.write(
                event, round=self.peer.state.round, behind=head.round - start, source=holder, how=done.how
            )
            return True
        return False

    def _tag(self) -> tuple[str, int]:
        return self.peer.peer_id[-6:], self.peer.state.round
