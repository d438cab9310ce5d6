"""The node's C allocator setting: large blocks mapped on their own, whatever was freed before."""

from __future__ import annotations

import ctypes
import platform
import sys

import pytest

from adloco.node.training.runtime import MMAP_THRESHOLD_BYTES, tune_malloc

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
    ] + [(name, ctypes.c_size_t) for name in ("fordblks", "keepcost")]


def _mallinfo(libc: ctypes.CDLL) -> _MallInfo2:
    libc.mallinfo2.restype = _MallInfo2  # a struct returned by value: the type must be set first
    info: _MallInfo2 = libc.mallinfo2()
    return info


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_blocks_above_the_threshold_are_mapped_after_a_large_one_was_freed() -> None:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33 has no mallinfo2")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert tune_malloc()
    # Freeing a mapped block of 24 MiB is what raises glibc's dynamic threshold to 24 MiB.
    libc.free(libc.malloc(24 << 20))
    # Larger than all the heap's free memory, so it cannot come from a free chunk: the heap grows
    # for it (below the dynamic threshold) or it gets its own mapping (above the fixed one).
    size = max(int(_mallinfo(libc).fordblks), MMAP_THRESHOLD_BYTES) + (1 << 20)
    if size >= 24 << 20:
        pytest.skip("the heap has too much free memory to tell the two apart")
    before = int(_mallinfo(libc).hblkhd)
    block = libc.malloc(size)
    try:
        assert int(_mallinfo(libc).hblkhd) - before >= size  # its own mapping, not a piece of the heap
    finally:
        libc.free(block)


def test_an_explicit_setting_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert not tune_malloc()
