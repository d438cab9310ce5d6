"""What this process holds in memory of a mapping: for the tests of state kept in mapped files."""

from __future__ import annotations

import torch


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of the mapping `tensor`'s values are in (/proc/self/smaps' Rss)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")
