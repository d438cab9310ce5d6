"""`--host-allocator lean`: glibc keeps every block of 128 KiB or more a mapping of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: free a 16 MiB block (glibc then raises its mmap threshold to 16 MiB unless
# it was fixed), allocate 4 MiB (more than any free hole the imports leave in the heap) and print
# whether that block is a mapping of its own (mallinfo2.hblks).
PROBE = """
import ctypes, sys
from adloco.node.training.runtime import lean_allocator
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "lean":
    assert lean_allocator()
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _own_mappings(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_lean_allocator_keeps_a_freed_blocks_size_class_out_of_the_heap() -> None:
    assert _own_mappings("default") == 0  # glibc's dynamic threshold: the block came from the heap
    assert _own_mappings("lean") == 1
