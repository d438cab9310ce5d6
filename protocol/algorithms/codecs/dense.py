"""The dense codecs, every value sent: `none` (fp32), `fp16`, and blockwise `int8` / `int4`
(symmetric, one fp32 absmax per block of 64 values); their readers (`_DENSE_READERS`) also read
the factors of a low-rank payload.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import numpy.typing as npt
import torch

from .frame import (
    _ID_FP16,
    _ID_INT4,
    _ID_INT8,
    _ID_NONE,
    _MAX_U32,
    _STEP,
    _U32,
    DEFAULT_BLOCK_SIZE,
    SPAN,
    Codec,
    _Build,
    _check_length,
    _header,
    _header_size,
    _little_endian,
    _read_header,
    _read_u32,
    _Reader,
    _spans,
    _step,
    to_cpu_float,
)

# --- dense codecs -------------------------------------------------------------------------------


class NoneCodec(Codec):
    """Raw float32: lossless baseline, 4 bytes per value."""

    name = "none"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` losslessly as little-endian float32."""
        flat = to_cpu_float(tensor)
        return b"".join((_header(_ID_NONE, tuple(flat.shape)), _little_endian(flat.numpy(), "<f4")))

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        """`encode` of the tensor the spans make up, span by span."""
        pieces = [_little_endian(to_cpu_float(span).numpy(), "<f4") for span in spans]
        _check_span_count(sum(len(p) for p in pieces) // 4, shape)
        return b"".join((_header(_ID_NONE, shape), *pieces))

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 4 bytes per value."""
        return _header_size(shape) + 4 * math.prod(shape)


class Fp16Codec(Codec):
    """IEEE half precision: 2 bytes per value, relative error about 2**-11."""

    name = "fp16"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` as little-endian float16 (round to nearest)."""
        flat = to_cpu_float(tensor)
        return b"".join((_header(_ID_FP16, tuple(flat.shape)), _little_endian(_half(flat), "<f2")))

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        """`encode` of the tensor the spans make up, span by span."""
        pieces = [_little_endian(_half(to_cpu_float(span)), "<f2") for span in spans]
        _check_span_count(sum(len(p) for p in pieces) // 2, shape)
        return b"".join((_header(_ID_FP16, shape), *pieces))

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 2 bytes per value."""
        return _header_size(shape) + 2 * math.prod(shape)


def _half(flat: torch.Tensor) -> npt.NDArray[np.float16]:
    """`flat`'s values as float16, round to nearest: torch converts, numpy allocates (numpy's float16
    conversion is ~10x slower than torch's)."""
    half = np.empty(flat.numel(), dtype=np.float16)
    torch.from_numpy(half).copy_(flat.reshape(-1))
    return half


def _check_span_count(count: int, shape: tuple[int, ...]) -> None:
    if count != math.prod(shape):
        raise ValueError(f"spans of {count} values for a tensor of shape {shape}")


def _block_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| of each block of the 1-d `flat` (NaN for a block holding one; the last block may be
    partial), as `abs().amax()` of the zero-padded blocks gives it."""
    numel = flat.numel()
    full = numel // block
    absmax = torch.empty(-(-numel // block))
    blocks = flat[: full * block].view(full, block)
    # Two reductions that only read, instead of abs() writing a temporary as large as the input.
    torch.maximum(torch.amax(blocks, dim=1), torch.amin(blocks, dim=1).neg_(), out=absmax[:full])
    if full * block < numel:
        absmax[full] = flat[full * block :].abs().amax()
    # A block of signed zeros can give -0.0 above where max |x| is 0.0, and amax's NaN has no fixed
    # bits: the wire carries 0.0 and the canonical NaN (0x7fc00000), as abs().amax() gave them.
    return absmax.abs_().masked_fill_(absmax.isnan(), math.nan)


def _quantized_spans(
    values: npt.NDArray[np.float32], absmax: npt.NDArray[np.float32], block: int, qmax: int
) -> Iterator[tuple[int, int, npt.NDArray[np.float32]]]:
    """(start, stop, q) per step of `_spans`: q = round(x / absmax * qmax) of its values as float32.

    Symmetric absmax quantization, half to even. Every q is the same buffer, overwritten by the
    next step.
    """
    # NaN fails `> 0`, so a NaN block divides by 1 and decodes as q * NaN; an inf block gives
    # inf/inf = NaN -> 0 and decodes as 0 * inf = NaN. Either way the block is visibly poisoned.
    safe = np.where(absmax > 0, absmax, np.float32(1.0))
    finite = np.isfinite(absmax)
    all_finite = bool(finite.all())
    scratch = np.empty(min(_step(block), values.size), dtype=np.float32)
    scale = np.float32(qmax)
    with np.errstate(invalid="ignore", over="ignore"):
        for start, stop in _spans(values.size, block):
            first, end = start // block, -(-stop // block)
            x, q = values[start:stop], scratch[: stop - start]
            full = x.size // block * block
            blocks = q[:full].reshape(-1, block)
            np.divide(x[:full].reshape(-1, block), safe[first : first + len(blocks), None], out=blocks)
            if full < x.size:  # a partial last block
                np.divide(x[full:], safe[end - 1], out=q[full:])
            np.multiply(q, scale, out=q)
            np.rint(q, out=q)
            # |x| <= absmax, so a finite block needs neither: |x / absmax| <= 1 holds after rounding.
            if not all_finite and not finite[first:end].all():
                np.nan_to_num(q, copy=False, nan=0.0)
                np.clip(q, -qmax, qmax, out=q)
            yield start, stop, q


class _BlockwiseCodec(Codec):
    """Shared encode/decode of the symmetric blockwise integer codecs."""

    _codec_id: int
    _qmax: int

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not 1 <= block_size <= _MAX_U32:
            raise ValueError(f"block_size must be in [1, 2**32), got {block_size}")
        self.block_size = block_size

    @staticmethod
    @abc.abstractmethod
    def _data(numel: int) -> npt.NDArray[np.generic]:
        """An array for the data bytes of `numel` values."""

    @staticmethod
    @abc.abstractmethod
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], data: npt.NDArray[np.generic], at: int
    ) -> None:
        """Write values quantized by `_quantized_spans` into `data`, the first at value `at` (even)."""

    @staticmethod
    @abc.abstractmethod
    def _data_bytes(numel: int) -> int: ...

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Quantize `tensor` blockwise; each block stores its fp32 absmax."""
        flat = to_cpu_float(tensor)
        values = flat.reshape(-1)
        absmax = _block_absmax(values, self.block_size).numpy()
        data = self._data(values.numel())
        self._pack(_quantized_spans(values.numpy(), absmax, self.block_size, self._qmax), data, 0)
        return self._join(tuple(flat.shape), absmax, data)

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        """`encode` of the tensor the spans make up, span by span: its blocks never straddle two
        spans (`SPAN` is a multiple of the block), so each is quantized as the whole tensor's is."""
        block = self.block_size
        if SPAN % block:
            return super().encode_spans(key, shape, spans)
        numel = math.prod(shape)
        absmax = np.empty(-(-numel // block), dtype=np.float32)
        data = self._data(numel)
        at = 0
        for span in spans:
            values = to_cpu_float(span).reshape(-1)
            n = values.numel()
            if at + n > numel:
                raise ValueError(f"spans of more than {numel} values for a tensor of shape {shape}")
            if n % block and at + n != numel:
                raise ValueError(f"a span of {n} values, not whole blocks of {block}")
            scales = _block_absmax(values, block).numpy()
            absmax[at // block : at // block + len(scales)] = scales
            self._pack(_quantized_spans(values.numpy(), scales, block, self._qmax), data, at)
            at += n
        _check_span_count(at, shape)
        return self._join(shape, absmax, data)

    def _join(
        self, shape: tuple[int, ...], absmax: npt.NDArray[np.float32], data: npt.NDArray[np.generic]
    ) -> bytes:
        header = _header(self._codec_id, shape) + _U32.pack(self.block_size)
        return b"".join((header, _little_endian(absmax, "<f4"), data.data.cast("B")))

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header, block size, one fp32 scale per block and the packed values."""
        numel = math.prod(shape)
        nblocks = -(-numel // self.block_size)
        return _header_size(shape) + _U32.size + 4 * nblocks + self._data_bytes(numel)


class Int8Codec(_BlockwiseCodec):
    """Blockwise int8 in [-127, 127]: 1 byte per value plus 4 bytes per block."""

    name = "int8"
    _codec_id = _ID_INT8
    _qmax = 127

    @staticmethod
    def _data(numel: int) -> npt.NDArray[np.generic]:
        return np.empty(numel, dtype=np.int8)

    @staticmethod
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], data: npt.NDArray[np.generic], at: int
    ) -> None:
        for start, stop, q in spans:
            data[at + start : at + stop] = q

    @staticmethod
    def _data_bytes(numel: int) -> int:
        return numel


# int4 nibble tables, one lookup per pair of values instead of strided nibble arithmetic. Pack: the
# little-endian u16 of a pair of int8 values (q0, q1) -> the byte (q0 + 8) | (q1 + 8) << 4. Unpack: a
# byte -> the float32 pair (low nibble - 8, high nibble - 8), as one native u64.
_PAIRS = np.arange(1 << 16)
_INT4_PACK = (((_PAIRS + 8) & 0x0F) | ((((_PAIRS >> 8) + 8) & 0x0F) << 4)).astype(np.uint8)
_BYTES = np.arange(1 << 8)
_INT4_UNPACK = (
    np.stack([(_BYTES & 0x0F) - 8, (_BYTES >> 4) - 8], axis=1).astype(np.float32).view(np.uint64)[:, 0]
)


class Int4Codec(_BlockwiseCodec):
    """Blockwise int4 in [-7, 7], two values per byte, plus 4 bytes per block."""

    name = "int4"
    _codec_id = _ID_INT4
    _qmax = 7

    @staticmethod
    def _data(numel: int) -> npt.NDArray[np.generic]:
        return np.empty((numel + 1) // 2, dtype=np.uint8)

    @staticmethod
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], data: npt.NDArray[np.generic], at: int
    ) -> None:
        pairs = np.empty(0, dtype=np.int8)
        for start, stop, q in spans:
            n = stop - start
            if pairs.size < n + 1:  # the first step (it is the largest)
                pairs = np.empty(n + 1, dtype=np.int8)
            pairs[:n] = q
            pairs[n] = 0  # an odd last value pairs with q = 0 (nibble 8)
            m, first = (n + 1) // 2, (at + start) // 2
            np.take(_INT4_PACK, pairs[: 2 * m].view("<u2"), out=data[first : first + m], mode="clip")

    @staticmethod
    def _data_bytes(numel: int) -> int:
        return (numel + 1) // 2


def _int8_into(
    payload: bytes, offset: int, numel: int, block: int, out: npt.NDArray[np.float32]
) -> Iterator[tuple[int, int]]:
    """Write the int8 values of each step of `_spans` into `out` as float32; yield the step."""
    q = np.frombuffer(payload, dtype=np.int8, count=numel, offset=offset)
    for start, stop in _spans(numel, block):
        out[start:stop] = q[start:stop]
        yield start, stop


def _int4_into(
    payload: bytes, offset: int, numel: int, block: int, out: npt.NDArray[np.float32]
) -> Iterator[tuple[int, int]]:
    """Write the int4 values of each step of `_spans` into `out` as float32; yield the step.

    `out` needs room for an even number of values: the last byte of an odd count decodes a pair.
    """
    packed = np.frombuffer(payload, dtype=np.uint8, count=(numel + 1) // 2, offset=offset)
    pairs = out[: 2 * packed.size].view(np.uint64)
    for start, stop in _spans(numel, block):
        at, end = start // 2, (stop + 1) // 2
        np.take(_INT4_UNPACK, packed[at:end], out=pairs[at:end], mode="clip")
        yield start, stop


# --- readers ------------------------------------------------------------------------------------


def _read_none(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
    numel = math.prod(shape)
    _check_length(payload, offset + 4 * numel)

    def build() -> torch.Tensor:
        values = np.frombuffer(payload, dtype="<f4", count=numel, offset=offset).astype(np.float32)
        return torch.from_numpy(values).reshape(shape)

    return build


def _read_fp16(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
    numel = math.prod(shape)
    _check_length(payload, offset + 2 * numel)

    def build() -> torch.Tensor:
        half = np.frombuffer(payload, dtype="<f2", count=numel, offset=offset)
        out = np.empty(numel, dtype=np.float32)
        # torch converts (numpy's float16 conversion is ~10x slower), but only from writable memory:
        # each step is copied out of the read-only payload first, in cache.
        staging = np.empty(min(numel, _STEP), dtype=np.float16)
        out_t, staging_t = torch.from_numpy(out), torch.from_numpy(staging)
        for start, stop in _spans(numel, 1):
            np.copyto(staging[: stop - start], half[start:stop])
            out_t[start:stop].copy_(staging_t[: stop - start])
        return out_t.reshape(shape)

    return build


_Unpack = Callable[[bytes, int, int, int, npt.NDArray[np.float32]], Iterator[tuple[int, int]]]


def _blockwise_reader(qmax: int, data_bytes: Callable[[int], int], unpack: _Unpack) -> _Reader:
    def read_blockwise(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
        block = _read_u32(payload, offset)
        if block == 0:
            raise ValueError("corrupt payload: block size 0")
        numel = math.prod(shape)
        nblocks = -(-numel // block)
        scales_at = offset + _U32.size
        data_at = scales_at + 4 * nblocks
        _check_length(payload, data_at + data_bytes(numel))

        def build() -> torch.Tensor:
            absmax = np.frombuffer(payload, dtype="<f4", count=nblocks, offset=scales_at).astype(np.float32)
            out = np.empty(numel + 1, dtype=np.float32)  # one spare for int4's last pair
            with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf = NaN is the point
                for start, stop in unpack(payload, data_at, numel, block, out):
                    _dequantize(out[start:stop], absmax[start // block :], block, qmax)
            return torch.from_numpy(out[:numel]).reshape(shape)

        return build

    return read_blockwise


def _dequantize(
    values: npt.NDArray[np.float32], absmax: npt.NDArray[np.float32], block: int, qmax: int
) -> None:
    """values = q * absmax / qmax in place, blockwise: in that order, so that q = ±qmax decodes to
    exactly ±absmax."""
    full = values.size // block * block
    blocks = values[:full].reshape(-1, block)
    np.multiply(blocks, absmax[: full // block, None], out=blocks)
    if full < values.size:  # a partial last block
        np.multiply(values[full:], absmax[full // block], out=values[full:])
    np.divide(values, np.float32(qmax), out=values)


_Span = Callable[[int, int], torch.Tensor]


def dense_span(payload: bytes) -> tuple[tuple[int, ...], _Span] | None:
    """For a dense payload (none, fp16, int8, int4) that its reader has checked: its shape, and the
    function that decodes values [start, stop) of its flattened tensor, bit for bit what the whole
    decode holds there, reading only their bytes and their blocks' scales. None for any other."""
    codec_id, shape, offset = _read_header(payload)
    if codec_id == _ID_NONE:

        def none(start: int, stop: int) -> torch.Tensor:
            values = np.frombuffer(payload, dtype="<f4", count=stop - start, offset=offset + 4 * start)
            return torch.from_numpy(values.astype(np.float32))

        return shape, none
    if codec_id == _ID_FP16:

        def half(start: int, stop: int) -> torch.Tensor:
            values = np.frombuffer(payload, dtype="<f2", count=stop - start, offset=offset + 2 * start)
            return torch.from_numpy(values.copy()).float()  # torch converts from writable memory only

        return shape, half
    if codec_id not in (_ID_INT8, _ID_INT4):
        return None
    int8 = codec_id == _ID_INT8
    qmax = Int8Codec._qmax if int8 else Int4Codec._qmax
    block = _read_u32(payload, offset)
    scales_at = offset + _U32.size
    data_at = scales_at + 4 * -(-math.prod(shape) // block)

    def blockwise(start: int, stop: int) -> torch.Tensor:
        first = start - start % block  # from the start of its block: dequantized blockwise
        count = stop - first
        absmax = np.frombuffer(
            payload,
            dtype="<f4",
            count=-(-stop // block) - first // block,
            offset=scales_at + 4 * (first // block),
        ).astype(np.float32)
        if int8:
            values = np.frombuffer(payload, dtype=np.int8, count=count, offset=data_at + first).astype(
                np.float32
            )
        else:  # the bytes holding values [first, stop), two values each
            low, high = first // 2, (stop + 1) // 2
            packed = np.frombuffer(payload, dtype=np.uint8, count=high - low, offset=data_at + low)
            pairs = np.empty(high - low, dtype=np.uint64)
            np.take(_INT4_UNPACK, packed, out=pairs, mode="clip")
            values = pairs.view(np.float32)[first - 2 * low : first - 2 * low + count]
        with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf = NaN is the point
            _dequantize(values, absmax, block, qmax)
        return torch.from_numpy(values[start - first :])

    return shape, blockwise


_DENSE_READERS: dict[int, _Reader] = {
    _ID_NONE: _read_none,
    _ID_FP16: _read_fp16,
    _ID_INT8: _blockwise_reader(Int8Codec._qmax, Int8Codec._data_bytes, _int8_into),
    _ID_INT4: _blockwise_reader(Int4Codec._qmax, Int4Codec._data_bytes, _int4_into),
}
