"""Pseudo-gradient codecs: self-describing byte payloads that `decode` inverts, whoever encoded them.

A peer compresses each tensor of its pseudo-gradient with a `Codec` into real `bytes`, so
`len(payload)` is exactly what goes on the wire and `Codec.wire_bytes` predicts it from the shape
alone. Every payload starts with a header (magic, version, codec id, shape, codec parameters), so
`decode` reconstructs a float32 tensor whichever codec the sender chose: `none` (fp32), `fp16`,
blockwise `int8` / `int4` (symmetric, one fp32 absmax per block of 64 values), PowerSGD-style
`lowrank:R` (one warm-started power iteration, factors quantized by a dense codec), and
SparseLoCo-style `sparse:K/C:B` (the K largest of every C values, B-bit values). `make_codec`
builds one from its spec; error feedback lives in `feedback`, the adaptive choice in `adaptive`.
A `sum` payload (`sum_payload`) carries weighted payloads of one shape whole, decoding to their
weighted sum: how an owner's average of sparse contributions can travel (`downlink`).
`payload_shape` checks a payload as `decode` does without decoding it, so that a receiver can
validate on arrival and decode once, when it uses the values.

Encoding and decoding are vectorized numpy/torch passes over steps of whole blocks (`_spans`), so
that the temporaries of a step stay in the CPU cache, and each payload is assembled with a single
copy; outputs are allocated by numpy, whose large allocations the kernel can back with huge pages.
"""

from __future__ import annotations

import abc
import math
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

MAGIC = b"AC"
VERSION = 1
DEFAULT_BLOCK_SIZE = 64
_STEP = 1 << 16
"""Values per step of the vectorized loops (256 kB of float32): the three or four passes of a step
run over data in the L2 cache, not over whole tensors in memory. On the development machine (1 MB
of L2 per core) steps of 2**15 to 2**18 values were within 6% of each other, 2**14 10-20% slower."""

# Wire format (all little-endian):
#
#     header  = b"AC" | version u8 | codec id u8 | ndim u8 | ndim x u32 dims
#     none    = header | numel x f32
#     fp16    = header | numel x f16
#     int8    = header | block u32 | nblocks x f32 absmax | numel x i8
#     int4    = header | block u32 | nblocks x f32 absmax | ceil(numel/2) x u8 (two nibbles, q+8,
#               first value in the low nibble)
#     lowrank = header | rank u32 | len(P) u32 | P payload | Q payload
#               (P, Q: dense payloads of shapes (rank, m) and (rank, n); tensor = P.T @ Q)
#     sparse  = header | chunk u32 | k u32 | bits u8 | nchunks x f32 lo | nchunks x f32 hi
#               | n x index (ceil(log2(chunk)) bits each) | n x value code (bits each)
#               (n = k per whole chunk + ceil(k * tail / chunk) for a partial last chunk of tail
#               values; indices within their chunk, strictly increasing; each bit array
#               little-endian, first value in the lowest bits, zero-padded to a whole byte)
#     sum     = header | count u32 | count x f32 factor | count x u32 length | the count payloads
#               (each a payload of this shape of any codec but sum; decodes to the sum of
#               factor x decode(payload), each product and sum rounded to float32, in order)
_ID_NONE, _ID_FP16, _ID_INT8, _ID_INT4, _ID_LOWRANK, _ID_SPARSE, _ID_SUM = range(7)
_PRODUCT_BLOCK = 1 << 18
"""float64 values per block of `low_rank_product` (2 MB): blocks of 2**15 were twice as slow, the
per-call overhead of the rank-1 updates dominating."""
_HEADER = struct.Struct("<2sBBB")
_U32 = struct.Struct("<I")
_LOWRANK_PARAMS = struct.Struct("<II")
_MAX_U32 = 2**32 - 1
_VALID_SPECS = (
    "none, fp16, int8, int4, lowrank:R, lowrank:R:{none,fp16,int8,int4} (R >= 1),"
    " sparse, sparse:K/C, sparse:K/C:B (1 <= K <= C <= 2**24, 1 <= B <= 8)"
)


