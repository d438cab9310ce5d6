"""Bytes a node keeps for others but rarely reads, on disk instead of in memory.

A `SpillFile` is an unnamed temporary file (`tempfile.TemporaryFile`): written in order (or
regions reserved zeroed and rewritten in place), and read back by range with `pread`, so threads may
share it. The system removes it when the object is
collected or the process ends, however it ends: nothing is left behind to clean up. The kept updates
for laggards (`replica.SpilledPayloads`) and a state frozen for a joiner's download
(`offers.StateOffers`) wait in them, and the int8 error-feedback residuals between contributions
(`feedback.Int8Residual`, rewritten in place).

`MappedTensors` are tensors whose values live in such a file mapped into memory: θ and the outer
momentum of a networked node, read and written once a round as tensors, and handed back to the
system's page cache (`release`) while the node trains (record 082).
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref
from collections.abc import MutableSequence

import torch


class SpillFile:
    """An unnamed file in `directory` (default: the system's temporary folder); OSError when it
    cannot be made or written (a folder gone, a full disk)."""

    def __init__(self, directory: str | None = None) -> None:
        with tempfile.TemporaryFile(dir=directory) as f:
            self._fd = os.dup(f.fileno())  # the open file outlives the object that created it
        weakref.finalize(self, os.close, self._fd)
        self.size = 0

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Write `data` at the end; returns where it starts."""
        at, view = self.size, memoryview(data).cast("B")
        self.size += view.nbytes
        while view:
            view = view[os.write(self._fd, view) :]
        return at

    def reserve(self, size: int, *, holes: bool = True) -> int:
        """`size` zero bytes at the end, their disk space allocated now (so that rewriting them
        cannot run out of it) where the file system can; returns where they start. OSError when the
        disk is full, and where it cannot allocate ahead unless `holes` allows a sparse file."""
        at = self.size
        try:
            os.posix_fallocate(self._fd, at, size)
        except OSError as e:
            if not holes or e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self._fd, at + size)  # a file system that cannot allocate ahead: a hole
        self.size = at + size
        return at

    def write(self, at: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite bytes from `at`, within what was written or reserved."""
        view = memoryview(data).cast("B")
        if at < 0 or at + view.nbytes > self.size:
            raise ValueError(f"bytes [{at}, {at + view.nbytes}) outside the file's {self.size}")
        while view:
            done = os.pwrite(self._fd, view, at)
            view, at = view[done:], at + done

    def read(self, at: int, size: int) -> bytes:
        """`size` bytes from `at`; OSError if the file ends before."""
        if at < 0 or size < 0 or at + size > self.size:
            raise ValueError(f"bytes [{at}, {at + size}) outside the file's {self.size}")
        parts, done = [], 0
        while done < size:
            part = os.pread(self._fd, size - done, at + done)
            if not part:
                raise OSError(f"spill file ends at {at + done}, short of {at + size}")
            parts.append(part)
            done += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)


class MappedTensors:
    """Tensors shaped like `like`, their values in an unnamed file in `directory` mapped into this
    process (shared: what is written goes to the file): ordinary tensors to every reader and
    writer, which the system may keep in its page cache or write out to the disk instead of
    holding in the process.

    `take(tensors)` moves values in, one tensor at a time, replacing each entry of the list with its
    mapped tensor (so a list's tensors in memory go as they are copied). `release()` unmaps the
    pages read or written since the last release: the values stay in the file (and the page cache,
    while the system has room), and the next reader maps them back. The file's disk space is
    allocated up front, so writing through the mapping can never meet a full disk (a bus error):
    OSError here instead, also on a file system that cannot allocate ahead. The file goes with the
    last of the tensors. A folder whose file system is itself memory (tmpfs, as /tmp is on some
    systems) would save nothing: OSError too; with no folder given, /var/tmp is tried after the
    temporary folder.
    """

    def __init__(self, like: list[torch.Tensor], directory: str | None = None) -> None:
        directory = disk_folder(directory)
        page = mmap.PAGESIZE
        regions, size = [], 0
        for t in like:
            nbytes = t.numel() * t.element_size()
            regions.append((size, nbytes))
            size += -(-nbytes // page) * page  # each tensor on its own pages: released alone
        spill = SpillFile(directory)
        spill.reserve(max(size, page), holes=False)
        self._map = mmap.mmap(spill._fd, max(size, page))  # shared, read and write; its own fd
        self._regions = regions
        self.tensors = [
            torch.frombuffer(self._map, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape)
            if t.numel()
            else torch.empty(t.shape, dtype=t.dtype)
            for t, (at, _) in zip(like, regions, strict=True)
        ]

    @torch.no_grad()
    def take(self, tensors: MutableSequence[torch.Tensor]) -> None:
        """Copy `tensors` in and put the mapped ones in their place in the list, one at a time, each
        released as soon as it is copied."""
        if len(tensors) != len(self.tensors):
            raise ValueError(f"{len(tensors)} tensors for {len(self.tensors)} mapped ones")
        for i, (mapped, (at, nbytes)) in enumerate(zip(self.tensors, self._regions, strict=True)):
            if tensors[i].shape != mapped.shape or tensors[i].dtype != mapped.dtype:
                raise ValueError(f"tensor {i}: {tensors[i].dtype}{tuple(tensors[i].shape)} is not mapped so")
            mapped.copy_(tensors[i])
            tensors[i] = mapped
            self._release(at, nbytes)

    def release(self, index: int | None = None, start: int = 0, stop: int | None = None) -> None:
        """Unmap the pages touched since the last release, of every tensor or of tensor `index`, or
        of the pages holding its values `start` to `stop` (flat; their values stay in the file)."""
        if index is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        at, nbytes = self._regions[index]
        if start == 0 and stop is None:
            self._release(at, nbytes)
            return
        size, numel = self.tensors[index].element_size(), self.tensors[index].numel()
        stop = numel if stop is None else min(stop, numel)
        if 0 <= start < stop:
            page = mmap.PAGESIZE
            first = (at + start * size) // page * page  # the pages the values touch, whole
            self._release(first, at + stop * size - first)

    def flush(self) -> None:
        """Write the values changed since the last flush out to the file now (the system otherwise
        does within its dirty-page expiry, 30 s by default)."""
        self._map.flush()

    def _release(self, at: int, nbytes: int) -> None:
        if nbytes:
            page = mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, at, -(-nbytes // page) * page)


# File systems whose files are memory: a mapping of one saves none.
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def file_system(path: str) -> str:
    """The type of the file system `path` is on ("ext4", "tmpfs"), from /proc/self/mountinfo;
    "" where that cannot be read."""
    path = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                point = fields[4].replace("\\040", " ")
                fs = fields[fields.index("-") + 1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) > best:
                    best, kind = len(point), fs
    except (OSError, ValueError, IndexError):
        return ""
    return kind


def disk_folder(directory: str | None) -> str:
    """`directory`, or with None the temporary folder or else /var/tmp: the first whose file system
    is not memory. OSError naming it when `directory` is memory (or both are)."""
    tried = [directory] if directory is not None else [tempfile.gettempdir(), "/var/tmp"]
    for folder in tried:
        if os.path.isdir(folder) and file_system(folder) not in _MEMORY_FILE_SYSTEMS:
            return folder
    if directory is not None and not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "no such folder", directory)
    raise OSError(f"{' and '.join(tried)}: a file system in memory (tmpfs) saves no memory")
