"""SparseLoCo-style `sparse:K/C:B`: the K largest of every C values, B-bit values; the selection,
quantization and bit packing of its encoder, and its reader.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt
import torch

from .frame import (
    _ID_SPARSE,
    _STEP,
    Codec,
    _Build,
    _check_length,
    _header,
    _header_size,
    _little_endian,
    to_cpu_float,
)

# --- sparse -------------------------------------------------------------------------------------

_SPARSE_PARAMS = struct.Struct("<IIB")
_MAX_SPARSE_CHUNK = 1 << 24
_SPARSE_STEP = 1 << 20
"""Values per step of the sparse encoder (whole chunks, at least one): its masks and magnitudes stay
a few MB, whatever the tensor."""


def _check_sparse(k: int, chunk: int, bits: int) -> None:
    if not (1 <= chunk <= _MAX_SPARSE_CHUNK and 1 <= k <= chunk and 1 <= bits <= 8):
        raise ValueError(
            f"sparse codec needs 1 <= k <= chunk <= 2**24 and 1 <= bits <= 8, got {k}/{chunk}:{bits}"
        )


class _SparseLayout:
    """Where everything of a sparse payload of `numel` values lies: chunks, entries, bit widths."""

    def __init__(self, numel: int, chunk: int, k: int, bits: int) -> None:
        self.chunk, self.k, self.bits = chunk, k, bits
        self.full, self.tail = divmod(numel, chunk)
        self.tail_k = -(-k * self.tail // chunk)  # the partial chunk keeps the density; 0 if none
        self.nchunks = self.full + (self.tail > 0)
        self.entries = self.full * k + self.tail_k
        self.index_bits = (chunk - 1).bit_length()
        self.index_bytes = -(-self.entries * self.index_bits // 8)
        self.code_bytes = -(-self.entries * bits // 8)

    def body_bytes(self) -> int:
        """Bytes after the codec parameters: the two scales per chunk and both bit arrays."""
        return 8 * self.nchunks + self.index_bytes + self.code_bytes


def _pack_bits(values: npt.NDArray[np.uint32], width: int) -> npt.NDArray[np.uint8]:
    """The low `width` bits of each value, concatenated little-endian, zero-padded to a byte.

    A step of `_STEP` values at a time (a multiple of 8: each starts on a byte), so that the
    temporaries (32 bytes a value) stay 2 MB.
    """
    out = np.zeros(-(-values.size * width // 8), dtype=np.uint8)
    for start in range(0, values.size if width else 0, _STEP):
        part = np.ascontiguousarray(values[start : start + _STEP], dtype="<u4").view(np.uint8)
        bits = np.unpackbits(part.reshape(-1, 4), axis=1, bitorder="little")[:, :width]
        packed = np.packbits(bits.reshape(-1), bitorder="little")
        out[start * width // 8 : start * width // 8 + packed.size] = packed
    return out


def _unpack_bits(payload: bytes, offset: int, count: int, width: int) -> npt.NDArray[np.uint32]:
    """Inverse of `_pack_bits`: `count` values of `width` bits from `payload` at `offset`."""
    out = np.zeros(count, dtype=np.uint32)
    raw = np.frombuffer(payload, dtype=np.uint8, count=-(-count * width // 8), offset=offset)
    bits = np.zeros((min(count, _STEP), 32), dtype=np.uint8)
    for start in range(0, count if width else 0, _STEP):
        n = min(_STEP, count - start)
        part = raw[start * width // 8 : -(-(start + n) * width // 8)]
        bits[:n, :width] = np.unpackbits(part, count=n * width, bitorder="little").reshape(n, width)
        out[start : start + n] = np.packbits(bits[:n], axis=1, bitorder="little").view("<u4").reshape(n)
    return out


def _top_k_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the indices (ascending) of its k largest |x|, ties taken lowest index first.

    NaN and inf count as the largest, so that a row holding one picks it and is poisoned (never
    hidden as an unsent value). The threshold, the k-th largest magnitude, is the same whoever
    computes it; `torch.topk`'s own choice among equal magnitudes is not specified, hence the
    explicit tie rule: same input, same bytes.
    """
    magnitude = rows.abs().nan_to_num_(nan=math.inf, posinf=math.inf)
    threshold = torch.topk(magnitude, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    chosen = magnitude >= threshold
    surplus = chosen.sum(dim=1) > k
    if bool(surplus.any()):  # ties at the threshold: keep the first ones
        above = magnitude > threshold
        ties = magnitude == threshold
        room = k - above.sum(dim=1, keepdim=True)
        chosen = above | (ties & (ties.cumsum(dim=1) <= room))
    return chosen.nonzero()[:, 1].view(rows.shape[0], k)


def _quantize_picked(picked: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, codes) of each row of selected values: sign and a (bits-1)-bit magnitude level.

    Magnitudes are quantized uniformly on [lo, hi], the row's smallest and largest |x|, into
    L = 2**(bits-1) intervals, each decoded at its midpoint: every value is within half an interval
    (hi - lo) / (2L) of its original. A row holding NaN or inf gets lo = hi = NaN and codes 0.
    """
    levels = 1 << (bits - 1)
    magnitude = picked.abs()
    lo, hi = magnitude.amin(dim=1), magnitude.amax(dim=1)
    span = hi - lo
    safe = torch.where(span > 0, span, torch.ones_like(span))
    level = (magnitude - lo[:, None]).div_(safe[:, None]).mul_(levels).floor_().clamp_(0, levels - 1)
    codes = level.to(torch.int32) + levels * (picked < 0).to(torch.int32)
    poisoned = ~torch.isfinite(picked).all(dim=1)
    if bool(poisoned.any()):
        lo[poisoned], hi[poisoned], codes[poisoned] = math.nan, math.nan, 0
    return lo, hi, codes


class SparseCodec(Codec):
    """SparseLoCo-style chunked top-k: of every `chunk` consecutive values, the `k` largest in
    magnitude, each as its index within the chunk and a `bits`-bit code; the others decode to 0.

    Defaults are the Covenant-72B run (SparseLoCo, arXiv 2508.15706): 64 of every 4096 values,
    12-bit indices, 2-bit values, meant to be sent through `feedback.ErrorFeedback`, which keeps
    what was not sent for the next round. A code is a sign and a (bits-1)-bit magnitude level
    uniform between the chunk's smallest and largest selected |x| (two fp32 per chunk): 136x less
    than fp32 at the defaults. SparseLoCo's own values are 4 levels of one per-tensor table (bin
    means of its selected values around their mean); its chunks are 64 x 64 tiles of a matrix, here
    runs of the flattened tensor, whose last one may be partial (it keeps ceil(k * len / chunk)).
    Same input, same bytes: ties in magnitude are taken lowest index first. A chunk holding NaN or
    inf decodes to all-NaN.
    """

    def __init__(self, k: int = 64, chunk: int = 4096, bits: int = 2) -> None:
        _check_sparse(k, chunk, bits)
        self.k, self.chunk, self.bits = k, chunk, bits
        self.name = f"sparse:{k}/{chunk}:{bits}"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Select, quantize and pack; one step of whole chunks at a time."""
        flat = to_cpu_float(tensor)
        values = flat.reshape(-1)
        layout = _SparseLayout(values.numel(), self.chunk, self.k, self.bits)
        indices = np.empty(layout.entries, dtype=np.uint32)
        codes = np.empty(layout.entries, dtype=np.uint32)
        lo = np.empty(layout.nchunks, dtype=np.float32)
        hi = np.empty(layout.nchunks, dtype=np.float32)
        step = max(1, _SPARSE_STEP // self.chunk)
        spans = [(a, min(a + step, layout.full), self.k) for a in range(0, layout.full, step)]
        if layout.tail:
            spans.append((layout.full, layout.full + 1, layout.tail_k))
        for first, stop, k in spans:
            rows = values[first * self.chunk : stop * self.chunk].view(stop - first, -1)
            picked_at = _top_k_rows(rows, k)
            row_lo, row_hi, row_codes = _quantize_picked(rows.gather(1, picked_at), self.bits)
            at = first * self.k
            indices[at : at + picked_at.numel()] = picked_at.reshape(-1).numpy()
            codes[at : at + picked_at.numel()] = row_codes.reshape(-1).numpy()
            lo[first:stop], hi[first:stop] = row_lo.numpy(), row_hi.numpy()
        header = _header(_ID_SPARSE, tuple(flat.shape)) + _SPARSE_PARAMS.pack(self.chunk, self.k, self.bits)
        return b"".join(
            (
                header,
                _little_endian(lo, "<f4"),
                _little_endian(hi, "<f4"),
                _pack_bits(indices, layout.index_bits).data.cast("B"),
                _pack_bits(codes, self.bits).data.cast("B"),
            )
        )

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header, parameters, two fp32 per chunk, the packed indices and codes."""
        layout = _SparseLayout(math.prod(shape), self.chunk, self.k, self.bits)
        return _header_size(shape) + _SPARSE_PARAMS.size + layout.body_bytes()


# --- reader -------------------------------------------------------------------------------------


def _read_sparse(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
    if len(payload) < offset + _SPARSE_PARAMS.size:
        raise ValueError("payload truncated inside its sparse parameters")
    chunk, k, bits = _SPARSE_PARAMS.unpack_from(payload, offset)
    try:
        _check_sparse(k, chunk, bits)
    except ValueError as e:
        raise ValueError(f"corrupt sparse payload: {e}") from None
    numel = math.prod(shape)
    layout = _SparseLayout(numel, chunk, k, bits)
    scales_at = offset + _SPARSE_PARAMS.size
    indices_at = scales_at + 8 * layout.nchunks
    _check_length(payload, indices_at + layout.index_bytes + layout.code_bytes)
    indices = _unpack_bits(payload, indices_at, layout.entries, layout.index_bits)
    _check_sparse_indices(indices, layout)

    def build() -> torch.Tensor:
        codes = _unpack_bits(payload, indices_at + layout.index_bytes, layout.entries, bits)
        scales = np.frombuffer(payload, dtype="<f4", count=2 * layout.nchunks, offset=scales_at)
        lo, hi = scales[: layout.nchunks].astype(np.float32), scales[layout.nchunks :].astype(np.float32)
        per_chunk = np.full(layout.nchunks, k, dtype=np.int64)
        if layout.tail:
            per_chunk[-1] = layout.tail_k
        owner = np.repeat(np.arange(layout.nchunks, dtype=np.int64), per_chunk)
        levels = 1 << (bits - 1)
        with np.errstate(invalid="ignore", over="ignore"):  # a NaN/inf chunk decodes to NaN
            step = (hi - lo) / np.float32(levels)
            level = (codes & (levels - 1)).astype(np.float32) + np.float32(0.5)
            value = lo[owner] + level * step[owner]
        np.negative(value, out=value, where=codes >= levels)
        out = np.zeros(numel, dtype=np.float32)
        out[owner * chunk + indices] = value
        poisoned = ~(np.isfinite(lo) & np.isfinite(hi))
        if poisoned.any():
            out[: layout.full * chunk].reshape(layout.full, chunk)[poisoned[: layout.full]] = math.nan
            if layout.tail and poisoned[-1]:
                out[layout.full * chunk :] = math.nan
        return torch.from_numpy(out).reshape(shape)

    return build


def _check_sparse_indices(indices: npt.NDArray[np.uint32], layout: _SparseLayout) -> None:
    """ValueError unless each chunk's indices strictly increase and stay inside the chunk (a
    partial last chunk is shorter): decode then writes only inside the declared shape."""
    parts = [(indices[: layout.full * layout.k].reshape(layout.full, layout.k), layout.chunk)]
    if layout.tail:
        parts.append((indices[layout.full * layout.k :].reshape(1, layout.tail_k), layout.tail))
    for rows, length in parts:
        if rows.size and (bool((rows[:, 1:] <= rows[:, :-1]).any()) or int(rows[:, -1].max()) >= length):
            raise ValueError("corrupt sparse payload: indices not increasing inside their chunk")
