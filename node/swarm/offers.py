"""What a node offers joiners: the state of the round it last published, frozen while someone
downloads it.

After each applied round the node builds the manifest of its θ and m (`build_manifest`, hashed chunk
by chunk from the live tensors, no serialized copy), publishes the manifest's hash in its signed
state record and offers that round. A chunk is read from the live tensors, under the node's lock,
only when a joiner asks for it. θ and m change in place at the next outer step; just before they do
(`Peer.before_change`, under the lock) a round that someone asked for within the last `hold_s`
seconds is frozen (θ and m written once, a chunk at a time, to an unnamed file: `SpillFile`; copied
in memory where the disk cannot hold them) and stays offered until nobody has asked for it for
`hold_s`; a round nobody asked for is withdrawn. A joiner's probe of the live round
(`published`: does this node stand by its record?) counts as an ask for `PROBE_HOLD_S`: the joiner
asks for the manifest next, and a round that changed in between would refuse it (with rounds of a
few seconds, a restarted node was refused every time and never caught up). So a node keeps an extra
copy of the state, on disk, only while a download crosses one of its rounds, or a probe its change
(at most `max_frozen` copies), and a joiner slower than a round still completes the round it began with,
then replays the rounds since.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...protocol.transport.manifest import StateManifest, TensorBytes, TensorSpec, build_manifest
from ...protocol.transport.state_transfer import ServedState
from ..data.spill import SpillFile
from ..training.peer import Peer

logger = logging.getLogger(__name__)

HOLD_S = 120.0  # a frozen round stays offered until nobody has asked for it for this long
PUBLISHED_KEPT = 4  # the published rounds a node still stands by when asked (`published`)
PROBE_HOLD_S = 10.0  # a probed live round stays offered this long after the probe, if it changes


def state_layout(peer: Peer) -> list[TensorSpec]:
    """The tensors of this model's replicated state as a manifest lists them: θ, then m."""
    return [TensorSpec.of(f"theta.{n}", t) for n, t in zip(peer.names, peer.state.theta, strict=True)] + [
        TensorSpec.of(f"momentum.{n}", t) for n, t in zip(peer.names, peer.state.momentum, strict=True)
    ]


@dataclass
class _Offer:
    manifest: StateManifest
    encoded: bytes
    digest: str
    tensors: list[torch.Tensor]  # the live θ and m while not frozen (frozen: a copy, if not on disk)
    frozen: bool
    file: SpillFile | None = None  # frozen on disk: the manifest's byte string
    asked: float | None = None  # monotonic time of the last request, None: never asked
    probed: float | None = None  # monotonic time of the last probe while live (`published`)


