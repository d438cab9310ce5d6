"""Serving and fetching the run's state over hivemind's P2P: chunked state downloads for joiners and
far-behind peers, and the recent updates a peer a few rounds behind replays.

A peer answers three requests on a stream handler namespaced by the run prefix, one request frame
per stream (`wire.py`'s frames):
- "manifest" m: the manifest (`manifest.py`) whose sha256 is m, if this peer still offers that state;
- "chunk" m i: chunk i of that state, one frame of exactly the chunk's size;
- "updates" from r: the averaged updates it keeps from round r on: a header frame listing them with
  their payload sizes, then the payloads in frames of at most a chunk.

A joiner learns a manifest's hash and size from the signed state records, fetches the manifest from
any donor and checks it (hash, then layout against its own model) before reading a single chunk;
then `download` fetches the missing chunks from several donors at once, verifying each against the
manifest before keeping it (`ChunkedState`). A donor that serves a bad chunk is dropped at once; one
that fails or stalls past its timeout `MAX_DONOR_FAILURES` times in a row (a busy donor's stream can
break mid-chunk) is dropped too; each failed chunk goes back to the queue for the others. The
chunks verified so far stay, so a download that ran out of donors resumes later with the same
`ChunkedState`.

Every read is bounded before it happens (request frames, manifest, chunk, update payloads), and
every request has a timeout derived from its bytes (`TransferSettings.timeout`). A server limits
each peer: at most `per_peer` requests in flight at once, one of them "updates" (the others are
refused at once, before any work), and at most `serve_concurrency` chunk requests and a quarter as
many update streams for all peers together. The updates the
receiver replays are checked by the θ hash they lead to (`node/training/catchup.py`).

Over 500 lines, one idea: `StateServer`, one peer's side of state transfer, serving (manifests,
chunks, kept updates) and downloading from several donors; both share its stream handler, offers and
per-peer limits; the manifest's format is manifest.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P, PeerID

from .admission import NOT_ADMITTED, Admission
from .manifest import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES, ChunkedState, StateManifest
from .wire import PROTOCOL_VERSION, Meter, bytes_timeout, daemon_listen_maddr, read_frame, write_frame

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

STATE_PROTOCOL = 2  # v1 sent the whole state in one frame
REQUEST_BYTES = 1 << 10  # a request frame's header; requests have no body
ANSWER_HEADER_BYTES = 1 << 10  # a manifest, chunk or payload piece answer's header
UPDATES_HEADER_BYTES = 1 << 20  # the list of kept updates: schedules and tensor names


@dataclass(frozen=True)
class TransferSettings:
    """How state moves between peers (the node's `--state-*` flags).

    chunk_bytes: the size of a chunk of a state download and of a piece of an updates answer
        (`--state-chunk-mb`, 4 MiB). It is part of the manifest, so peers of a run should keep the
        same value: a joiner downloads from the largest group of donors that published the same
        manifest. Smaller loses less per failed chunk; larger needs fewer round trips.
    bandwidth_bps: bytes/s this node expects to download at in all (`--state-bandwidth-mbps`,
        10 Mbit/s). Until a donor's first chunk measured its rate, a request is given this rate
        shared by all requests in flight; lower it if downloads time out on a slow link.
    slack: a request may take `slack` times as long as its bytes need at the expected rate.
    timeout_floor_s: no request times out sooner (`--state-timeout-floor-s`): stream setup, latency
        and a donor busy with other joiners. The only fixed timeout of the protocol.
    donors: donors a download uses at once (`--state-donors`, 4); further holders are spares that
        replace a dropped donor.
    inflight: requests in flight per donor: hides the round trip between two chunks.
    serve_concurrency: chunk requests a donor serves at once: its memory for serving is at most
        this many chunks; a quarter as many update streams (at least one) at once.
    per_peer: requests one peer may have in flight at a server at once (at most one of them
        "updates"); more are refused at once. At least `inflight`, or a downloader's own requests
        would be refused.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    bandwidth_bps: float = 10e6 / 8
    slack: float = 4.0
    timeout_floor_s: float = 10.0
    donors: int = 4
    inflight: int = 2
    serve_concurrency: int = 8
    per_peer: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"state chunk size must be in (0, {MAX_CHUNK_BYTES}] bytes")
        if not self.bandwidth_bps > 0 or not self.slack >= 1 or not self.timeout_floor_s > 0:
            raise ValueError("state bandwidth and timeout floor must be > 0 and slack >= 1")
        if min(self.donors, self.inflight, self.serve_concurrency) < 1:
            raise ValueError("state donors, inflight and serve_concurrency must be >= 1")
        if self.per_peer < self.inflight:
            raise ValueError("per_peer must be at least inflight")

    def timeout(self, nbytes: int, rate_bps: float) -> float:
        """Seconds a request moving `nbytes` may take at an expected `rate_bps`."""
        return bytes_timeout(nbytes, rate_bps, slack=self.slack, floor_s=self.timeout_floor_s)


