"""`SpillFile`: bytes kept on disk in an unnamed file, read back by range."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from adloco.node.data.spill import SpillFile


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