class Codec(abc.ABC):
    """Turns one float tensor into a self-describing payload that `decode` inverts (lossily).

    Non-finite input never crashes an encoder and is never hidden: `none` and `fp16` carry NaN/inf
    through (fp16 also turns |x| > 65504 into inf); `int8`/`int4` decode every block holding a NaN
    or inf to all-NaN, `sparse` every such chunk; `lowrank` decodes the whole tensor to NaN and
    leaves its warm start untouched. Rejecting such payloads is the validator's job, not the codec's.
    """

    name: str

    @abc.abstractmethod
    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` (any float dtype/device); `key` names it for codecs that keep state."""

    @abc.abstractmethod
    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact `len(self.encode(key, t))` for any tensor `t` of this shape."""

    def answer_bytes(self, shape: tuple[int, ...], contribution_bytes: int, members: int) -> int:
        """At most how long an owner's answer for a part of `shape` is, in a group of `members` whose
        payloads of it are `contribution_bytes` long: the average encoded by this codec, or a single
        contribution forwarded as it came."""
        return max(contribution_bytes, self.wire_bytes(shape))

    def for_part(self, key: str) -> Codec:
        """The codec that encodes part `key`: this one (a router of parts to their owners' codecs
        answers the owner's)."""
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What the codec carries from one encode to the next (nothing, but for low-rank warm starts)."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore a `state_dict`; ValueError, the codec unchanged, for a state it cannot hold."""
        if state:
            raise ValueError(f"codec {self.name} keeps no state, got {sorted(state)[:3]}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# --- header -------------------------------------------------------------------------------------


def _header(codec_id: int, shape: tuple[int, ...]) -> bytes:
    if len(shape) > 255 or any(not 0 <= d <= _MAX_U32 for d in shape):
        raise ValueError(f"shape {shape} cannot be encoded (ndim <= 255, dims < 2**32)")
    return _HEADER.pack(MAGIC, VERSION, codec_id, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)


def _header_size(shape: tuple[int, ...]) -> int:
    return _HEADER.size + 4 * len(shape)


def _read_header(payload: bytes) -> tuple[int, tuple[int, ...], int]:
    """Return (codec id, shape, offset of the body)."""
    if len(payload) < _HEADER.size:
        raise ValueError(f"payload of {len(payload)} bytes is shorter than a codec header")
    magic, version, codec_id, ndim = _HEADER.unpack_from(payload, 0)
    if magic != MAGIC:
        raise ValueError(f"bad payload magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"unsupported payload version {version}, this peer speaks {VERSION}")
    end = _HEADER.size + 4 * ndim
    if len(payload) < end:
        raise ValueError(f"payload truncated inside its header ({len(payload)} < {end} bytes)")
    shape = struct.unpack_from(f"<{ndim}I", payload, _HEADER.size)
    return codec_id, tuple(shape), end


def _check_length(payload: bytes, expected: int) -> None:
    if len(payload) != expected:
        raise ValueError(
            f"payload is {len(payload)} bytes, its header implies {expected} (truncated/corrupt)"
        )


def _read_u32(payload: bytes, offset: int) -> int:
    if len(payload) < offset + _U32.size:
        raise ValueError("payload truncated inside its codec parameters")
    (value,) = _U32.unpack_from(payload, offset)
    return int(value)


def to_cpu_float(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a detached, contiguous float32 CPU tensor, copied only where it was not one."""
    return tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _step(block: int) -> int:
    """Values per step for blocks of `block` values: an even number of whole blocks, about `_STEP`.

    Even, so that no int4 byte (two values) straddles two steps.
    """
    return block * 2 * max(1, _STEP // (2 * block))


def _spans(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges covering `numel` values in steps of `_step(block)` values."""
    step = _step(block)
    for start in range(0, numel, step):
        yield start, min(start + step, numel)


def _little_endian(array: npt.NDArray[np.generic], dtype: str) -> memoryview:
    """`array`'s bytes in the wire's little-endian `dtype` (no copy on a little-endian host)."""
    return np.ascontiguousarray(array.reshape(-1), dtype=dtype).data.cast("B")


# --- dense codecs -------------------------------------------------------------------------------


class NoneCodec(Codec):
    """Raw float32: lossless baseline, 4 bytes per value."""

    name = "none"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` losslessly as little-endian float32."""
        flat = to_cpu_float(tensor)
        return b"".join((_header(_ID_NONE, tuple(flat.shape)), _little_endian(flat.numpy(), "<f4")))

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 4 bytes per value."""
        return _header_size(shape) + 4 * math.prod(shape)


