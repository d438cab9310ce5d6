"""Reading any payload, whichever codec made it: `decode` and `payload_shape` (every reader, sum
included), and what a payload says of itself, for verification: the codec family that made it
(`payload_codec`) and how far an honest encoding's values can be from what was encoded
(`error_bound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .dense import Int4Codec, Int8Codec, _block_absmax
from .frame import (
    _ID_FP16,
    _ID_INT4,
    _ID_INT8,
    _ID_LOWRANK,
    _ID_NONE,
    _ID_SPARSE,
    _ID_SUM,
    _U32,
    _read,
    _read_header,
    _read_u32,
)
from .sums import _SINGLE_READERS, _read_sum

_READERS = {**_SINGLE_READERS, _ID_SUM: _read_sum}


def payload_shape(payload: bytes) -> tuple[int, ...]:
    """The shape of `decode(payload)`, after every check `decode` makes, without decoding a value.

    ValueError if the payload is malformed. A receiver validates what it receives with this, and
    decodes each payload once, where it uses the values.
    """
    return _read(payload, _READERS)[0]


def decode(payload: bytes) -> torch.Tensor:
    """Reconstruct the float32 CPU tensor of any codec's payload; ValueError if it is malformed."""
    return _read(bytes(payload), _READERS)[1]()


# --- what a payload says of itself (verification) -----------------------------------------------

_NAMES = {
    _ID_NONE: "none",
    _ID_FP16: "fp16",
    _ID_INT8: "int8",
    _ID_INT4: "int4",
    _ID_LOWRANK: "lowrank",
    _ID_SPARSE: "sparse",
    _ID_SUM: "sum",
}
_FP16_RELATIVE = 2.0**-11  # round to nearest: half a unit in the last place of 11 significant bits
_FP16_SUBNORMAL = 2.0**-25  # half the spacing of fp16's subnormals, the most a tiny value can move


def payload_codec(payload: bytes) -> str:
    """The family of the codec that made `payload` ("none", "fp16", "int8", "int4", "lowrank",
    "sparse" or "sum"), from its header; ValueError if it is not one."""
    codec_id, _, _ = _read_header(payload)
    if codec_id not in _NAMES:
        raise ValueError(f"unknown codec id {codec_id} in payload")
    return _NAMES[codec_id]


@dataclass(frozen=True)
class Rounding:
    """How far an honest encoding's decoded values can be from what was encoded: at most `peak` per
    value, at most `l2` in L2 norm."""

    l2: float
    peak: float


def error_bound(payload: bytes, decoded: torch.Tensor) -> Rounding | None:
    """How far `decoded` (= decode(payload)) can be from the tensor an honest encoder made `payload`
    from, read off the payload alone; None where the payload does not bound it (low rank, sparse and
    sum payloads: what they leave out is not in them).

    none: 0. fp16: round to nearest, 2**-11 of each value's size, 2**-25 for one in the subnormal
    range. int8 / int4: each value is rounded to the nearest multiple of its block's absmax / qmax,
    so it moves at most half of one: l2 = sqrt(Σ_blocks numel_b · (absmax_b / (2 qmax))²). An honest
    encoder quantizes each block's largest value to exactly ±qmax, which decodes to ±absmax (within
    a float32 rounding); a block whose largest decoded value is not its absmax was made by no honest
    encoder, and would let a liar widen the bound with an inflated absmax (a block "rounded" to
    zeros): ValueError. Non-finite values give inf.
    """
    codec_id, shape, offset = _read_header(payload)
    values = decoded.reshape(-1)
    if tuple(decoded.shape) != shape:
        raise ValueError(f"decoded shape {tuple(decoded.shape)} is not the payload's {shape}")
    if codec_id == _ID_NONE:
        return Rounding(0.0, 0.0)
    if codec_id == _ID_FP16:
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float64))
        peak = float(values.abs().max()) if values.numel() else 0.0
        return Rounding(
            _FP16_RELATIVE * norm + _FP16_SUBNORMAL * math.sqrt(values.numel()),
            _FP16_RELATIVE * peak + _FP16_SUBNORMAL,
        )
    if codec_id not in (_ID_INT8, _ID_INT4):
        return None
    qmax = Int8Codec._qmax if codec_id == _ID_INT8 else Int4Codec._qmax
    block = _read_u32(payload, offset)
    numel = values.numel()
    nblocks = -(-numel // block)
    absmax = torch.from_numpy(
        np.frombuffer(payload, dtype="<f4", count=nblocks, offset=offset + _U32.size).astype(np.float32)
    )
    if not bool(torch.isfinite(absmax).all()):
        return Rounding(math.inf, math.inf)
    largest = _block_absmax(values, block)
    # ±qmax · absmax / qmax comes back within a rounding of absmax (for 1 % of values, not exactly).
    if bool(((largest - absmax).abs() > absmax * 2.0**-22).any()):
        raise ValueError("a block's largest value is not its absmax: no honest encoder made this payload")
    counts = torch.full((nblocks,), float(block), dtype=torch.float64)
    counts[-1] = numel - block * (nblocks - 1)
    half_steps = absmax.to(torch.float64) / (2 * qmax)
    return Rounding(math.sqrt(float((counts * half_steps.square()).sum())), float(half_steps.max()))