MAX_DONOR_FAILURES = 3
BUSY = "too many requests from this peer at once"
"""Requests to one donor that may break or time out in a row before it is dropped from a download (a
bad chunk drops it at once)."""


@dataclass(frozen=True)
class ServedState:
    """A state a donor offers: its manifest, the manifest's encoding, and how to read chunk i
    (called on a worker thread; it must return the bytes the manifest hashed)."""

    manifest: StateManifest
    encoded: bytes
    read_chunk: Callable[[int], bytes]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encoded).hexdigest()


@dataclass(frozen=True)
class UpdateRecord:
    """One applied round as a lagging peer replays it."""

    round: int
    averaged: Mapping[str, bytes]  # served: may read each payload from disk when asked (`size` first)
    schedule: dict[str, Any]
    merge: tuple[int, int] | None


@dataclass
class DownloadReport:
    """What one `download` call did: chunks kept and refused per donor, donors dropped and why."""

    kept: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # requests that broke or timed out
    dropped: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0


class IncompleteDownload(RuntimeError):
    """Every donor failed before the state was complete; the verified chunks stay in the state."""

    def __init__(self, state: ChunkedState, report: DownloadReport) -> None:
        why = "; ".join(f"{d[-6:]}: {r}" for d, r in report.dropped.items()) or "no donors"
        super().__init__(f"{len(state.missing())} of {len(state.manifest.chunks)} chunks missing ({why})")
        self.report = report


