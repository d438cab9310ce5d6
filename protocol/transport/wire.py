"""The framing our P2P stream protocols share (averaging, state transfer), and byte accounting.

    frame = u32 big-endian header length | header (MSGPack map with "v" and "n") | body

"n" lists the lengths of the body's parts. `Meter` counts every byte written to or read from a
stream (wire) and the body bytes alone (payload); their difference is the protocol's overhead. It
also keeps the largest frame body read, the memory a stream's reader needed at once.

Large payloads travel as a run of chunk frames (`write_chunks` / `read_chunks`): the receiver knows
each payload's size before the first byte and reads a chunk only if it fits in what is left of that
size and in `MAX_CHUNK_BYTES`, so its memory per stream is one chunk, whatever the payload size.
How long moving bytes may take is `bytes_timeout`: expected rate, slack, floor (shared by the state
download and the averaging exchange).
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

PROTOCOL_VERSION = 3
"""v1 sent an averaging request or answer as one frame of up to 4 GiB; v2 had no signed commitments
and answers (`statements`), nor the checks of them (`verification`)."""
MAX_HEADER_BYTES = 16 << 20
MAX_CHUNK_BYTES = 16 << 20
"""The largest chunk frame body any receiver reads: senders chunk at their own size up to this."""
DEFAULT_CHUNK_BYTES = 4 << 20
CHUNK_HEADER_BYTES = 64  # a chunk frame's header: {"v": ..., "n": [size]}
_LEN = struct.Struct(">I")


# What a swarm node's averaging exchange runs with unless told otherwise (adloco-node's
# --part-timeout-s and --reduce-timeout-s, `HivemindAverager`'s slack); the simulator's staller
# costs a try at these.
PART_FLOOR_S = 15.0
REDUCE_FLOOR_S = 10.0
EXCHANGE_SLACK = 4.0


LATE_FACTOR = 4.0
LATE_FLOOR_S = 2.0
"""Once more than half of the round's owners are in, a member waits for the others' answers no
longer than `late_answer_s` of the slowest answer in (`round_exchange`). An honest owner answers
within it: once more than half of the owners' parts are in, it waits for the rest twice as long as
they took (`owner`), so it reduces by three times that at most, and its larger share of the bytes
scales the wait. An owner that never answers costs a try of about the round's own length, not the
exchange budget, which is set for the slowest link the run admits."""


def late_answer_s(took_s: float, scale: float = 1.0) -> float:
    """Seconds from the group's forming a member waits for an owner's answer once most other owners'
    are in, the slowest after `took_s`; `scale`: the owner's bytes over that owner's (at least 1)."""
    return max(took_s + LATE_FLOOR_S, LATE_FACTOR * took_s * max(1.0, scale))


REVEAL_FLOOR_S = 1.0
"""A seeder's reveal is late (`verification`) once more than half of the seeders' reveals are in
and `late_reveal_s` of the slowest of them has passed since the group formed. An honest seeder
reveals as soon as it holds every answer and has checked their statements, which is when the
others do: it has no reduction of its own to wait for, as an owner's answer has. In clean runs of
robust_swarm (tiny-llama, 4 nodes on 2 cores) the reveals of a round came within 73 ms of one
another, the slowest at most 1.7 times the next one's time from the group's forming (record 077).
So the floor is half an owner's; the factor stays an owner's, for links that differ."""


def late_reveal_s(took_s: float) -> float:
    """Seconds from the group's forming a member waits for a seeder's reveal once most seeders' are
    in, the slowest after `took_s` (`REVEAL_FLOOR_S`)."""
    return max(took_s + REVEAL_FLOOR_S, LATE_FACTOR * took_s)


def bytes_timeout(nbytes: int, rate_bps: float, *, slack: float, floor_s: float) -> float:
    """Seconds moving `nbytes` may take at an expected `rate_bps`: `slack` times what the bytes
    need at that rate, never less than `floor_s` (stream setup, latency, a busy peer)."""
    return max(floor_s, slack * nbytes / rate_bps)


def exchange_budget_s(
    moved: int, rate_bps: float, *, slack: float, part_floor_s: float, reduce_floor_s: float
) -> float:
    """How long a member waits for every answer once its group formed: the parts' phase and the
    answers' phase, each `bytes_timeout` of the most bytes one member moves (`moved`)."""
    return bytes_timeout(moved, rate_bps, slack=slack, floor_s=part_floor_s) + bytes_timeout(
        moved, rate_bps, slack=slack, floor_s=reduce_floor_s
    )


@dataclass
class Meter:
    """Bytes moved on this peer's streams for one round."""

    payload_sent: int = 0
    payload_received: int = 0
    wire_sent: int = 0
    wire_received: int = 0
    largest_body: int = 0
    checks_sent: int = 0  # of the wire bytes, those of the answers' checks (`verification`)
    checks_received: int = 0

    def add(self, other: Meter) -> None:
        self.payload_sent += other.payload_sent
        self.payload_received += other.payload_received
        self.wire_sent += other.wire_sent
        self.wire_received += other.wire_received
        self.largest_body = max(self.largest_body, other.largest_body)
        self.checks_sent += other.checks_sent
        self.checks_received += other.checks_received

    def traffic(self, exchange_s: float = 0.0) -> Traffic:
        return Traffic(
            self.payload_sent,
            self.payload_received,
            self.wire_sent,
            self.wire_received,
            exchange_s,
            largest_frame_body=self.largest_body,
            checks_sent=self.checks_sent,
            checks_received=self.checks_received,
        )


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], body: Sequence[bytes | memoryview], meter: Meter
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
    max_body: int = MAX_CHUNK_BYTES,
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
    meter.largest_body = max(meter.largest_body, sum(lengths))
    return header, body


async def write_chunks(
    writer: asyncio.StreamWriter, payloads: Sequence[bytes], chunk_bytes: int, meter: Meter
) -> None:
    """Each payload as frames of at most `chunk_bytes` (an empty payload sends none), in order."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    header = {"v": PROTOCOL_VERSION}
    for payload in payloads:
        view = memoryview(payload)
        for at in range(0, len(view), chunk_bytes):
            await write_frame(writer, header, [view[at : at + chunk_bytes]], meter)


async def read_chunks(reader: asyncio.StreamReader, sizes: Sequence[int], meter: Meter) -> list[bytes]:
    """Payloads of the given sizes, sent by `write_chunks` (at any chunk size up to MAX_CHUNK_BYTES).

    ValueError before reading a chunk's bytes when the chunk is larger than what is left of its
    payload or than MAX_CHUNK_BYTES: a sender never gets more bytes in than the sizes agreed on.
    Each payload's buffer (of its agreed size) is allocated before its first chunk is read; the
    payload is returned as bytes (a copy of one payload at a time: decoders and hashes want bytes).
    """
    payloads: list[bytes] = []
    for size in sizes:
        buffer = bytearray(size) if size else bytearray()
        filled = 0
        while filled < size:
            _, body = await read_frame(
                reader,
                meter,
                max_header=CHUNK_HEADER_BYTES,
                max_body=min(size - filled, MAX_CHUNK_BYTES),
            )
            if len(body) != 1 or not body[0]:
                raise ValueError("a chunk frame must carry exactly one non-empty piece")
            buffer[filled : filled + len(body[0])] = body[0]
            filled += len(body[0])
        payloads.append(bytes(buffer))
        del buffer
    return payloads


async def daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Any:
    """Runs inside the DHT process: where its p2pd listens for clients."""
    return node.p2p.daemon_listen_maddr
