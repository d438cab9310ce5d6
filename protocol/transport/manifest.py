"""The manifest of a state download: the tensors, the chunks they are cut into, each chunk's hash.

A state (θ and the outer momentum) is a list of named tensors. Seen as one byte string (each
tensor's raw bytes in order, little-endian as on every machine we run; never actually concatenated)
it is cut into chunks of `chunk_bytes`, the last one shorter. The manifest names the tensors (name,
dtype, shape), the round, θ's hash, the schedule, the chunk size and the sha256 of every chunk. Its
own sha256 (`StateManifest.digest`) is what each peer publishes in its signed state record, so a
joiner checks a manifest from any donor against the swarm's word, then every chunk against the
manifest before it keeps it. Honest peers at a round hold the same bytes and build the same
manifest, so one download takes chunks from all of them.

`TensorBytes` reads and writes byte ranges of a tensor list in place (a donor reads a chunk, a
joiner writes one), and `ChunkedState` is a download in progress: tensors allocated from the
manifest and the set of chunks verified so far, which is what makes a download resumable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

MANIFEST_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 16 << 20  # ~230k chunks: a 15 GB state in 64 KiB chunks, or 900 GB in 4 MiB
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
HASH_THREADS = 8
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state: its name, dtype (a key of `DTYPES`) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> TensorSpec:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot be transferred")
        return cls(name, dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class StateManifest:
    """What a state download holds and how it is cut: see the module docstring."""

    round: int
    theta_hash: str
    schedule: dict[str, Any]
    chunk_bytes: int
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def span(self, index: int) -> tuple[int, int]:
        """The byte range [start, end) of chunk `index` in the state's byte string."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(f"chunk {index} of {len(self.chunks)}")
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def encode(self) -> bytes:
        """Canonical JSON: peers holding the same state encode the same bytes (same digest)."""
        doc = {
            "v": MANIFEST_VERSION,
            "round": self.round,
            "theta_hash": self.theta_hash,
            "schedule": self.schedule,
            "chunk_bytes": self.chunk_bytes,
            "tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors],
            "chunks": list(self.chunks),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, raw: bytes, *, digest: str) -> StateManifest:
        """The manifest in `raw` if it hashes to `digest` and is well formed; ValueError otherwise.

        Checks structure and bounds only (chunk size within [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES], one
        hash per chunk of the stated tensors); whether the tensors are the ones the caller expects
        is `expect_layout`'s job, and both run before any chunk is read.
        """
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest of {len(raw)} bytes exceeds {MAX_MANIFEST_BYTES}")
        if hashlib.sha256(raw).hexdigest() != digest:
            raise ValueError("manifest does not match the published manifest hash")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION:
            raise ValueError(f"not a version {MANIFEST_VERSION} manifest")
        if set(doc) != {"v", "round", "theta_hash", "schedule", "chunk_bytes", "tensors", "chunks"}:
            raise ValueError(f"manifest fields {sorted(doc)}")
        chunk_bytes = _int(doc["chunk_bytes"], "chunk_bytes")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"manifest chunk size {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
            )
        if not isinstance(doc["tensors"], list) or not isinstance(doc["chunks"], list):
            raise ValueError("manifest tensors and chunks must be lists")
        if not isinstance(doc["schedule"], dict) or not isinstance(doc["theta_hash"], str):
            raise ValueError("manifest schedule must be an object and theta_hash a string")
        manifest = cls(
            round=_int(doc["round"], "round"),
            theta_hash=doc["theta_hash"],
            schedule=doc["schedule"],
            chunk_bytes=chunk_bytes,
            tensors=tuple(_tensor_spec(item) for item in doc["tensors"]),
            chunks=tuple(doc["chunks"]),
        )
        if not all(isinstance(h, str) and _HEX64.match(h) for h in manifest.chunks):
            raise ValueError("manifest chunk hashes must be sha256 hex digests")
        if len(manifest.chunks) != max(1, -(-manifest.total_bytes // chunk_bytes)):
            raise ValueError(
                f"manifest lists {len(manifest.chunks)} chunks for {manifest.total_bytes} bytes "
                f"in chunks of {chunk_bytes}"
            )
        return manifest

    def expect_layout(self, expected: Sequence[TensorSpec]) -> None:
        """ValueError unless the manifest holds exactly `expected` (names, dtypes, shapes, in order):
        a joiner knows its model, so no size a donor advertises beyond it is ever read."""
        if self.tensors != tuple(expected):
            theirs = sum(t.nbytes for t in self.tensors)
            ours = sum(t.nbytes for t in expected)
            raise ValueError(
                f"manifest describes {len(self.tensors)} tensors, {theirs} bytes; "
                f"this model's state is {len(expected)} tensors, {ours} bytes"
            )


def build_manifest(
    named: Sequence[tuple[str, Tensor]],
    *,
    round: int,
    theta_hash: str,
    schedule: dict[str, Any],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hashed: Callable[[int], None] | None = None,
) -> StateManifest:
    """The manifest of the named tensors, hashing them chunk by chunk (no concatenated copy);
    `hashed(i)` once every byte of tensor i is hashed (`TensorBytes.chunk_hashes`)."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    specs = tuple(TensorSpec.of(name, t) for name, t in named)
    data = TensorBytes([t for _, t in named])
    return StateManifest(
        round=round,
        theta_hash=theta_hash,
        schedule=schedule,
        chunk_bytes=chunk_bytes,
        tensors=specs,
        chunks=tuple(data.chunk_hashes(chunk_bytes, hashed=hashed)),
    )


class TensorBytes:
    """Tensors seen as one byte string in order, read or written by range in place.

    Tensors must be contiguous; reading works on any device (a range is copied to the host), writing
    only on CPU tensors (a download allocates its own).
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._flat = [_byte_view(t) for t in tensors]
        self._starts: list[int] = []
        offset = 0
        for flat in self._flat:
            self._starts.append(offset)
            offset += flat.numel()
        self.total = offset

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, Tensor]]:
        """(offset into [start, end), uint8 slice) for every tensor overlapping the range."""
        if not 0 <= start <= end <= self.total:
            raise ValueError(f"byte range [{start}, {end}) outside [0, {self.total})")
        for begin, flat in zip(self._starts, self._flat, strict=True):
            lo, hi = max(start, begin), min(end, begin + flat.numel())
            if lo < hi:
                yield lo - start, flat[lo - begin : hi - begin]

    def read(self, start: int, end: int) -> bytes:
        """A copy of bytes [start, end) (one chunk: the only copy a donor makes to serve it)."""
        return b"".join(_host(piece).tobytes() for _, piece in self.pieces(start, end))

    def write(self, start: int, data: bytes) -> None:
        """Write `data` at byte `start`."""
        source = np.frombuffer(data, dtype=np.uint8)
        for offset, piece in self.pieces(start, start + len(data)):
            piece.numpy()[:] = source[offset : offset + piece.numel()]

    def chunk_hashes(self, chunk_bytes: int, *, hashed: Callable[[int], None] | None = None) -> list[str]:
        """sha256 hex of every chunk of `chunk_bytes` (at least one chunk, maybe empty), hashed on
        a few threads (hashlib releases the GIL): a 1B-parameter θ and m are 8 GB to hash. In
        order, a few chunks per thread at a time: `hashed(i)` is called for each tensor i, in order,
        as soon as every chunk covering it is hashed (a reader that maps tensors from a file gives
        their pages back as it goes)."""

        def hash_chunk(start: int) -> str:
            digest = hashlib.sha256()
            for _, piece in self.pieces(start, min(start + chunk_bytes, self.total)):
                digest.update(_host(piece).data)
            return digest.hexdigest()

        starts = range(0, max(self.total, 1), chunk_bytes)
        threads = min(HASH_THREADS, os.cpu_count() or 1) if len(starts) >= 8 else 1
        window = 4 * threads
        out: list[str] = []
        done = 0  # tensors whose bytes are all hashed
        with ThreadPoolExecutor(threads) as pool:
            for first in range(0, len(starts), window):
                out.extend(pool.map(hash_chunk, starts[first : first + window]))
                through = min(starts[min(first + window, len(starts)) - 1] + chunk_bytes, self.total)
                while (
                    hashed is not None
                    and done < len(self._flat)
                    and (self._starts[done] + self._flat[done].numel() <= through)
                ):
                    hashed(done)
                    done += 1
        return out


