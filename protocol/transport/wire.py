"""The framing our P2P stream protocols share (averaging, state transfer), and byte accounting.

    frame = u32 big-endian header length | header (MSGPack map with "v" and "n") | body

"n" lists the lengths of the body's parts. `Meter` counts every byte written to or read from a
stream (wire) and the body bytes alone (payload); their difference is the protocol's overhead.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.utils.serializer import MSGPackSerializer

from .averager import Traffic

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 << 20
MAX_BODY_BYTES = 4 << 30
_LEN = struct.Struct(">I")


@dataclass
class Meter:
    """Bytes moved on this peer's streams for one round."""

    payload_sent: int = 0
    payload_received: int = 0
    wire_sent: int = 0
    wire_received: int = 0

    def add(self, other: Meter) -> None:
        self.payload_sent += other.payload_sent
        self.payload_received += other.payload_received
        self.wire_sent += other.wire_sent
        self.wire_received += other.wire_received

    def traffic(self, exchange_s: float = 0.0) -> Traffic:
        return Traffic(
            self.payload_sent, self.payload_received, self.wire_sent, self.wire_received, exchange_s
        )


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], body: Sequence[bytes], meter: Meter
) -> None:
    raw = MSGPackSerializer.dumps({**header, "n": [len(b) for b in body]})
    writer.write(_LEN.pack(len(raw)) + raw)
    for chunk in body:
        writer.write(chunk)
    await writer.drain()
    payload = sum(len(b) for b in body)
    meter.wire_sent += _LEN.size + len(raw) + payload
    meter.payload_sent += payload


async def read_frame(
    reader: asyncio.StreamReader,
    meter: Meter,
    *,
    max_header: int = MAX_HEADER_BYTES,
    max_body: int = MAX_BODY_BYTES,
) -> tuple[dict[str, Any], list[bytes]]:
    """One frame; ValueError, before reading them, on a header over `max_header` bytes or a body
    over `max_body` (a reader that knows what it expects passes its own bounds)."""
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > max_header:
        raise ValueError(f"frame header of {size} bytes exceeds {max_header}")
    header = MSGPackSerializer.loads(await reader.readexactly(size))
    meter.wire_received += _LEN.size + size
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise ValueError(f"not a version {PROTOCOL_VERSION} frame")
    lengths = header.get("n")
    if not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths):
        raise ValueError("frame without valid part lengths")
    if sum(lengths) > max_body:
        raise ValueError(f"frame body of {sum(lengths)} bytes exceeds {max_body}")
    body = [await reader.readexactly(n) for n in lengths]
    meter.wire_received += sum(lengths)
    meter.payload_received += sum(lengths)
    return header, body


async def daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Any:
    """Runs inside the DHT process: where its p2pd listens for clients."""
    return node.p2p.daemon_listen_maddr
