"""The state server over real p2pd: what a joiner or laggard downloads, and what it refuses.

Two DHT peers on loopback (NAT mapping off), each with its `StateServer` as a node builds it; the
holder serves a real `Peer`'s snapshot and kept updates (`swarm.sync.snapshot_of` / `updates_of`),
the fetching side checks what it gets the way the node does (`training.catchup.catch_up` against
the θ hash the swarm published, never the one the sender states).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from adloco.node.swarm.sync import RemoteSource, snapshot_of, updates_of
from adloco.node.training.catchup import catch_up
from adloco.node.training.config import TrainConfig
from adloco.node.training.corpus import Corpus
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import reduce_group
from adloco.protocol.transport.dht import DHT, NetworkConfig, start_dht, visible_maddrs
from adloco.protocol.transport.state_transfer import StateServer, StateSnapshot, UpdateRecord

pytestmark = pytest.mark.timeout(180)

CFG = TrainConfig(seq_len=32, batch_size=4, instances=1, inner_steps=2, b_max=4, max_corpus_mb=1)
NET = NetworkConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), nat_port_map=False, use_relay=False)
PREFIX = "adloco.test-state.0"


@dataclass
class Served:
    """What the holder's server answers with; a test swaps in its own snapshot."""

    snapshot: Callable[[], StateSnapshot]
    updates: Callable[[int], list[UpdateRecord]]


@dataclass
class Pair:
    holder: Peer  # applied two rounds: non-zero momentum, two kept updates
    holder_id: str
    served: Served
    client: StateServer  # the fetching node's server (it serves nothing in these tests)


@functools.cache
def _corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(peer_id: str) -> Peer:
    """Every peer is built from the same seed: they all start from the same θ_0."""
    return Peer(peer_id=peer_id, index=0, num_peers=1, cfg=CFG, corpus=_corpus(), vocab_size=256)


def _train_alone(peer: Peer, rounds: int) -> None:
    for _ in range(rounds):
        contribution, _ = peer.contribute(peer.train_round())
        assert contribution is not None
        peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    holder = _peer("holder")
    _train_alone(holder, 2)
    lock = threading.Lock()
    served = Served(lambda: snapshot_of(holder, lock), lambda r: updates_of(holder, lock, r))
    dhts: list[DHT] = []
    servers: list[StateServer] = []
    try:
        dhts.append(start_dht(NET))
        dhts.append(start_dht(replace(NET, peers=tuple(visible_maddrs(dhts[0])))))
        servers.append(
            StateServer(
                dhts[0],
                prefix=PREFIX,
                snapshot=lambda: served.snapshot(),
                updates=lambda r: served.updates(r),
            )
        )
        servers.append(StateServer(dhts[1], prefix=PREFIX, snapshot=_nothing, updates=lambda _: []))
        yield Pair(holder, dhts[0].peer_id.to_base58(), served, servers[1])
    finally:
        for server in servers:
            server.shutdown()
        for dht in dhts:
            dht.shutdown()


def _nothing() -> StateSnapshot:
    raise RuntimeError("the fetching node serves nothing here")


def test_a_download_holds_exactly_the_holders_state(pair: Pair) -> None:
    state = pair.holder.state
    snap = pair.client.fetch_state(pair.holder_id, timeout=30)
    assert snap.round == state.round == 2
    assert snap.schedule == state.schedule.to_dict()
    assert snap.theta_hash == state.theta_hash()
    assert set(snap.theta) == set(snap.momentum) == set(pair.holder.names)
    for name, theta, momentum in zip(pair.holder.names, state.theta, state.momentum, strict=True):
        assert torch.equal(snap.theta[name], theta) and torch.equal(snap.momentum[name], momentum)
    assert any(float(m.abs().max()) > 0 for m in state.momentum)  # the momentum is not trivially zero

    joiner = _peer("joiner")
    source = RemoteSource(pair.client, pair.holder_id, joiner.names)
    done = catch_up(joiner, source, expected_hash=state.theta_hash(), replay=False)
    assert (done.how, done.rounds) == ("download", 2)
    assert joiner.state.theta_hash() == state.theta_hash() and joiner.state.round == 2
    assert all(torch.equal(a, b) for a, b in zip(joiner.state.momentum, state.momentum, strict=True))


def test_kept_updates_replay_to_the_holders_state(pair: Pair) -> None:
    kept = pair.holder.state.history
    records = pair.client.fetch_updates(pair.holder_id, from_round=1, timeout=30)
    assert [r.round for r in records] == [u.round for u in kept if u.round >= 1] == [1]
    assert records[0].averaged == dict(kept[1].averaged)
    assert records[0].schedule == kept[1].schedule.to_dict() and records[0].merge == kept[1].merge

    laggard = _peer("laggard")
    source = RemoteSource(pair.client, pair.holder_id, laggard.names)
    done = catch_up(laggard, source, expected_hash=pair.holder.state.theta_hash())
    assert (done.how, done.rounds) == ("replay", 2)
    assert laggard.state.theta_hash() == pair.holder.state.theta_hash()


def test_a_download_that_does_not_match_the_published_hash_is_refused(pair: Pair) -> None:
    published = pair.holder.state.theta_hash()
    honest = pair.served.snapshot

    def tampered() -> StateSnapshot:
        snap = honest()
        theta = dict(snap.theta)
        first = next(iter(theta))
        theta[first] = theta[first] + 1e-3  # other bytes, same claimed hash
        return replace(snap, theta=theta)

    pair.served.snapshot = tampered
    try:
        joiner = _peer("joiner")
        before = (joiner.state.round, joiner.state.theta_hash())
        source = RemoteSource(pair.client, pair.holder_id, joiner.names)
        assert pair.client.fetch_state(pair.holder_id, timeout=30).theta_hash == published  # the claim
        with pytest.raises(ValueError, match="published"):
            catch_up(joiner, source, expected_hash=published, replay=False)
        assert (joiner.state.round, joiner.state.theta_hash()) == before  # nothing adopted
    finally:
        pair.served.snapshot = honest