class StateServer:
    """Serves this peer's offered states and kept updates, and fetches them from other peers.

    `offered(digest)` returns the state this peer serves under a manifest digest, or None; `updates`
    the kept updates from a round on. Both are called on worker threads; what they return must not
    change afterwards (the node freezes a state it offers before changing it).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        offered: Callable[[str], ServedState | None],
        updates: Callable[[int], list[UpdateRecord]],
        settings: TransferSettings | None = None,
        admission: Admission | None = None,
        published: Callable[[str], bool] = lambda digest: False,
    ) -> None:
        self._admission = admission or Admission()
        self._offered = offered
        self._published = published
        self._updates = updates
        self.settings = settings or TransferSettings()
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:24]
        self._handler_name = f"adloco.state.v{STATE_PROTOCOL}.{digest}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="adloco-state", daemon=True)
        self._thread.start()
        self._closed = False
        self._serving = asyncio.Semaphore(self.settings.serve_concurrency)
        self._serving_updates = asyncio.Semaphore(max(1, self.settings.serve_concurrency // 4))
        # Requests in flight per peer, and the peers an "updates" stream is serving (`_serve`; touched
        # on the loop only).
        self._requests: Counter[str] = Counter()
        self._updating: set[str] = set()
        try:
            maddr = dht.run_coroutine(daemon_listen_maddr)
            self._p2p: P2P = self._call(P2P.replicate(maddr), timeout=30)
            self._call(self._p2p.add_binary_stream_handler(self._handler_name, self._serve), timeout=30)
        except BaseException:
            self._stop_loop()
            raise

    # ---- client: state ---------------------------------------------------------------------

    def fetch_manifest(self, donors: Sequence[str], *, digest: str, size: int) -> StateManifest:
        """The manifest `digest` (of `size` bytes, as the signed records say) from the first donor
        that serves it; ValueError if none does."""
        if not 0 < size <= MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest size {size} outside (0, {MAX_MANIFEST_BYTES}]")
        timeout = self.settings.timeout(size, self.settings.bandwidth_bps)
        errors = []
        for donor in donors:
            try:
                return self._call(self._manifest(donor, digest, size, timeout), timeout=timeout + 1)
            except Exception as e:  # try the next donor
                errors.append(f"{donor[-6:]}: {e}")
        raise ValueError(f"no donor served manifest {digest[:12]}: {'; '.join(errors) or 'no donors'}")

    def standing(self, claims: Sequence[tuple[str, str]]) -> set[str]:
        """Of (peer, manifest digest) claims, the peers that answer, over their own libp2p identity,
        that they published that state lately; all asked at once, a peer that does not answer in
        time is not. Nothing is frozen or read on their side (unlike a manifest request)."""
        if not claims:
            return set()
        timeout = self.settings.timeout_floor_s

        async def holds(peer: str, digest: str) -> bool:
            header, _ = await self._ask(peer, {"op": "holds", "m": digest}, max_body=0, timeout=timeout)
            return header.get("holds") is True

        async def probe() -> set[str]:
            answers = await asyncio.gather(*(holds(p, d) for p, d in claims), return_exceptions=True)
            return {p for (p, _), a in zip(claims, answers, strict=True) if a is True}

        return self._call(probe(), timeout=timeout + 1)

    async def _manifest(self, donor: str, digest: str, size: int, timeout: float) -> StateManifest:
        _, body = await self._ask(donor, {"op": "manifest", "m": digest}, max_body=size, timeout=timeout)
        if len(body) != 1 or len(body[0]) != size:
            raise ValueError("manifest of another size than published")
        return StateManifest.decode(body[0], digest=digest)

    def download(self, state: ChunkedState, donors: Sequence[str]) -> DownloadReport:
        """Fetch the chunks `state` misses from `donors` in parallel (in random order, so joiners
        spread over the swarm), verifying each; raises IncompleteDownload if donors run out."""
        s = self.settings
        missing = len(state.missing())
        # A safety net only: every request has its own timeout and each failure drops a donor.
        worst = s.timeout(state.manifest.chunk_bytes, s.bandwidth_bps / (s.donors * s.inflight))
        report = self._call(
            self._download(state, random.sample(list(donors), len(donors))),
            timeout=(missing + len(donors) + 1) * worst,
        )
        if not state.complete:
            raise IncompleteDownload(state, report)
        return report

    async def _download(self, state: ChunkedState, donors: list[str]) -> DownloadReport:
        s = self.settings
        report = DownloadReport()
        queue = deque(state.missing())
        spares = deque(donors)
        changed = asyncio.Event()
        in_flight = 0
        slots = min(s.donors, len(donors))
        first_rate = s.bandwidth_bps / max(1, slots * s.inflight)
        rates: dict[str, float] = {}
        streak: Counter[str] = Counter()  # each donor's failures since its last good chunk
        t0 = time.monotonic()

        async def fetch(donor: str, index: int) -> bytes:
            start, end = state.manifest.span(index)
            size = end - start
            # The measured rate tightens the timeout of a fast donor; never looser than the first.
            timeout = s.timeout(size, max(rates.get(donor, first_rate), first_rate))
            began = time.monotonic()
            request = {"op": "chunk", "m": state.digest, "i": index}
            header, body = await self._ask(donor, request, max_body=size, timeout=timeout)
            if header.get("i") != index or len(body) != 1 or len(body[0]) != size:
                raise ValueError(f"answered chunk {header.get('i')!r} with {sum(map(len, body))} bytes")
            rate = size / max(time.monotonic() - began, 1e-6)
            rates[donor] = rate if donor not in rates else (rates[donor] + rate) / 2
            return body[0]

        async def worker(donor: str) -> None:
            nonlocal in_flight
            while donor not in report.dropped and not state.complete:
                if not queue:
                    if in_flight == 0:
                        return
                    changed.clear()
                    await changed.wait()
                    continue
                index = queue.popleft()
                in_flight += 1
                why = failure = ""
                try:
                    data = await fetch(donor, index)
                    if await asyncio.to_thread(state.accept, index, data):
                        report.kept[donor] += 1
                        report.bytes += len(data)
                        streak[donor] = 0
                    else:
                        report.refused[donor] += 1
                        why = f"chunk {index} does not match the manifest"
                except Exception as e:
                    failure = f"chunk {index}: {e!r}"[:200]
                    report.failed[donor] += 1
                    streak[donor] += 1
                    if streak[donor] >= MAX_DONOR_FAILURES:
                        why = failure
                finally:
                    in_flight -= 1
                if why or failure:
                    queue.appendleft(index)
                if why:
                    report.dropped.setdefault(donor, why)
                    logger.info("state download: dropped donor %s (%s)", donor[-6:], why)
                elif failure:
                    logger.info("state download: donor %s failed (%s), keeps its slot", donor[-6:], failure)
                changed.set()

        async def slot() -> None:
            while spares and not state.complete:
                donor = spares.popleft()
                await asyncio.gather(*(worker(donor) for _ in range(s.inflight)))
                if donor not in report.dropped:
                    return

        await asyncio.gather(*(slot() for _ in range(slots)))
        report.seconds = time.monotonic() - t0
        return report

    # ---- client: updates -------------------------------------------------------------------

    def fetch_updates(self, peer_id: str, *, from_round: int, max_bytes: int) -> list[UpdateRecord]:
        """The updates `peer_id` keeps from `from_round` on, in order (possibly none); ValueError if
        their payloads would exceed `max_bytes` (checked before reading them)."""
        s = self.settings
        # Bounded by the slowest the answer may be: every piece has its own timeout inside.
        timeout = s.timeout(UPDATES_HEADER_BYTES + max_bytes, s.bandwidth_bps) + s.timeout_floor_s
        return self._call(self._fetch_updates(peer_id, from_round, max_bytes), timeout=timeout)

    async def _fetch_updates(self, peer_id: str, from_round: int, max_bytes: int) -> list[UpdateRecord]:
        s, meter = self.settings, Meter()
        reader, writer = await asyncio.wait_for(self._open(peer_id), s.timeout_floor_s)
        try:
            await write_frame(writer, {"v": PROTOCOL_VERSION, "op": "updates", "from": from_round}, [], meter)
            header, _ = await asyncio.wait_for(
                read_frame(reader, meter, max_header=UPDATES_HEADER_BYTES, max_body=0),
                s.timeout(UPDATES_HEADER_BYTES, s.bandwidth_bps),
            )
            if not header.get("ok"):
                raise ValueError(f"peer {peer_id} refused updates: {header.get('e')}")
            items = _update_items(header.get("updates"), max_bytes)
            records = []
            for round_, schedule, merge, parts in items:
                averaged = {}
                for key, size in parts:
                    averaged[key] = await self._read_pieces(reader, meter, size)
                records.append(UpdateRecord(round_, averaged, schedule, merge))
            return records
        finally:
            writer.close()

    async def _read_pieces(self, reader: asyncio.StreamReader, meter: Meter, size: int) -> bytes:
        """One payload of `size` bytes, sent in pieces of at most a chunk, each bounded and timed."""
        s = self.settings
        payload = bytearray(size)
        done = 0
        while done < size:
            bound = min(size - done, MAX_CHUNK_BYTES)
            _, body = await asyncio.wait_for(
                read_frame(reader, meter, max_header=ANSWER_HEADER_BYTES, max_body=bound),
                s.timeout(bound, s.bandwidth_bps),
            )
            if len(body) != 1 or not body[0]:
                raise ValueError("updates: a payload piece without bytes")
            payload[done : done + len(body[0])] = body[0]
            done += len(body[0])
        return bytes(payload)

    # ---- client: plumbing ------------------------------------------------------------------

    async def _open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer_id), self._handler_name
        )
        return reader, writer

    async def _ask(
        self, peer_id: str, request: dict[str, Any], *, max_body: int, timeout: float
    ) -> tuple[dict[str, Any], list[bytes]]:
        """One request, one answer frame of at most `max_body` bytes, within `timeout` seconds."""

        async def exchange() -> tuple[dict[str, Any], list[bytes]]:
            meter = Meter()
            reader, writer = await self._open(peer_id)
            try:
                await write_frame(writer, {"v": PROTOCOL_VERSION, **request}, [], meter)
                return await read_frame(reader, meter, max_header=ANSWER_HEADER_BYTES, max_body=max_body)
            finally:
                writer.close()

        header, body = await asyncio.wait_for(exchange(), timeout)
        if not header.get("ok"):
            raise ValueError(f"peer {peer_id[-6:]} refused {request['op']}: {header.get('e')}")
        return header, body

    # ---- server ------------------------------------------------------------------------------

    async def _serve(
        self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        s, meter = self.settings, Meter()
        peer = str(stream_info.peer_id.to_base58())
        # Decided as the stream arrives, in arrival order (no await between the test and the count):
        # counted after reading the request, a burst counted every stream before any was tested, and
        # all of them were refused, the first one too.
        admitted = self._requests[peer] < s.per_peer
        if admitted:
            self._requests[peer] += 1
        updating = False
        try:
            # The request is read even when it is refused (a few bounded bytes): a stream closed with
            # its request unread is reset, and the refusal with it.
            request, _ = await asyncio.wait_for(
                read_frame(reader, meter, max_header=REQUEST_BYTES, max_body=0), s.timeout_floor_s
            )
            if not admitted:
                raise ValueError(BUSY)
            if not await self._admission.select_async([peer]):
                raise ValueError(NOT_ADMITTED)  # nothing served, and nothing read past the request
            if request.get("op") == "updates":
                if peer in self._updating:
                    raise ValueError(BUSY)
                updating = True
                self._updating.add(peer)
                async with self._serving_updates:
                    await self._serve_updates(request, writer, meter)
                return
            async with self._serving:
                header, body = await asyncio.get_running_loop().run_in_executor(None, self._answer, request)
                size = sum(len(b) for b in body)
                await asyncio.wait_for(
                    write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True, **header}, body, meter),
                    s.timeout(size, s.bandwidth_bps),
                )
        except Exception as e:
            logger.debug("state request failed: %r", e)
            with contextlib.suppress(Exception):  # the requester may already be gone
                refusal = {"v": PROTOCOL_VERSION, "ok": False, "e": str(e)[:200]}
                await asyncio.wait_for(write_frame(writer, refusal, [], meter), s.timeout_floor_s)
        finally:
            writer.close()
            if admitted:
                self._requests[peer] -= 1
                if self._requests[peer] <= 0:
                    del self._requests[peer]  # the map holds the peers with requests in flight
            if updating:
                self._updating.discard(peer)

    def _answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        op, digest = request.get("op"), request.get("m")
        if op not in ("manifest", "chunk", "holds") or not isinstance(digest, str):
            raise ValueError(f"unknown request {op!r}")
        if op == "holds":
            return {"holds": bool(self._published(digest))}, []
        served = self._offered(digest)
        if served is None:
            raise ValueError("that state is not offered here (any more)")
        if op == "manifest":
            return {}, [served.encoded]
        index = request.get("i")
        if not isinstance(index, int) or not 0 <= index < len(served.manifest.chunks):
            raise ValueError(f"no chunk {index!r}")
        return {"i": index}, [served.read_chunk(index)]

    async def _serve_updates(
        self, request: dict[str, Any], writer: asyncio.StreamWriter, meter: Meter
    ) -> None:
        s = self.settings
        start = request.get("from")
        if not isinstance(start, int):
            raise ValueError("updates: 'from' must be a round number")
        records = await asyncio.get_running_loop().run_in_executor(None, self._updates, start)
        items = [
            {
                "round": r.round,
                "schedule": r.schedule,
                "merge": r.merge,
                "parts": [[key, _payload_size(r.averaged, key)] for key in r.averaged],
            }
            for r in records
        ]
        await asyncio.wait_for(
            write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True, "updates": items}, [], meter),
            s.timeout_floor_s,
        )
        loop = asyncio.get_running_loop()
        for r in records:
            for key in r.averaged:
                # One payload in memory at a time: a kept update on disk is read here, off the loop.
                payload = await loop.run_in_executor(None, r.averaged.__getitem__, key)
                for at in range(0, len(payload), s.chunk_bytes):
                    piece = payload[at : at + s.chunk_bytes]  # one chunk's copy at a time
                    await asyncio.wait_for(
                        write_frame(writer, {"v": PROTOCOL_VERSION}, [piece], meter),
                        s.timeout(len(piece), s.bandwidth_bps),
                    )

    # ---- plumbing ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], *, timeout: float) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout:.0f}s") from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._close(), timeout=10)
        except Exception as e:  # the DHT may already be gone
            logger.debug("state server shutdown: %r", e)
        finally:
            self._stop_loop()

    async def _close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(self._handler_name)
            await self._p2p.shutdown()  # a replica owns no p2pd: this closes its connections only
        finally:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


def _payload_size(payloads: Mapping[str, bytes], key: str) -> int:
    """A payload's size, without reading one that a kept update holds on disk (it knows its sizes)."""
    size = getattr(payloads, "size", None)
    return int(size(key)) if callable(size) else len(payloads[key])


