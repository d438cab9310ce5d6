"""The start-up reachability report: public addresses, local-only ones with the fixes, client mode."""

from __future__ import annotations

from adloco.node.operations.reachability import check

PEER = "/p2p/12D3KooWKRj8d4q31DeK5hKFN9GQaZVSLik8vph7qCMaYHZvTa8c"


def test_a_public_address_is_reachable() -> None:
    reach = check([f"/ip4/127.0.0.1/tcp/4001{PEER}", f"/ip4/203.0.114.7/tcp/4001{PEER}"])
    assert reach.reachable and reach.public == (f"/ip4/203.0.114.7/tcp/4001{PEER}",)
    assert "peers can dial this node at /ip4/203.0.114.7" in reach.message(port_map=True, relay=True)


def test_local_only_addresses_get_the_fixes() -> None:
    maddrs = [f"/ip4/{ip}/tcp/31338{PEER}" for ip in ("127.0.0.1", "192.168.1.5", "10.0.0.2", "100.64.3.1")]
    reach = check([*maddrs, f"/ip6/::1/tcp/31338{PEER}", f"/ip6/fe80::1/tcp/31338{PEER}"])
    assert not reach.reachable and not reach.public
    text = reach.message(port_map=False, relay=True)
    assert "forward TCP port 31338" in text and "--announce-maddrs /ip4/<your public IP>/tcp/31338" in text
    assert "drop --no-nat-port-map" in text and "--use-auto-relay" in text
    assert "drop --no-nat-port-map" not in reach.message(port_map=True, relay=False)


def test_client_mode_is_never_reachable() -> None:
    reach = check([f"/ip4/203.0.114.7/tcp/4001{PEER}"], client_mode=True)
    assert not reach.reachable and "client mode" in reach.message(port_map=True, relay=True)


def test_dns_addresses_count_as_public() -> None:
    assert check([f"/dns4/node.example.org/tcp/4001{PEER}"]).reachable
