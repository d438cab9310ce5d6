"""The `sum` payload: weighted payloads of one shape carried whole, decoding to their weighted sum
(how an owner's average of sparse contributions can travel: `downlink`); building one, reading
one, and what it carries (`sum_parts`, `sum_count`: for verification).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .dense import _DENSE_READERS
from .frame import (
    _ID_LOWRANK,
    _ID_SPARSE,
    _ID_SUM,
    _U32,
    _Build,
    _check_length,
    _header,
    _header_size,
    _little_endian,
    _read,
    _read_header,
    _read_u32,
)
from .lowrank import _read_lowrank
from .sparse import _read_sparse

_SINGLE_READERS = {**_DENSE_READERS, _ID_LOWRANK: _read_lowrank, _ID_SPARSE: _read_sparse}


def sum_payload(payloads: Sequence[bytes], factors: Sequence[float]) -> bytes:
    """One payload carrying `payloads` (one shape, any codec but sum) whole, decoding to
    Σ factor_i · decode(payload_i) (factors rounded to float32): the weighted mean of contributions
    sent as they came, at the cost of all their bytes. ValueError for no payload, a count mismatch,
    differing shapes, a non-finite factor, or a payload that does not parse."""
    if not payloads or len(payloads) != len(factors):
        raise ValueError(f"a sum needs payloads and one factor each, got {len(payloads)} and {len(factors)}")
    shapes = {_read(bytes(p), _SINGLE_READERS)[0] for p in payloads}
    if len(shapes) != 1:
        raise ValueError(f"summed payloads have different shapes: {sorted(shapes)}")
    weights = np.asarray(factors, dtype=np.float32)
    if not np.isfinite(weights).all():
        raise ValueError(f"sum factors must be finite, got {list(factors)}")
    lengths = np.asarray([len(p) for p in payloads], dtype=np.uint32)
    return b"".join(
        (
            _header(_ID_SUM, shapes.pop()),
            _U32.pack(len(payloads)),
            _little_endian(weights, "<f4"),
            _little_endian(lengths, "<u4"),
            *(bytes(p) for p in payloads),
        )
    )


def sum_payload_bytes(shape: tuple[int, ...], count: int, part_bytes: int) -> int:
    """Exact `len(sum_payload(...))` for `count` payloads of `part_bytes` each, of this shape."""
    return _header_size(shape) + _U32.size + 8 * count + count * part_bytes


def _read_sum(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
    count = _read_u32(payload, offset)
    factors_at = offset + _U32.size
    lengths_at = factors_at + 4 * count
    body_at = lengths_at + 4 * count
    if count == 0 or len(payload) < body_at:
        raise ValueError(f"corrupt sum payload: {count} parts in {len(payload)} bytes")
    factors = np.frombuffer(payload, dtype="<f4", count=count, offset=factors_at).astype(np.float32)
    lengths = np.frombuffer(payload, dtype="<u4", count=count, offset=lengths_at).astype(np.int64)
    _check_length(payload, body_at + int(lengths.sum()))
    if not np.isfinite(factors).all():
        raise ValueError("corrupt sum payload: a factor is not finite")
    builds = []
    for start, length in zip(body_at + np.cumsum(lengths) - lengths, lengths, strict=True):
        part_shape, build_part = _read(payload[int(start) : int(start + length)], _SINGLE_READERS)
        if part_shape != shape:
            raise ValueError(f"corrupt sum payload: a part of shape {part_shape} in a sum of {shape}")
        builds.append(build_part)

    def build() -> torch.Tensor:
        out = torch.zeros(shape)
        # Product and sum each rounded (no fused alpha=): the same bits on every CPU kernel path.
        for factor, part in zip(factors.tolist(), builds, strict=True):
            out.add_(part().mul_(factor))
        return out

    return build


def sum_parts(payload: bytes) -> tuple[list[float], list[bytes]]:
    """The factors and the payloads a sum payload carries (`sum_payload`); ValueError if `payload`
    is not a well-formed sum payload."""
    codec_id, shape, offset = _read_header(payload)
    if codec_id != _ID_SUM:
        raise ValueError("not a sum payload")
    _read_sum(payload, shape, offset)  # every check decode makes
    count = _read_u32(payload, offset)
    factors_at = offset + _U32.size
    lengths_at = factors_at + 4 * count
    factors = np.frombuffer(payload, dtype="<f4", count=count, offset=factors_at).astype(np.float32)
    lengths = np.frombuffer(payload, dtype="<u4", count=count, offset=lengths_at).astype(np.int64)
    starts = lengths_at + 4 * count + np.cumsum(lengths) - lengths
    parts = [bytes(payload[int(a) : int(a + n)]) for a, n in zip(starts, lengths, strict=True)]
    return [float(f) for f in factors], parts


def sum_count(payload: bytes) -> int:
    """How many payloads a sum payload says it carries (0 for any other payload), from its header:
    cheap, before any of them is parsed."""
    codec_id, _, offset = _read_header(payload)
    return _read_u32(payload, offset) if codec_id == _ID_SUM else 0