def _update_items(
    value: Any, max_bytes: int
) -> list[tuple[int, dict[str, Any], tuple[int, int] | None, list[tuple[str, int]]]]:
    """The updates header's list, checked: types, and payload sizes within `max_bytes` in all."""
    if not isinstance(value, list):
        raise ValueError("updates: expected a list")
    items = []
    total = 0
    for item in value:
        if not isinstance(item, dict) or set(item) != {"round", "schedule", "merge", "parts"}:
            raise ValueError("updates: malformed entry")
        round_, schedule, merge, parts = item["round"], item["schedule"], item["merge"], item["parts"]
        if not isinstance(round_, int) or not isinstance(schedule, dict) or not isinstance(parts, list):
            raise ValueError("updates: malformed entry")
        if merge is not None and not (
            isinstance(merge, (list, tuple)) and len(merge) == 2 and all(isinstance(k, int) for k in merge)
        ):
            raise ValueError("updates: malformed merge")
        sizes = []
        for part in parts:
            if not (isinstance(part, (list, tuple)) and len(part) == 2 and isinstance(part[0], str)):
                raise ValueError("updates: malformed part")
            if not isinstance(part[1], int) or part[1] < 0:
                raise ValueError("updates: malformed part size")
            sizes.append((part[0], part[1]))
            total += part[1]
        if total > max_bytes:
            raise ValueError(f"updates of more than {max_bytes} bytes")
        items.append((round_, schedule, None if merge is None else (merge[0], merge[1]), sizes))
    return items
