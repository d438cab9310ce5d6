"""Run records in the DHT: signed by their writer's libp2p key, bound to its peer id and
schema-checked, with real DHT peers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from adloco.protocol.algorithms.trust import MAX_WORKERS
from adloco.protocol.transport.identity import NodeDHT, load_identity, peer_of_subkey
from adloco.protocol.transport.matchmaking import (
    MAX_EXCLUDED,
    MAX_PATIENCE_S,
    Registrations,
    expectation,
    parse_registrations,
)
from adloco.protocol.transport.records import (
    StateRecord,
    add_run_validators,
    parse_states,
    run_prefix,
    state_key,
)

pytestmark = pytest.mark.timeout(120)
KW: dict[str, Any] = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "start": True}


@pytest.fixture
def dhts() -> Iterator[list[NodeDHT]]:
    first = NodeDHT(**KW)
    peers = [first, *(NodeDHT(initial_peers=first.get_visible_maddrs(), **KW) for _ in range(2))]
    try:
        yield peers
    finally:
        for dht in peers:
            dht.shutdown()


def _record(round: int, peer_id: str = "12D3KooW") -> StateRecord:
    return StateRecord(
        peer_id=peer_id,
        round=round,
        theta_hash="ab" * 32,
        schedule=json.dumps({"round": round}),
        manifest_hash="cd" * 32,
        manifest_bytes=1234,
    )


def test_only_the_writer_can_write_its_entry_and_malformed_entries_never_arrive(
    dhts: list[NodeDHT],
) -> None:
    writer, reader, attacker = dhts
    prefix = run_prefix("r", "fingerprint")
    key = state_key(prefix)
    writer_key = add_run_validators(writer, prefix, "r")
    add_run_validators(reader, prefix, "r")
    me = writer.peer_id.to_base58()
    assert writer.store(key, _record(3, me).dict(), get_dht_time() + 60, subkey=writer_key)
    # The attacker runs no validators locally, but every validating peer refuses what it sends:
    # an entry under the writer's key without the writer's signature, and a malformed entry.
    assert not attacker.store(key, _record(99, me).dict(), get_dht_time() + 61, subkey=writer_key)
    assert not attacker.store(key, {"round": "x"}, get_dht_time() + 60, subkey=b"unsigned")
    found = reader.get(key, latest=True)
    records = parse_states(None if found is None else found.value)
    assert [(r.round, r.theta_hash) for r in records] == [(3, "ab" * 32)]


def test_strict_schema() -> None:
    good = _record(3).dict()
    StateRecord(**good)
    with pytest.raises(ValueError):
        StateRecord(**{**good, "round": "3"})  # no coercion
    with pytest.raises(ValueError):
        StateRecord(**{**good, "theta_hash": "xyz"})
    with pytest.raises(ValueError):
        StateRecord(**{**good, "manifest_hash": "xyz"})
    with pytest.raises(ValueError):  # a manifest is bounded before anyone reads it
        StateRecord(**{**good, "manifest_bytes": 2**40})
    with pytest.raises(ValueError):
        StateRecord(**{k: v for k, v in good.items() if k != "manifest_hash"})
    assert run_prefix("a", "f") != run_prefix("b", "f") != run_prefix("a", "g")


def test_the_signing_key_is_the_libp2p_identity(tmp_path: Path) -> None:
    """The subkey a node signs with derives the peer id p2pd runs under; the same file gives the
    same id after a restart; a key file of another kind is refused with its path named."""
    path = tmp_path / "id.key"
    first = NodeDHT(identity_path=str(path), **KW)
    try:
        peer = first.peer_id.to_base58()
        assert first.identity.peer_id == peer == peer_of_subkey(first.identity.subkey)
    finally:
        first.shutdown()
    assert load_identity(str(path)).peer_id == peer
    assert peer_of_subkey(b"[owner:ssh-ed25519 AAAA]") is None
    assert peer_of_subkey(b"12D3KooW") is None
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    with pytest.raises(ValueError, match=r"junk\.key"):
        load_identity(str(junk))


def test_a_record_in_another_peers_name_is_dropped_where_it_is_read(dhts: list[NodeDHT]) -> None:
    """A peer signs with its own key (the DHT accepts that) a state record and a readiness record
    naming an honest peer: readers drop both, so no one speaks for a peer whose key it lacks (the
    round hijack in another's name, the phantom member)."""
    honest, reader, attacker = dhts
    prefix = run_prefix("r", "fingerprint")
    key = state_key(prefix)
    for dht in dhts:
        add_run_validators(dht, prefix, "r")
    victim, mine = honest.peer_id.to_base58(), attacker.peer_id.to_base58()
    now = get_dht_time()
    assert attacker.store(key, _record(7, victim).dict(), now + 60, subkey=attacker.identity.subkey)
    assert honest.store(key, _record(3, victim).dict(), now + 60, subkey=honest.identity.subkey)
    found = reader.get(key, latest=True)
    assert found is not None and len(found.value) == 2  # both stored, validly signed
    assert [(r.peer_id, r.round) for r in parse_states(found.value)] == [(victim, 3)]

    ready = f"{prefix}.round5"
    assert attacker.store(
        ready, (now - 30.0, victim, "", 0.0, [], []), now + 60, subkey=attacker.identity.subkey
    )
    assert attacker.store(ready, (now - 29.0, "QmPhantom", "", 0.0, [], []), now + 60, subkey=b"QmPhantom")
    assert honest.store(ready, (now, victim, "", 0.0, [], []), now + 60, subkey=honest.identity.subkey)
    found = reader.get(ready, latest=True)
    assert found is not None and len(found.value) == 3
    assert parse_registrations(found.value) == Registrations(
        {victim: now}, {victim: ""}, {victim: 0.0}, {victim: ()}, {victim: ()}
    )
    # In its own name the attacker registers as any peer does (its one entry, replaced).
    expect = expectation([victim, mine])
    record: tuple[object, ...] = (now + 1.0, mine, expect, 5.0, [victim], [victim])  # malformed ones below
    assert attacker.store(ready, record, now + 61, subkey=attacker.identity.subkey)
    found = reader.get(ready, latest=True)
    assert found is not None
    assert parse_registrations(found.value) == Registrations(
        {victim: now, mine: now + 1.0},
        {victim: "", mine: expect},
        {victim: 0.0, mine: 5.0},
        {victim: (), mine: (victim,)},
        {victim: (), mine: (victim,)},
    )
    # A patience beyond the cap (or not a number) would hold every round open: the entry is ignored.
    for i, patience in enumerate((MAX_PATIENCE_S + 1, -1.0, float("nan"), "5", True)):
        record = (now + 1.0, mine, expect, patience, [], [])
        assert attacker.store(ready, record, now + 62 + i, subkey=attacker.identity.subkey)
        found = reader.get(ready, latest=True)
        assert found is not None and mine not in parse_registrations(found.value).times
    # So would exclusions beyond the cap (or not peer ids): one record may not empty a round.
    too_many = [f"Qm{i:044d}" for i in range(MAX_EXCLUDED + 1)]
    for i, excluded in enumerate((too_many, "Qm", [5], ["x" * 65])):
        record = (now + 1.0, mine, expect, 5.0, excluded, [])
        assert attacker.store(ready, record, now + 70 + i, subkey=attacker.identity.subkey)
        found = reader.get(ready, latest=True)
        assert found is not None and mine not in parse_registrations(found.value).times
    # And work lists beyond theirs (or not peer ids): one record may not make a crowd of owners.
    too_many = [f"Qm{i:044d}" for i in range(MAX_WORKERS + 1)]
    for i, listed in enumerate((too_many, "Qm", [5], ["x" * 65])):
        record = (now + 1.0, mine, expect, 5.0, [], listed)
        assert attacker.store(ready, record, now + 80 + i, subkey=attacker.identity.subkey)
        found = reader.get(ready, latest=True)
        assert found is not None and mine not in parse_registrations(found.value).times


def test_a_peer_dials_from_a_port_of_its_own_so_two_crossing_dials_stay_two_connections() -> None:
    """A node's p2pd dials out from a fresh port, not from the one it listens on. go-libp2p's default
    dials from the listening port: two peers that dial each other at the same moment then meet as
    one TCP connection on which both act as the dialer, and both dials fail the handshake (11 of 160
    fresh pairs of nodes crossing here) and back the address off for 6 s. Peers
    of a group open their streams to each other at once: such a crossing lost the round (record
    073). Seen from the peer dialed, the dialer's end of the connection is not its listening port."""
    dialer, dialed = NodeDHT(**KW), NodeDHT(**KW)

    async def ends() -> tuple[Multiaddr, list[Multiaddr]]:
        listening = Multiaddr(str(dialer.get_visible_maddrs()[0]).split("/p2p/")[0])
        target = Multiaddr(str(dialed.get_visible_maddrs()[0]).split("/p2p/")[0])
        await (await dialer.replicate_p2p())._client.connect(dialed.peer_id, [target])
        seen = await (await dialed.replicate_p2p())._client.list_peers()
        return listening, [a for info in seen if info.peer_id == dialer.peer_id for a in info.addrs]

    try:
        listening, seen = asyncio.run(ends())
        assert len(seen) == 1 and seen[0] != listening
        assert str(seen[0]).split("/tcp/")[0] == str(listening).split("/tcp/")[0]  # the same host
    finally:
        dialer.shutdown()
        dialed.shutdown()
