"""`--host-allocator lean`: glibc keeps every block of 128 KiB or more a mapping of its own; and what
every node does at a round's boundary: the free memory inside glibc's heaps goes back to the system."""

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


# In a fresh interpreter: 128 MiB in blocks of 64 KiB (below any mmap threshold: the heap's), each
# written, then all freed but the last (which keeps the heap's top in use, so free() trims nothing);
# print the resident MiB then, and after `give_back_free_memory`.
TRIM_PROBE = """
import ctypes, mmap
from adloco.node.training.runtime import give_back_free_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE >> 20
blocks = [libc.malloc(64 << 10) for _ in range(2048)]
for block in blocks:
    ctypes.memset(block, 1, 64 << 10)
for block in blocks[:-1]:
    libc.free(block)
held = resident()
give_back_free_memory()
print(held, resident())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_giving_back_free_memory_returns_the_free_pages_inside_the_heap() -> None:
    """What a round's boundary freed inside glibc's heap (not at its top, which free() itself trims)
    stays resident until `give_back_free_memory`, which hands its pages back (record 083)."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], check=True, capture_output=True, text=True)
    held, after = (int(x) for x in out.stdout.split())
    assert held - after >= 100, (held, after)  # of the 128 MiB freed