class Fp16Codec(Codec):
    """IEEE half precision: 2 bytes per value, relative error about 2**-11."""

    name = "fp16"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` as little-endian float16 (round to nearest)."""
        flat = to_cpu_float(tensor)
        # torch converts, numpy allocates: numpy's float16 conversion is ~10x slower than torch's.
        half = np.empty(flat.numel(), dtype=np.float16)
        torch.from_numpy(half).copy_(flat.reshape(-1))
        return b"".join((_header(_ID_FP16, tuple(flat.shape)), _little_endian(half, "<f2")))

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 2 bytes per value."""
        return _header_size(shape) + 2 * math.prod(shape)


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
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], numel: int
    ) -> npt.NDArray[np.generic]:
        """The data bytes of `numel` values quantized by `_quantized_spans`."""

    @staticmethod
    @abc.abstractmethod
    def _data_bytes(numel: int) -> int: ...

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Quantize `tensor` blockwise; each block stores its fp32 absmax."""
        flat = to_cpu_float(tensor)
        values = flat.reshape(-1)
        absmax = _block_absmax(values, self.block_size).numpy()
        spans = _quantized_spans(values.numpy(), absmax, self.block_size, self._qmax)
        data = self._pack(spans, values.numel())
        header = _header(self._codec_id, tuple(flat.shape)) + _U32.pack(self.block_size)
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
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], numel: int
    ) -> npt.NDArray[np.generic]:
        data = np.empty(numel, dtype=np.int8)
        for start, stop, q in spans:
            data[start:stop] = q
        return data

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
    def _pack(
        spans: Iterator[tuple[int, int, npt.NDArray[np.float32]]], numel: int
    ) -> npt.NDArray[np.generic]:
        data = np.empty((numel + 1) // 2, dtype=np.uint8)
        pairs = np.empty(0, dtype=np.int8)
        for start, stop, q in spans:
            n = stop - start
            if pairs.size < n + 1:  # the first step (it is the largest)
                pairs = np.empty(n + 1, dtype=np.int8)
            pairs[:n] = q
            pairs[n] = 0  # an odd last value pairs with q = 0 (nibble 8)
            m = (n + 1) // 2
            np.take(
                _INT4_PACK, pairs[: 2 * m].view("<u2"), out=data[start // 2 : start // 2 + m], mode="clip"
            )
        return data

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


# --- low rank -----------------------------------------------------------------------------------


class LowRankCodec(Codec):
    """PowerSGD-style rank-r approximation M ≈ P Qᵀ with a warm-started Q per key.

    A tensor is viewed as M of shape (shape[0], prod(shape[1:])). Each encode runs one power
    iteration from the previous Q for this key (Vogels et al. 2019, arXiv 1905.13727):
    P = orth(M Q), Q = Mᵀ P, and sends P and Q through the dense `factor` codec. The first Q for a
    key is drawn (uniform in [-1, 1)) from a generator seeded by (`seed`, key), so two fresh
    instances encode the same input to identical bytes. Tensors with ndim <= 1, or for which the
    factors would not save at least `min_compression_ratio` of the values (hivemind's PowerSGD
    rule), are encoded densely with the factor codec instead; the rank is capped at min(m, n).
    """

    def __init__(
        self, rank: int, *, factor: Codec | None = None, min_compression_ratio: float = 0.5, seed: int = 0
    ) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        factor = Int8Codec() if factor is None else factor
        if isinstance(factor, LowRankCodec):
            raise ValueError("the factor codec of a low-rank codec must be dense")
        self.rank = rank
        self.factor = factor
        self.min_compression_ratio = min_compression_ratio
        self.seed = seed
        self.name = f"lowrank:{rank}" if factor.name == "int8" else f"lowrank:{rank}:{factor.name}"
        self._warm_q: dict[str, torch.Tensor] = {}

    def plan(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(m, n, rank) if `shape` is sent low-rank, None if it falls back to the dense factor codec."""
        if len(shape) < 2:
            return None
        m, n = shape[0], math.prod(shape[1:])
        rank = min(self.rank, m, n)
        if rank == 0 or rank * (m + n) >= (1.0 - self.min_compression_ratio) * m * n:
            return None
        return m, n, rank

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """One warm-started power iteration, then P and Q through the factor codec."""
        flat = to_cpu_float(tensor)
        shape = tuple(flat.shape)
        plan = self.plan(shape)
        if plan is None:
            return self.factor.encode(key, flat)
        m, n, rank = plan
        matrix = flat.reshape(m, n)
        if bool(torch.isfinite(matrix).all()):
            p, q = self._power_step(key, matrix, rank)
        else:
            p, q = torch.full((m, rank), math.nan), torch.full((n, rank), math.nan)
        # Factors go column-major so each quantization block lies inside one singular vector.
        p_bytes = self.factor.encode(f"{key}/P", p.T.contiguous())
        q_bytes = self.factor.encode(f"{key}/Q", q.T.contiguous())
        return _header(_ID_LOWRANK, shape) + _LOWRANK_PARAMS.pack(rank, len(p_bytes)) + p_bytes + q_bytes

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header, rank, both factor payloads; or the dense factor payload on fallback."""
        plan = self.plan(shape)
        if plan is None:
            return self.factor.wire_bytes(shape)
        m, n, rank = plan
        factors = self.factor.wire_bytes((rank, m)) + self.factor.wire_bytes((rank, n))
        return _header_size(shape) + _LOWRANK_PARAMS.size + factors

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Warm-start Q (n × rank) per key, for checkpoints."""
        return {key: q.clone() for key, q in self._warm_q.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore warm starts saved by `state_dict`; ValueError, nothing changed, if one is no matrix."""
        for key, q in state.items():
            if not (isinstance(key, str) and isinstance(q, torch.Tensor) and q.ndim == 2):
                raise ValueError(f"low-rank warm start {key!r} is not a matrix")
            if not q.is_floating_point():
                raise ValueError(f"low-rank warm start {key!r} has dtype {q.dtype}")
        self._warm_q = {key: to_cpu_float(q).clone() for key, q in state.items()}

    def _power_step(self, key: str, matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.linalg.qr(matrix @ self._initial_q(key, matrix.shape[1], rank)).Q
        q = matrix.T @ p
        self._warm_q[key] = q
        return p, q

    def _initial_q(self, key: str, n: int, rank: int) -> torch.Tensor:
        previous = self._warm_q.get(key)
        if previous is not None and tuple(previous.shape) == (n, rank):
            return previous
        # crc32, not hash(): Python string hashes are salted per process. Uniform on a grid of 2**-23
        # from integers, not torch.randn: randn's vectorized kernels draw other values than its
        # scalar one (ATEN_CPU_CAPABILITY=default), and every member of a group encodes with a fresh
        # codec in the adaptive choice, which must come out the same on all of them (issue 9 §3).
        rng = np.random.default_rng((self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
        grid = rng.integers(-(2**23), 2**23, size=(n, rank), dtype=np.int32)
        return torch.from_numpy(grid.astype(np.float32) * np.float32(2**-23))


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


# --- decode -------------------------------------------------------------------------------------
#
# A reader checks a payload whole (header, codec parameters, exact length, low-rank factors) and
# returns the function that builds its tensor, which checks nothing more: `payload_shape` runs the
# checks alone, `decode` both, so a payload that passed one passes the other.

_Build = Callable[[], torch.Tensor]
_Reader = Callable[[bytes, tuple[int, ...], int], _Build]


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


def _read_lowrank(payload: bytes, shape: tuple[int, ...], offset: int) -> _Build:
    if len(shape) < 2:
        raise ValueError(f"corrupt low-rank payload: shape {shape} has fewer than 2 dims")
    if len(payload) < offset + _LOWRANK_PARAMS.size:
        raise ValueError("payload truncated inside its low-rank parameters")
    rank, p_len = _LOWRANK_PARAMS.unpack_from(payload, offset)
    p_at = offset + _LOWRANK_PARAMS.size
    if len(payload) < p_at + p_len:
        raise ValueError("payload truncated inside its P factor")
    p_shape, build_p = _read(payload[p_at : p_at + p_len], _DENSE_READERS)
    q_shape, build_q = _read(payload[p_at + p_len :], _DENSE_READERS)
    m, n = shape[0], math.prod(shape[1:])
    if p_shape != (rank, m) or q_shape != (rank, n):
        raise ValueError(f"corrupt low-rank payload: factors {p_shape}, {q_shape} for {shape}")
    return lambda: low_rank_product(build_p(), build_q()).reshape(shape)


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


def low_rank_product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Pᵀ Q for factors P (rank, m) and Q (rank, n), the same bits on every CPU and BLAS.

    A float32 matrix product sums the rank terms in an order, and with or without FMA, that the
    BLAS picks per CPU (MKL_CBWR=COMPATIBLE alone changes the result), so every member decoding the
    same average would hold a different θ (issue 9 §3). Here each product of two float32 values is
    exact in float64, the terms are added in rank order in float64, and the sum rounds to float32
    once (float64 products being exact, fused or not is the same). A few times slower than sgemm:
    the 124M model's embedding at rank 32 took 0.4 s against 0.13 s on one thread.
    """
    rank, m = p.shape
    n = q.shape[1]
    out = torch.empty(m, n)
    if rank == 0 or m == 0 or n == 0:
        return out.zero_()
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    rows = max(1, _PRODUCT_BLOCK // n)
    acc = torch.empty(min(rows, m), n, dtype=torch.float64)
    for start in range(0, m, rows):
        stop = min(start + rows, m)
        block = acc[: stop - start]
        torch.outer(p64[0, start:stop], q64[0], out=block)
        for k in range(1, rank):
            block.addcmul_(p64[k, start:stop, None], q64[k, None, :])
        out[start:stop] = block
    return out


_DENSE_READERS: dict[int, _Reader] = {
    _ID_NONE: _read_none,
    _ID_FP16: _read_fp16,
    _ID_INT8: _blockwise_reader(Int8Codec._qmax, Int8Codec._data_bytes, _int8_into),
    _ID_INT4: _blockwise_reader(Int4Codec._qmax, Int4Codec._data_bytes, _int4_into),
}
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


_READERS = {**_SINGLE_READERS, _ID_SUM: _read_sum}


def _read(payload: bytes, readers: Mapping[int, _Reader]) -> tuple[tuple[int, ...], _Build]:
    codec_id, shape, offset = _read_header(payload)
    reader = readers.get(codec_id)
    if reader is None:
        raise ValueError(f"unknown or misplaced codec id {codec_id} in payload")
    return shape, reader(payload, shape, offset)


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


# --- specs and dict helpers ---------------------------------------------------------------------

_DENSE_CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}
_LOWRANK_SPEC = re.compile(r"lowrank:([1-9][0-9]*)(?::(none|fp16|int8|int4))?")
_SPARSE_SPEC = re.compile(r"sparse(?::([1-9][0-9]*)/([1-9][0-9]*)(?::([1-8]))?)?")


def make_codec(spec: str) -> Codec:
    """Build a fresh codec from a spec such as "int8", "lowrank:4" (int8 factors), "lowrank:4:fp16",
    or "sparse:64/4096:2" (top 64 of every 4096 values, 2-bit values; "sparse" alone is that one)."""
    if spec in _DENSE_CODECS:
        return _DENSE_CODECS[spec]()
    match = _LOWRANK_SPEC.fullmatch(spec)
    if match is not None:
        return LowRankCodec(int(match.group(1)), factor=_DENSE_CODECS[match.group(2) or "int8"]())
    match = _SPARSE_SPEC.fullmatch(spec)
    if match is not None and match.group(1) is None:
        return SparseCodec()
    if match is not None and int(match.group(1)) <= int(match.group(2)) <= _MAX_SPARSE_CHUNK:
        return SparseCodec(int(match.group(1)), int(match.group(2)), int(match.group(3) or 2))
    raise ValueError(f"unknown codec spec {spec!r}; valid: {_VALID_SPECS}")


def encode_tensors(codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """Encode every tensor of a dict with `codec`, keyed by name."""
    return {key: codec.encode(key, tensor) for key, tensor in tensors.items()}


def decode_tensors(payloads: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """Decode every payload of a dict."""
    return {key: decode(payload) for key, payload in payloads.items()}


def wire_bytes_of(payloads: Mapping[str, bytes]) -> int:
    """Total bytes on the wire for a dict of payloads."""
    return sum(len(payload) for payload in payloads.values())
