"""Bytes a node keeps for others but rarely reads, on disk instead of in memory.

A `SpillFile` is an unnamed temporary file (`tempfile.TemporaryFile`): written in order (or
regions reserved zeroed and rewritten in place), and read back by range with `pread`, so threads may
share it. The system removes it when the object is
collected or the process ends, however it ends: nothing is left behind to clean up. The kept updates
for laggards (`replica.SpilledPayloads`) and a state frozen for a joiner's download
(`offers.StateOffers`) wait in them, and the int8 error-feedback residuals between contributions
(`feedback.Int8Residual`, rewritten in place).
"""

from __future__ import annotations

import errno
import os
import tempfile
import weakref


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

    def reserve(self, size: int) -> int:
        """`size` zero bytes at the end, their disk space allocated now (so that rewriting them
        cannot run out of it) where the file system can; returns where they start. OSError when the
        disk is full."""
        at = self.size
        try:
            os.posix_fallocate(self._fd, at, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
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
