"""`SpillFile`: bytes kept on disk in an unnamed file, read back by range; `MappedTensors`, tensors
whose values are such a file mapped into memory."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from residency import resident_bytes

from adloco.node.data.spill import MappedTensors, SpillFile, file_system


def test_a_spill_file_reads_back_what_was_appended_by_range_and_leaves_no_file(tmp_path: Path) -> None:
    spill = SpillFile(str(tmp_path))
    values = np.arange(1000, dtype=np.float32)
    assert spill.append(b"abc") == 0
    assert spill.append(bytearray(b"defg")) == 3
    assert spill.append(values.tobytes()) == 7
    assert spill.size == 7 + values.nbytes
    assert spill.read(2, 3) == b"cde"
    assert np.array_equal(np.frombuffer(spill.read(7, values.nbytes), dtype=np.float32), values)
    with pytest.raises(ValueError, match="outside"):
        spill.read(spill.size - 1, 2)
    assert list(tmp_path.iterdir()) == []  # unnamed: nothing to remove, however the process ends


def test_threads_read_one_spill_file_at_once(tmp_path: Path) -> None:
    spill = SpillFile(str(tmp_path))
    blocks = [bytes([i]) * 4096 for i in range(64)]
    for block in blocks:
        spill.append(block)
    wrong: list[int] = []

    def read(i: int) -> None:
        for _ in range(50):
            if spill.read(i * 4096, 4096) != blocks[i]:
                wrong.append(i)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_a_folder_that_is_gone_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        SpillFile(str(tmp_path / "gone"))


def test_reserved_bytes_read_as_zeros_and_are_rewritten_in_place(tmp_path: Path) -> None:
    """`reserve` adds zeros at the end (their disk space allocated where the file system can);
    `write` overwrites within what was written or reserved, and nowhere else."""
    spill = SpillFile(str(tmp_path))
    assert spill.append(b"head") == 0
    at = spill.reserve(10_000)
    assert at == 4 and spill.size == 10_004
    assert spill.read(at, 10_000) == bytes(10_000)
    spill.write(at + 9_990, b"0123456789")
    spill.write(1, bytearray(b"EA"))
    assert spill.read(0, 4) == b"hEAd"
    assert spill.read(at, 9_990) == bytes(9_990) and spill.read(at + 9_990, 10) == b"0123456789"
    with pytest.raises(ValueError, match="outside"):
        spill.write(spill.size - 1, b"xy")
    assert spill.reserve(3) == 10_004 and spill.read(10_004, 3) == bytes(3)


def _open_in(folder: Path) -> list[str]:
    """This process's open files in `folder` (an unnamed one reads "folder/#inode (deleted)")."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{folder}/"):
                found.append(fd)
    return found


def _mapped_from(folder: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(f" {folder}/" in line for line in f)


def test_mapped_tensors_keep_their_values_in_a_file_and_are_held_only_until_released(
    tmp_path: Path,
) -> None:
    """`MappedTensors.take` moves a list's tensors into an unnamed file's mapping in place (values
    equal, the list now holding the mapped ones, none of them held afterwards); what is read or
    written later is held until `release`, after which the values are still there; nothing is left
    in the folder, and the file goes with the last tensor."""
    like = [torch.randn(300, 1000), torch.arange(5, dtype=torch.float64), torch.zeros(0, 3)]
    expected = [t.clone() for t in like]
    held = list(like)
    store = MappedTensors(held, str(tmp_path))
    store.take(held)
    assert resident_bytes(held[0]) == 0  # each released as it was copied
    assert all(h is s and h is not t for h, s, t in zip(held, store.tensors, like, strict=True))
    assert all(torch.equal(h, e) and h.dtype == e.dtype for h, e in zip(held, expected, strict=True))
    store.release()
    held[0].mul_(2)
    assert resident_bytes(held[0]) >= held[0].numel() * 4
    store.release(0)
    # (a fault may also map the neighbouring pages already in the page cache, up to 64 KiB around
    # it: the next tensor's first pages, which are not tensor 0's to release)
    assert resident_bytes(held[0]) <= 64 * 1024
    held[1].add_(1)
    store.release()
    assert resident_bytes(held[0]) == 0
    assert torch.equal(held[0], 2 * expected[0]) and torch.equal(held[1], expected[1] + 1)
    assert list(tmp_path.iterdir()) == []  # an unnamed file
    assert len(_open_in(tmp_path)) == 1 and _mapped_from(tmp_path)
    del store, held, like
    gc.collect()
    assert _open_in(tmp_path) == [] and not _mapped_from(tmp_path)  # gone with the last tensor
    with pytest.raises(ValueError, match="not mapped so"):
        MappedTensors([torch.zeros(3)], str(tmp_path)).take([torch.zeros(4)])


def test_a_folder_in_memory_or_gone_holds_no_mapped_tensors(tmp_path: Path) -> None:
    """A tmpfs folder would save no memory: refused, as a folder that is not there is."""
    with pytest.raises(FileNotFoundError):
        MappedTensors([torch.zeros(3)], str(tmp_path / "gone"))
    if file_system("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with pytest.raises(OSError, match="in memory"):
        MappedTensors([torch.zeros(3)], "/dev/shm")