class StateOffers:
    """The rounds this node serves (see the module docstring). `offered` is the state server's
    lookup; `publish` and `before_change` run on the thread that changes the peer."""

    def __init__(
        self,
        peer: Peer,
        lock: threading.Lock,
        *,
        chunk_bytes: int,
        hold_s: float = HOLD_S,
        max_frozen: int = 1,
        directory: str | None = None,
    ) -> None:
        self.peer, self.lock = peer, lock
        # Where a frozen round waits (`SpillFile`): the checkpoint folder, else the temporary one.
        self.directory = directory
        self.chunk_bytes, self.hold_s, self.max_frozen = chunk_bytes, hold_s, max_frozen
        self._offers: dict[str, _Offer] = {}
        # The manifests of the last few rounds published, for `published` (a joiner weighing peers).
        self._published: deque[str] = deque(maxlen=PUBLISHED_KEPT)
        self._mutex = threading.Lock()  # guards _offers; taken after `lock`, never before it
        peer.before_change = self.before_change

    def publish(self) -> ServedState:
        """Offer the peer's current round; returns it (its digest and size go in the state record)."""
        state = self.peer.state
        tensors = [*state.theta, *state.momentum]
        names = [f"theta.{n}" for n in self.peer.names] + [f"momentum.{n}" for n in self.peer.names]
        manifest = build_manifest(
            list(zip(names, tensors, strict=True)),
            round=state.round,
            theta_hash=self.peer.theta_hash(),
            schedule=state.schedule.to_dict(),
            chunk_bytes=self.chunk_bytes,
            # θ and m mapped from files: each tensor's pages go back once hashed
            hashed=lambda i: self.peer.release_state(i % len(self.peer.names)),
        )
        encoded = manifest.encode()
        offer = _Offer(manifest, encoded, manifest.digest(), tensors, frozen=False)
        with self._mutex:
            self._offers = {d: o for d, o in self._offers.items() if o.frozen and self._active(o)}
            self._offers[offer.digest] = offer
            self._published.append(offer.digest)
        return self._served(offer)

    def published(self, digest: str) -> bool:
        """Whether `digest` is the manifest of one of the last rounds this node published (a record
        of it may still be what others read): what a fresh joiner asks to know this node is live and
        stands by its record. Nothing is read; the live round, probed, is kept offered for
        `PROBE_HOLD_S` should it change before the joiner asks for it (`before_change`)."""
        with self._mutex:
            offer = self._offers.get(digest)
            if offer is not None and not offer.frozen:
                offer.probed = time.monotonic()
            return digest in self._published

    def offered(self, digest: str) -> ServedState | None:
        """The state offered under `digest`, if any (called on the state server's threads)."""
        with self._mutex:
            offer = self._offers.get(digest)
            if offer is None:
                return None
            offer.asked = time.monotonic()
        return self._served(offer)

    def before_change(self) -> None:
        """θ and m are about to change in place (called under `lock`): freeze or withdraw what is live.
        Of the rounds still wanted, `max_frozen` are kept (`_rank`): downloads going on first (asked
        within `PROBE_HOLD_S`; a copy being read before the live round), then the rounds wanted last.
        A round a joiner abandoned for a newer one kept its copy for `hold_s` before, and every newer
        round was withdrawn under the joiner's feet: it was refused chunk after chunk for minutes."""
        with self._mutex:
            now = time.monotonic()
            active = [o for o in self._offers.values() if self._active(o)]
            wanted = sorted(active, key=lambda o: _rank(o, now), reverse=True)[: self.max_frozen]
            for offer in wanted:
                if not offer.frozen:
                    self._freeze(offer)
            self._offers = {o.digest: o for o in wanted}

    def _freeze(self, offer: _Offer) -> None:
        """Keep `offer`'s bytes as they are now: on disk, a chunk at a time, so a donor serving a
        joiner holds no second θ and m (8 B/param); a copy in memory where the disk cannot hold them."""
        data = TensorBytes(offer.tensors)
        try:
            file = SpillFile(self.directory)
            for start in range(0, data.total, self.chunk_bytes):
                file.append(data.read(start, min(start + self.chunk_bytes, data.total)))
                self.peer.release_state()  # θ and m mapped from files: their pages read go back
        except OSError as e:
            logger.warning("a round frozen for a download is copied in memory: no disk room for it: %s", e)
            if _same(offer.tensors, [*self.peer.state.theta, *self.peer.state.momentum]):
                offer.tensors = [t.detach().to("cpu", copy=True) for t in offer.tensors]
            # (an adopted state left the old tensors unchanged: they are the copy)
        else:
            offer.file, offer.tensors = file, []
        offer.frozen = True

    def frozen_rounds(self, *, in_memory: bool = False) -> list[int]:
        """The rounds held as frozen copies now (for tests and status); `in_memory`: those copied in
        memory, not on disk."""
        with self._mutex:
            return sorted(
                o.manifest.round
                for o in self._offers.values()
                if o.frozen and (o.file is None or not in_memory)
            )

    def _active(self, offer: _Offer) -> bool:
        now = time.monotonic()
        asked = offer.asked is not None and now - offer.asked < self.hold_s
        return asked or (offer.probed is not None and now - offer.probed < PROBE_HOLD_S)

    def _served(self, offer: _Offer) -> ServedState:
        return ServedState(offer.manifest, offer.encoded, lambda index: self._read(offer, index))

    def _read(self, offer: _Offer, index: int) -> bytes:
        """Chunk `index` of `offer`: from the frozen copy, or from the live tensors under the lock."""
        start, end = offer.manifest.span(index)
        if offer.file is not None:
            return offer.file.read(start, end - start)
        if offer.frozen:
            return TensorBytes(offer.tensors).read(start, end)
        with self.lock:  # the live tensors do not change while it is held
            with self._mutex:
                if self._offers.get(offer.digest) is not offer:
                    raise ValueError("that state is not offered here any more")
                tensors = offer.tensors
            chunk = TensorBytes(tensors).read(start, end)
            # θ and m mapped from files: the pages read go back, or a joiner's download of the live
            # round would leave all of them held (8 B/param) until this node's next inner step.
            self.peer.release_state()
            return chunk


def _rank(offer: _Offer, now: float) -> tuple[bool, bool, float]:
    """Which offers keep a copy when θ changes, highest first: one being downloaded (asked within
    `PROBE_HOLD_S`), of those a copy already read from; then the one asked for or probed last."""
    downloading = offer.asked is not None and now - offer.asked < PROBE_HOLD_S
    last = max(t for t in (offer.asked, offer.probed, -math.inf) if t is not None)
    return downloading, downloading and offer.frozen, last


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
