"""Token streams: a shard's documents seen as one sequence of ids, without copying them out of the cache.

A `TokenStream` is a table of pieces (start, length) of one or more token sources, concatenated
virtually; a source is the token cache's file (`TokenFile`) or an in-memory array. Reading windows
reads just their ids, so a stream of any size costs its piece table (24 bytes per document); an
MIT merge concatenates two piece tables. Files are read with positioned reads, not through a
memory map: a map would keep every page a sampler ever touched mapped into the process, its RSS
growing toward the size of the corpus over a run (measured: a 200 MB cache fully mapped after 2,000
batches of 16 random windows, as fast either way); read, the pages stay in the kernel's page
cache, which it shares and reclaims.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int64]
Tokens = npt.NDArray[np.integer[Any]]

_CHUNK = 1 << 20


class TokenFile:
    """A file of fixed-size little-endian items (token ids, index records), read with positioned reads.

    The descriptor is opened on first read (so after a fork too) and closed with the object.
    """

    def __init__(self, path: Path, dtype: np.dtype[Any]) -> None:
        self.path = path
        self.dtype = dtype
        nbytes = path.stat().st_size
        if nbytes % dtype.itemsize:
            raise ValueError(f"{path.name} is not a whole number of {dtype.itemsize}-byte items")
        self.size = nbytes // dtype.itemsize
        self._fd: int | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled by its path (another process opens its own descriptor)."""
        return {"path": self.path, "dtype": self.dtype, "size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.dtype, self.size = state["path"], state["dtype"], state["size"]
        self._fd, self._pid, self._lock = None, 0, threading.Lock()

    def read(self, lo: int, hi: int) -> npt.NDArray[Any]:
        """Items [lo, hi) as a new (read-only) array; safe to call from several threads."""
        if not 0 <= lo <= hi <= self.size:
            raise IndexError(f"items [{lo}, {hi}) outside {self.path.name}'s {self.size}")
        nbytes = (hi - lo) * self.dtype.itemsize
        data = os.pread(self._descriptor(), nbytes, lo * self.dtype.itemsize)
        if len(data) != nbytes:
            raise OSError(f"{self.path}: {len(data)} of {nbytes} bytes read (truncated since opened?)")
        return np.frombuffer(data, dtype=self.dtype)

    def _descriptor(self) -> int:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self._fd = os.open(self.path, os.O_RDONLY)
                self._pid = os.getpid()
                weakref.finalize(self, os.close, self._fd)
            return self._fd


TokenSource = TokenFile | Tokens


def read_source(source: TokenSource, lo: int, hi: int) -> Tokens:
    """Ids [lo, hi) of a token file or array."""
    return source.read(lo, hi) if isinstance(source, TokenFile) else source[lo:hi]


class TokenStream:
    """The concatenation of pieces of token sources, read on demand.

    Piece i is ids `start[i] : start[i] + length[i]` of `sources[source[i]]`. Adjacent pieces of one
    source are coalesced.
    """

    def __init__(
        self, sources: Sequence[TokenSource], source: IntArray, start: IntArray, length: IntArray
    ) -> None:
        keep = length > 0
        source, start, length = source[keep], start[keep], length[keep]
        if length.size > 1:  # coalesce pieces that continue one another in the same source
            joins = (source[1:] == source[:-1]) & (start[1:] == start[:-1] + length[:-1])
            if joins.any():
                head = np.concatenate([[True], ~joins])
                run = np.cumsum(head) - 1
                length = np.bincount(run, weights=length).astype(np.int64)
                source, start = source[head], start[head]
        self.sources = list(sources)
        self.source = source
        self.start = start
        self.length = length
        self.offset = np.cumsum(length) - length  # where each piece starts in the stream
        self.num_tokens = int(length.sum())

    @classmethod
    def of(cls, tokens: TokenSource, start: IntArray, length: IntArray) -> TokenStream:
        """Pieces of one source (e.g. documents of the token cache, in the order given)."""
        return cls([tokens], np.zeros(start.size, dtype=np.int64), start, length)

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor]) -> TokenStream:
        """An in-memory stream of the tensors' ids, concatenated (a copy)."""
        if not tensors:
            return cls.of(np.empty(0, dtype=np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        array = np.concatenate([t.reshape(-1).numpy() for t in tensors])
        return cls.of(array, np.zeros(1, np.int64), np.array([array.size], np.int64))

    @property
    def dtype(self) -> str:
        """The torch name of the ids' storage type (of the first source), e.g. "torch.uint8"."""
        return str(torch.from_numpy(np.empty(0, dtype=self.sources[0].dtype)).dtype)

    def take(self, positions: IntArray) -> IntArray:
        """The ids at stream positions `positions` (any shape) as int64.

        Positions are grouped into runs of consecutive ids of one piece (a window is one run, or
        two across a document boundary), and each run is one read.
        """
        flat = positions.reshape(-1)
        out = np.empty(flat.shape, dtype=np.int64)
        if not flat.size:
            return out.reshape(positions.shape)
        piece = np.searchsorted(self.offset, flat, side="right") - 1
        at = self.start[piece] + (flat - self.offset[piece])
        if len(self.sources) == 1 and not isinstance(self.sources[0], TokenFile):
            out[:] = self.sources[0][at]
            return out.reshape(positions.shape)
        breaks = np.flatnonzero((piece[1:] != piece[:-1]) | (at[1:] != at[:-1] + 1)) + 1
        bounds = np.concatenate([[0], breaks, [flat.size]]).tolist()
        for lo, hi in itertools.pairwise(bounds):
            first = int(at[lo])
            out[lo:hi] = read_source(self.sources[int(self.source[piece[lo]])], first, first + hi - lo)
        return out.reshape(positions.shape)

    def windows(self, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(len(starts), seq_len) int64 tensor: the windows starting at `starts`."""
        positions = starts.numpy().astype(np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)
        return torch.from_numpy(self.take(positions))

    def concat(self, other: TokenStream) -> TokenStream:
        """This stream followed by `other` (their sources shared, not copied)."""
        sources = list(self.sources)
        remap = []
        for src in other.sources:
            found = next((i for i, s in enumerate(sources) if s is src), None)
            if found is None:
                sources.append(src)
                found = len(sources) - 1
            remap.append(found)
        other_source = np.array(remap, dtype=np.int64)[other.source] if other.source.size else other.source
        return TokenStream(
            sources,
            np.concatenate([self.source, other_source]),
            np.concatenate([self.start, other.start]),
            np.concatenate([self.length, other.length]),
        )

    def slice(self, lo: int, hi: int) -> TokenStream:
        """Stream positions [lo, hi) as a stream of their own."""
        if hi <= lo:
            return TokenStream(self.sources, *(np.zeros(0, np.int64) for _ in range(3)))
        end = self.offset + self.length
        first = int(np.searchsorted(end, lo, side="right"))
        last = int(np.searchsorted(self.offset, hi, side="left"))
        source, start, length = (
            self.source[first:last],
            self.start[first:last].copy(),
            self.length[first:last].copy(),
        )
        if length.size:
            cut_front = lo - int(self.offset[first])
            start[0] += cut_front
            length[0] -= cut_front
            length[-1] -= int(end[last - 1]) - hi
        return TokenStream(self.sources, source, start, length)

    def chunks(self, size: int = _CHUNK) -> Iterator[Tokens]:
        """The stream's ids in order, in arrays of at most `size` ids (in each source's own dtype)."""
        for s, first, n in zip(self.source.tolist(), self.start.tolist(), self.length.tolist(), strict=True):
            for lo in range(first, first + n, size):
                yield read_source(self.sources[s], lo, min(lo + size, first + n))

    def to_tensor(self) -> torch.Tensor:
        """All ids as one int64 tensor (a copy of the whole stream: for tests and small streams)."""
        parts = [np.asarray(c, dtype=np.int64) for c in self.chunks()]
        return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))


def digest(streams: Sequence[TokenStream]) -> str:
    """sha256 of the streams' ids, concatenated, in their stored bytes, read in bounded chunks."""
    h = hashlib.sha256()
    for stream in streams:
        for chunk in stream.chunks():
            h.update(np.ascontiguousarray(chunk).data)
    return h.hexdigest()
