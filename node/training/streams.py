"""Token streams: a shard's documents seen as one sequence of ids, without copying them out of the cache.

A `TokenStream` is a list of pieces (start, length) of one or more token arrays, usually the token
cache's memory map, concatenated virtually. Reading windows gathers just their ids, so a stream of
any size costs its piece table (16 bytes per document) plus the pages actually read, which the
kernel may drop again; an MIT merge concatenates two piece tables. The digest and probes that
identify a stream in a checkpoint are computed in bounded chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int64]
Tokens = npt.NDArray[np.integer[Any]]

_CHUNK = 1 << 20


class TokenStream:
    """The concatenation of pieces of 1-D token arrays, read on demand.

    `bases` are the arrays (memory maps or in-memory), and piece i is
    `bases[base[i]][start[i] : start[i] + length[i]]`. Adjacent pieces of one base are coalesced.
    """

    def __init__(self, bases: Sequence[Tokens], base: IntArray, start: IntArray, length: IntArray) -> None:
        keep = length > 0
        base, start, length = base[keep], start[keep], length[keep]
        if length.size > 1:  # coalesce pieces that continue one another in the same array
            joins = (base[1:] == base[:-1]) & (start[1:] == start[:-1] + length[:-1])
            if joins.any():
                head = np.concatenate([[True], ~joins])
                run = np.cumsum(head) - 1
                length = np.bincount(run, weights=length).astype(np.int64)
                base, start = base[head], start[head]
        self.bases = list(bases)
        self.base = base
        self.start = start
        self.length = length
        self.offset = np.cumsum(length) - length  # where each piece starts in the stream
        self.num_tokens = int(length.sum())

    @classmethod
    def of(cls, array: Tokens, start: IntArray, length: IntArray) -> TokenStream:
        """Pieces of one array (e.g. documents of the token cache, in the order given)."""
        return cls([array], np.zeros(start.size, dtype=np.int64), start, length)

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor]) -> TokenStream:
        """An in-memory stream of the tensors' ids, concatenated (a copy)."""
        if not tensors:
            return cls.of(np.empty(0, dtype=np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        array = np.concatenate([t.reshape(-1).numpy() for t in tensors])
        return cls.of(array, np.zeros(1, np.int64), np.array([array.size], np.int64))

    @property
    def dtype(self) -> str:
        """The torch name of the ids' storage type (of the first array), e.g. "torch.uint8"."""
        return str(torch.from_numpy(np.empty(0, dtype=self.bases[0].dtype)).dtype)

    def take(self, positions: IntArray) -> IntArray:
        """The ids at stream positions `positions` (any shape) as int64."""
        flat = positions.reshape(-1)
        piece = np.searchsorted(self.offset, flat, side="right") - 1
        source = self.start[piece] + (flat - self.offset[piece])
        out = np.empty(flat.shape, dtype=np.int64)
        if len(self.bases) == 1:
            out[:] = self.bases[0][source]
        else:
            which = self.base[piece]
            for b, array in enumerate(self.bases):
                mask = which == b
                if mask.any():
                    out[mask] = array[source[mask]]
        return out.reshape(positions.shape)

    def windows(self, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(len(starts), seq_len) int64 tensor: the windows starting at `starts`."""
        positions = starts.numpy().astype(np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)
        return torch.from_numpy(self.take(positions))

    def concat(self, other: TokenStream) -> TokenStream:
        """This stream followed by `other` (their arrays shared, not copied)."""
        bases = list(self.bases)
        remap = []
        for array in other.bases:
            found = next((i for i, b in enumerate(bases) if b is array), None)
            if found is None:
                bases.append(array)
                found = len(bases) - 1
            remap.append(found)
        other_base = np.array(remap, dtype=np.int64)[other.base] if other.base.size else other.base
        return TokenStream(
            bases,
            np.concatenate([self.base, other_base]),
            np.concatenate([self.start, other.start]),
            np.concatenate([self.length, other.length]),
        )

    def slice(self, lo: int, hi: int) -> TokenStream:
        """Stream positions [lo, hi) as a stream of their own."""
        if hi <= lo:
            return TokenStream(self.bases, *(np.zeros(0, np.int64) for _ in range(3)))
        end = self.offset + self.length
        first = int(np.searchsorted(end, lo, side="right"))
        last = int(np.searchsorted(self.offset, hi, side="left"))
        base, start, length = (
            self.base[first:last],
            self.start[first:last].copy(),
            self.length[first:last].copy(),
        )
        if length.size:
            cut_front = lo - int(self.offset[first])
            start[0] += cut_front
            length[0] -= cut_front
            length[-1] -= int(end[last - 1]) - hi
        return TokenStream(self.bases, base, start, length)

    def chunks(self, size: int = _CHUNK) -> Iterator[Tokens]:
        """The stream's ids in order, in arrays of at most `size` (in each array's own dtype).

        Memory-mapped arrays are read through their file, not the map, so reading a whole stream
        (a checkpoint's digest) leaves no pages mapped into this process.
        """
        files: dict[int, BinaryIO] = {}
        try:
            for b, s, n in zip(self.base.tolist(), self.start.tolist(), self.length.tolist(), strict=True):
                array = self.bases[b]
                for lo in range(s, s + n, size):
                    hi = min(lo + size, s + n)
                    if isinstance(array, np.memmap) and array.filename is not None:
                        if b not in files:
                            files[b] = open(array.filename, "rb")  # noqa: SIM115 (closed below)
                        yield _read(files[b], array, lo, hi)
                    else:
                        yield np.asarray(array[lo:hi])
        finally:
            for f in files.values():
                f.close()

    def to_tensor(self) -> torch.Tensor:
        """All ids as one int64 tensor (a copy of the whole stream: for tests and small streams)."""
        return torch.from_numpy(self.take(np.arange(self.num_tokens, dtype=np.int64)))


def _read(f: BinaryIO, array: np.memmap[Any, Any], lo: int, hi: int) -> Tokens:
    """Items [lo, hi) of a memory map of a whole file (from `offset`), read from the file."""
    f.seek(array.offset + lo * array.itemsize)
    data = f.read((hi - lo) * array.itemsize)
    if len(data) != (hi - lo) * array.itemsize:
        raise OSError(f"{array.filename}: truncated while being read")
    return np.frombuffer(data, dtype=array.dtype)


def digest(streams: Sequence[TokenStream]) -> str:
    """sha256 of the streams' ids, concatenated, in their stored bytes, read in bounded chunks."""
    h = hashlib.sha256()
    for stream in streams:
        for chunk in stream.chunks():
            h.update(np.ascontiguousarray(chunk).data)
    return h.hexdigest()
