"""Can other peers reach this node? The start-up report, in the way Petals tells its servers.

A node that others cannot dial still joins and still trains, but in our all-reduce every member
connects to the owners of the parts it sends, so an unreachable owner makes every round it owns a
part of fail for the others. The check is on the addresses the node will announce: only loopback or
private (RFC 1918, CGNAT, link-local) addresses mean that peers on the internet cannot dial it. What
the operator can do then, in order of preference: forward the port and announce the public address,
let the router map it (UPnP/NAT-PMP, on unless --no-nat-port-map), or use a relay.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reachability:
    """public: announced addresses peers on the internet can dial; local: the others."""

    public: tuple[str, ...]
    local: tuple[str, ...]
    client_mode: bool

    @property
    def reachable(self) -> bool:
        return bool(self.public) and not self.client_mode

    def message(self, *, port_map: bool, relay: bool) -> str:
        if self.client_mode:
            return (
                "reachability: client mode: this node dials out only; others cannot connect to it. It"
                " trains, but must not own parts of an all-reduce; use it only behind NAT you cannot open."
            )
        if self.public:
            return "reachability: peers can dial this node at " + " ".join(self.public)
        port = _port(self.local)
        hints = [
            f"forward TCP port {port} on your router to this machine and pass"
            f" --announce-maddrs /ip4/<your public IP>/tcp/{port}",
        ]
        if not port_map:
            hints.append("or drop --no-nat-port-map so the router may map the port itself (UPnP/NAT-PMP)")
        if relay:
            hints.append("or --use-auto-relay to be reachable through a relay peer (slower)")
        only = " ".join(self.local) if self.local else "nothing"
        return (
            f"reachability: this node announces only local addresses ({only}): peers outside this"
            " network cannot dial it. Fine for a swarm on one LAN; to train with the internet, "
            + "; ".join(hints)
            + "."
        )


def check(maddrs: Sequence[str], *, client_mode: bool = False) -> Reachability:
    """Split announced multiaddrs into publicly dialable ones and local ones."""
    public: list[str] = []
    local: list[str] = []
    for maddr in maddrs:
        (public if _is_public(maddr) else local).append(maddr)
    return Reachability(tuple(public), tuple(local), client_mode)


def _is_public(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return parts[1:2] == ["dns4"] or parts[1:2] == ["dns6"] or parts[1:2] == ["dns"]
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    shared = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT
    documentation = ip.version == 4 and ip in ipaddress.ip_network("192.0.2.0/24")
    return ip.is_global and not documentation and not (ip.version == 4 and ip in shared)


def _port(maddrs: Sequence[str]) -> str:
    for maddr in maddrs:
        parts = maddr.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            return parts[parts.index("tcp") + 1]
    return "<port>"
