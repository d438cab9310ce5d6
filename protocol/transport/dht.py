"""Starting a hivemind DHT peer with our defaults, and turning its failures into clear messages.

Shared by the node and the bootstrap peer. hivemind's P2P daemon (p2pd) is a child process of the
DHT process; `hivemind.DHT.shutdown()` stops it. A peer killed with SIGKILL leaves p2pd behind
(hivemind sets no parent-death signal), so launchers start peers in their own session and reap the
whole process group (`adloco.node.cli.processes`, tests/procs.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.utils.multiaddr import Multiaddr

from .identity import NodeDHT
from .procfs import live_processes

DHT = NodeDHT  # the handle the layers above hold, without importing hivemind themselves

DHT_RPC_TIMEOUT_S = 3.0  # hivemind's DHTNode wait_timeout (its default, which the node keeps)
DHT_STALL_S = 2 * DHT_RPC_TIMEOUT_S
"""The longest one DHT call of ours waits on an unresponsive peer (frozen, or gone with its
connection still open): a store waits out one RPC timeout in the search for the replicas and one in
the store itself (6.0 s measured, four DHT peers, one frozen); a read, one. Every peer pays it at a
moment of its own until hivemind drops that peer from its routing table."""


@dataclass(frozen=True)
class NetworkConfig:
    """hivemind-style networking options (same names as hivemind's CLIs, with dashes).

    peers: multiaddrs of peers to join (`/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...`); none starts a new swarm.
    host_maddrs: where to listen; announce_maddrs: what to tell others when behind NAT/port forwarding.
    identity_path: an RSA private key file (hivemind's format, created if missing); the same file gives
    the same peer id across restarts, and the node signs its DHT records with it.
    client_mode: do not accept incoming connections (peers behind NAT that cannot open a port).
    use_relay / use_auto_relay: libp2p circuit relays (reach, or be reached through, relays).
    nat_port_map: ask the router for a port mapping (UPnP/NAT-PMP); off in tests.
    """

    peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    nat_port_map: bool = True
    extra: dict[str, object] = field(default_factory=dict)


def parse_maddrs(values: Sequence[str], *, option: str) -> tuple[str, ...]:
    """Validate multiaddrs; raises ValueError naming the option on the first malformed one."""
    parsed = []
    for value in values:
        try:
            Multiaddr(value)
        except Exception as e:  # multiaddr raises several exception types for bad input
            raise ValueError(f"{option}: malformed multiaddr {value!r} ({e})") from None
        parsed.append(value)
    return tuple(parsed)


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer ids named by the /p2p/ parts of `maddrs` (those without one name none)."""
    ids = []
    for value in maddrs:
        try:
            ids.append(Multiaddr(value).value_for_protocol("p2p"))
        except Exception:  # no /p2p/ part (or a malformed multiaddr: parse_maddrs reports that)
            continue
    return ids


def check_ports_free(host_maddrs: Sequence[str], *, option: str = "--host-maddrs") -> None:
    """Fail early with a clear message when a fixed TCP port in host_maddrs is already taken."""
    for value in host_maddrs:
        addr = Multiaddr(value)
        protocols = {p.name for p in addr.protocols()}
        if "tcp" not in protocols:
            continue
        port = int(addr.value_for_protocol("tcp"))
        if port == 0:
            continue
        family = socket.AF_INET6 if "ip6" in protocols else socket.AF_INET
        host = (
            addr.value_for_protocol("ip6" if "ip6" in protocols else "ip4")
            if protocols & {"ip4", "ip6"}
            else ""
        )
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise ValueError(f"{option}: cannot listen on {value}: {e.strerror}") from None


def start_dht(net: NetworkConfig) -> NodeDHT:
    """Start (and join) a DHT peer with an identity this process holds (`identity.NodeDHT`);
    configuration errors become ValueError with the option named."""
    check_ports_free(net.host_maddrs)
    key_dir = None if net.identity_path is None else os.path.dirname(os.path.abspath(net.identity_path))
    if key_dir is not None and not os.path.isdir(key_dir):
        raise ValueError(f"--identity-path: the folder of {net.identity_path} does not exist")
    try:
        return NodeDHT(
            initial_peers=list(net.peers),
            host_maddrs=list(net.host_maddrs),
            announce_maddrs=list(net.announce_maddrs) or None,
            identity_path=net.identity_path,
            client_mode=net.client_mode,
            use_relay=net.use_relay,
            use_auto_relay=net.use_auto_relay,
            nat_port_map=net.nat_port_map,
            start=True,
            **net.extra,
        )
    except ValueError as e:
        if net.identity_path is not None and net.identity_path in str(e):
            raise ValueError(f"--identity-path: {e}") from None
        raise ValueError(f"networking: could not start the DHT peer: {e}") from None
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if net.peers and (
            "bootstrap" in text.lower() or "initial" in text.lower() or "connect" in text.lower()
        ):
            raise ValueError(f"--peers: could not join the swarm through {list(net.peers)}: {text}") from None
        raise ValueError(f"networking: could not start the DHT peer: {text}") from None


def network_failure(dht: NodeDHT) -> str | None:
    """Why this peer's network is gone, None while it is up: the DHT process died, or its p2pd did
    (SIGTERM to the whole process group reaches both; an OOM kill may take either). p2pd is found
    as a child of the DHT process in /proc; where there is no /proc only the DHT process is seen."""
    if not dht.is_alive():
        return f"the DHT process (pid {dht.pid}) exited"
    if not Path("/proc").is_dir():
        return None
    if any(p.name == "p2pd" and p.parent == dht.pid for p in live_processes()):
        return None
    return f"p2pd, the libp2p daemon of the DHT process (pid {dht.pid}), is gone"


def visible_maddrs(dht: NodeDHT) -> list[str]:
    """The multiaddrs other peers can pass as --peers (with the /p2p/<peer id> suffix)."""
    return [str(m) for m in dht.get_visible_maddrs()]