class ChunkedState:
    """A download in progress: tensors allocated from the manifest (on CPU) and the chunks verified.

    `accept` keeps a chunk only if it hashes to the manifest's entry; what is verified stays
    verified, so a download interrupted by a failing donor resumes with the chunks it misses.
    Chunks may be accepted from several threads at once (they write disjoint ranges).
    """

    def __init__(self, manifest: StateManifest, digest: str) -> None:
        self.manifest, self.digest = manifest, digest
        self.tensors = {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype]) for t in manifest.tensors}
        self._bytes = TensorBytes(list(self.tensors.values()))
        self.verified: set[int] = set()
        self.accepted = 0  # chunks kept (each once)
        self.refused = 0  # chunks that did not match their hash
        self._mutex = threading.Lock()

    def missing(self) -> list[int]:
        return [i for i in range(len(self.manifest.chunks)) if i not in self.verified]

    @property
    def complete(self) -> bool:
        return len(self.verified) == len(self.manifest.chunks)

    def accept(self, index: int, data: bytes) -> bool:
        """Verify chunk `index` and write it; False (nothing written) if it is not the manifest's."""
        start, end = self.manifest.span(index)
        if len(data) != end - start or hashlib.sha256(data).hexdigest() != self.manifest.chunks[index]:
            with self._mutex:
                self.refused += 1
            return False
        if index in self.verified:
            return True
        self._bytes.write(start, data)  # the same verified bytes, should two threads race here
        with self._mutex:
            if index not in self.verified:
                self.verified.add(index)
                self.accepted += 1
        return True


def _byte_view(tensor: Tensor) -> Tensor:
    if not tensor.is_contiguous():
        raise ValueError("state tensors must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def _host(piece: Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return piece.cpu().numpy()


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"manifest {what} must be an integer >= 0")
    return value


def _tensor_spec(item: Any) -> TensorSpec:
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("manifest tensor entries are [name, dtype, shape]")
    name, dtype, shape = item
    if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"manifest tensor entry {str(item)[:80]}")
    if not isinstance(shape, list) or len(shape) > 8:
        raise ValueError(f"manifest tensor entry {str(item)[:80]}")
    return TensorSpec(name, dtype, tuple(_int(n, "shape") for n in shape))
