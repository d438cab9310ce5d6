"""Run records in the DHT: signed by their writer and schema-checked, with real DHT peers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import hivemind
import pytest
from hivemind.utils import get_dht_time

from adloco.protocol.transport.records import (
    StateRecord,
    add_run_validators,
    parse_states,
    run_prefix,
    state_key,
)

pytestmark = pytest.mark.timeout(120)
KW = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "start": True}


@pytest.fixture
def dhts() -> Iterator[list[hivemind.DHT]]:
    first = hivemind.DHT(**KW)
    peers = [first, *(hivemind.DHT(initial_peers=first.get_visible_maddrs(), **KW) for _ in range(2))]
    try:
        yield peers
    finally:
        for dht in peers:
            dht.shutdown()


def _record(round: int) -> StateRecord:
    return StateRecord(
        peer_id="12D3KooW",
        round=round,
        theta_hash="ab" * 32,
        schedule=json.dumps({"round": round}),
        manifest_hash="cd" * 32,
        manifest_bytes=1234,
    )


def test_only_the_writer_can_write_its_entry_and_malformed_entries_never_arrive(
    dhts: list[hivemind.DHT],
) -> None:
    writer, reader, attacker = dhts
    prefix = run_prefix("r", "fingerprint")
    key = state_key(prefix)
    writer_key = add_run_validators(writer, prefix, "r")
    add_run_validators(reader, prefix, "r")
    assert writer.store(key, _record(3).dict(), get_dht_time() + 60, subkey=writer_key)
    # The attacker runs no validators locally, but every validating peer refuses what it sends:
    # an entry under the writer's key without the writer's signature, and a malformed entry.
    assert not attacker.store(key, _record(99).dict(), get_dht_time() + 61, subkey=writer_key)
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
