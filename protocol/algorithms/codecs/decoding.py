"""Reading any payload, whichever codec made it: `decode` and `payload_shape` (every reader, sum
included), and what a payload says of itself, for verification: the codec family that made it
(`payload_codec`) and how far an honest encoding's values can be from what was encoded
(`error_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .dense import Int4Codec, Int8Codec, _block_absmax, dense_span
from .frame import (
    _ID_FP16,
    _ID_INT4,
    _ID_INT8,
    _ID_LOWRANK,
    _ID_NONE,
    _ID_SPARSE,
    _ID_SUM,
    _U32,
    SPAN,
    _read,
    _read_header,
    _read_u32,
    span_bounds,
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


def decoded_spans(payload: bytes, span: int = SPAN) -> Iterator[torch.Tensor]:
    """`decode(payload).reshape(-1)`, `span` values at a time (the last may be fewer), bit for bit: a
    dense payload (none, fp16, int8, int4) is decoded a span at a time and never whole, any other
    whole first. What an owner's reduction and a member's checks read, so that a decoded part is
    never whole beside the training step (4 B/param of the part, issue 28 §2). ValueError, raised
    here and not at the first span, if the payload is malformed."""
    payload = bytes(payload)
    shape, build = _read(payload, _READERS)  # every check `decode` makes
    numel = math.prod(shape)
    dense = dense_span(payload)
    read = dense[1] if dense is not None else None

    def spans() -> Iterator[torch.Tensor]:
        whole = build().reshape(-1) if read is None else None
        for start, stop in span_bounds(numel, span):
            if read is not None:
                yield read(start, stop)
            elif whole is not None:
                yield whole[start:stop]

    return spans()


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
    shape = payload_shape(payload)
    if tuple(decoded.shape) != shape:
        raise ValueError(f"decoded shape {tuple(decoded.shape)} is not the payload's {shape}")
    bound = ErrorBound(payload)
    bound.add(decoded.reshape(-1))
    return bound.value


class ErrorBound:
    """`error_bound(payload, decoded)` with `decoded`'s flattened values `add`ed in order, in spans of
    any length (the values of a block split between two spans wait for the rest); `value` once all
    are in. ValueError from `add` for a block no honest encoder made, as `error_bound` raises it."""

    def __init__(self, payload: bytes) -> None:
        codec_id, shape, offset = _read_header(payload)
        self._codec, self._numel, self._seen = codec_id, math.prod(shape), 0
        self._squares, self._peak = 0.0, 0.0  # fp16: Σ x² in float64, max |x|
        if codec_id not in (_ID_INT8, _ID_INT4):
            return
        self._qmax = Int8Codec._qmax if codec_id == _ID_INT8 else Int4Codec._qmax
        self._block = block = _read_u32(payload, offset)
        nblocks = -(-self._numel // block)
        self._absmax = torch.from_numpy(
            np.frombuffer(payload, dtype="<f4", count=nblocks, offset=offset + _U32.size).astype(np.float32)
        )
        self._finite = bool(torch.isfinite(self._absmax).all())
        self._carry = torch.empty(0)  # the values of a block that the next span completes

    def add(self, flat: torch.Tensor) -> None:
        self._seen += flat.numel()
        if self._codec == _ID_FP16:
            self._squares += float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
            self._peak = max(self._peak, float(flat.abs().max()) if flat.numel() else 0.0)
        if self._codec not in (_ID_INT8, _ID_INT4) or not self._finite:
            return
        block = self._block
        if self._carry.numel():
            flat = torch.cat([self._carry, flat])
        done = self._seen - flat.numel()  # values before `flat`: whole blocks
        whole = flat.numel() if self._seen == self._numel else flat.numel() // block * block
        self._carry = flat[whole:].clone()
        first = done // block
        largest = _block_absmax(flat[:whole], block)
        absmax = self._absmax[first : first + len(largest)]
        # ±qmax · absmax / qmax comes back within a rounding of absmax (for 1 % of values, not exactly).
        if bool(((largest - absmax).abs() > absmax * 2.0**-22).any()):
            raise ValueError("a block's largest value is not its absmax: no honest encoder made this payload")

    @property
    def value(self) -> Rounding | None:
        if self._seen != self._numel:
            raise ValueError(f"{self._seen} values of a payload of {self._numel}")
        if self._codec == _ID_NONE:
            return Rounding(0.0, 0.0)
        if self._codec == _ID_FP16:
            return Rounding(
                _FP16_RELATIVE * math.sqrt(self._squares) + _FP16_SUBNORMAL * math.sqrt(self._numel),
                _FP16_RELATIVE * self._peak + _FP16_SUBNORMAL,
            )
        if self._codec not in (_ID_INT8, _ID_INT4):
            return None
        if not self._finite:
            return Rounding(math.inf, math.inf)
        nblocks = len(self._absmax)
        counts = torch.full((nblocks,), float(self._block), dtype=torch.float64)
        counts[-1] = self._numel - self._block * (nblocks - 1)
        half_steps = self._absmax.to(torch.float64) / (2 * self._qmax)
        return Rounding(math.sqrt(float((counts * half_steps.square()).sum())), float(half_steps.max()))
