"""Pseudo-gradient codecs: self-describing byte payloads that `decode` inverts, whoever encoded them.

A peer compresses each tensor of its pseudo-gradient with a `Codec` into real `bytes`, so
`len(payload)` is exactly what goes on the wire and `Codec.wire_bytes` predicts it from the shape
alone. Every payload starts with a header (magic, version, codec id, shape, codec parameters), so
`decode` reconstructs a float32 tensor whichever codec the sender chose: `none` (fp32), `fp16`,
blockwise `int8` / `int4` (symmetric, one fp32 absmax per block of 64 values), and PowerSGD-style
`lowrank:R` (one warm-started power iteration, factors quantized by a dense codec). `make_codec`
builds one from its spec; error feedback lives in `feedback`, the adaptive choice in `adaptive`.
"""

from __future__ import annotations

import abc
import math
import re
import struct
import zlib
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt
import torch

MAGIC = b"AC"
VERSION = 1
DEFAULT_BLOCK_SIZE = 64

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
_ID_NONE, _ID_FP16, _ID_INT8, _ID_INT4, _ID_LOWRANK = range(5)
_HEADER = struct.Struct("<2sBBB")
_U32 = struct.Struct("<I")
_LOWRANK_PARAMS = struct.Struct("<II")
_MAX_U32 = 2**32 - 1
_VALID_SPECS = "none, fp16, int8, int4, lowrank:R, lowrank:R:{none,fp16,int8,int4} (R >= 1)"


class Codec(abc.ABC):
    """Turns one float tensor into a self-describing payload that `decode` inverts (lossily).

    Non-finite input never crashes an encoder and is never hidden: `none` and `fp16` carry NaN/inf
    through (fp16 also turns |x| > 65504 into inf); `int8`/`int4` decode every block holding a NaN
    or inf to all-NaN; `lowrank` decodes the whole tensor to NaN and leaves its warm start
    untouched. Rejecting such payloads is the validator's job, not the codec's.
    """

    name: str

    @abc.abstractmethod
    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` (any float dtype/device); `key` names it for codecs that keep state."""

    @abc.abstractmethod
    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact `len(self.encode(key, t))` for any tensor `t` of this shape."""

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


def _from_numpy(array: npt.NDArray[np.generic], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)


# --- dense codecs -------------------------------------------------------------------------------


class NoneCodec(Codec):
    """Raw float32: lossless baseline, 4 bytes per value."""

    name = "none"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` losslessly as little-endian float32."""
        flat = to_cpu_float(tensor)
        return _header(_ID_NONE, tuple(flat.shape)) + flat.numpy().astype("<f4").tobytes()

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 4 bytes per value."""
        return _header_size(shape) + 4 * math.prod(shape)


class Fp16Codec(Codec):
    """IEEE half precision: 2 bytes per value, relative error about 2**-11."""

    name = "fp16"

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode `tensor` as little-endian float16 (round to nearest)."""
        flat = to_cpu_float(tensor)
        return _header(_ID_FP16, tuple(flat.shape)) + flat.to(torch.float16).numpy().astype("<f2").tobytes()

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Header plus 2 bytes per value."""
        return _header_size(shape) + 2 * math.prod(shape)


def _quantize_blocks(flat: torch.Tensor, block: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization: q = round(x / absmax * qmax) per block, half to even."""
    n = flat.numel()
    nblocks = -(-n // block)
    blocks = torch.nn.functional.pad(flat.reshape(-1), (0, nblocks * block - n)).view(nblocks, block)
    absmax = blocks.abs().amax(dim=1)
    # NaN fails `> 0`, so a NaN block divides by 1 and decodes as q * NaN; an inf block gives
    # inf/inf = NaN -> 0 and decodes as 0 * inf = NaN. Either way the block is visibly poisoned.
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    q = torch.round(blocks / safe[:, None] * qmax)
    q = torch.nan_to_num(q, nan=0.0).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(-1)[:n], absmax


def _dequantize_blocks(q: torch.Tensor, absmax: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    scale = absmax.repeat_interleave(block)[: q.numel()]
    # (q * absmax) / qmax rather than q * (absmax / qmax): q = ±qmax then decodes to exactly ±absmax.
    return q.to(torch.float32) * scale / qmax


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
    def _pack(q: torch.Tensor) -> bytes: ...

    @staticmethod
    @abc.abstractmethod
    def _data_bytes(numel: int) -> int: ...

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Quantize `tensor` blockwise; each block stores its fp32 absmax."""
        flat = to_cpu_float(tensor)
        q, absmax = _quantize_blocks(flat, self.block_size, self._qmax)
        scales = absmax.numpy().astype("<f4").tobytes()
        return (
            _header(self._codec_id, tuple(flat.shape)) + _U32.pack(self.block_size) + scales + self._pack(q)
        )

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
    def _pack(q: torch.Tensor) -> bytes:
        return q.numpy().astype("i1").tobytes()

    @staticmethod
    def _data_bytes(numel: int) -> int:
        return numel


class Int4Codec(_BlockwiseCodec):
    """Blockwise int4 in [-7, 7], two values per byte, plus 4 bytes per block."""

    name = "int4"
    _codec_id = _ID_INT4
    _qmax = 7

    @staticmethod
    def _pack(q: torch.Tensor) -> bytes:
        nibbles = (q.numpy().astype(np.int16) + 8).astype(np.uint8)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()

    @staticmethod
    def _data_bytes(numel: int) -> int:
        return (numel + 1) // 2


def _unpack_int8(payload: bytes, offset: int, numel: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(payload, dtype="i1", count=numel, offset=offset).copy())


def _unpack_int4(payload: bytes, offset: int, numel: int) -> torch.Tensor:
    packed = np.frombuffer(payload, dtype=np.uint8, count=(numel + 1) // 2, offset=offset)
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:numel]
    return torch.from_numpy(nibbles.astype(np.int8) - 8)


# --- low rank -----------------------------------------------------------------------------------


class LowRankCodec(Codec):
    """PowerSGD-style rank-r approximation M ≈ P Qᵀ with a warm-started Q per key.

    A tensor is viewed as M of shape (shape[0], prod(shape[1:])). Each encode runs one power
    iteration from the previous Q for this key (Vogels et al. 2019, arXiv 1905.13727):
    P = orth(M Q), Q = Mᵀ P, and sends P and Q through the dense `factor` codec. The first Q for a
    key is drawn from a generator seeded by (`seed`, key), so two fresh instances encode the same
    input to identical bytes. Tensors with ndim <= 1, or for which the factors would not save at
    least `min_compression_ratio` of the values (hivemind's PowerSGD rule), are encoded densely
    with the factor codec instead; the rank is capped at min(m, n).
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
        # crc32, not hash(): Python string hashes are salted per process.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
        return torch.randn(n, rank, generator=generator)


# --- decode -------------------------------------------------------------------------------------


def _decode_none(payload: bytes, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    numel = math.prod(shape)
    _check_length(payload, offset + 4 * numel)
    return _from_numpy(np.frombuffer(payload, dtype="<f4", count=numel, offset=offset), shape)


def _decode_fp16(payload: bytes, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    numel = math.prod(shape)
    _check_length(payload, offset + 2 * numel)
    return _from_numpy(np.frombuffer(payload, dtype="<f2", count=numel, offset=offset), shape)


def _blockwise_decoder(
    qmax: int, data_bytes: Callable[[int], int], unpack: Callable[[bytes, int, int], torch.Tensor]
) -> Callable[[bytes, tuple[int, ...], int], torch.Tensor]:
    def decode_blockwise(payload: bytes, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        block = _read_u32(payload, offset)
        if block == 0:
            raise ValueError("corrupt payload: block size 0")
        numel = math.prod(shape)
        nblocks = -(-numel // block)
        scales_at = offset + _U32.size
        data_at = scales_at + 4 * nblocks
        _check_length(payload, data_at + data_bytes(numel))
        absmax = _from_numpy(np.frombuffer(payload, dtype="<f4", count=nblocks, offset=scales_at), (nblocks,))
        q = unpack(payload, data_at, numel)
        return _dequantize_blocks(q, absmax, block, qmax).reshape(shape)

    return decode_blockwise


def _decode_lowrank(payload: bytes, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    if len(shape) < 2:
        raise ValueError(f"corrupt low-rank payload: shape {shape} has fewer than 2 dims")
    if len(payload) < offset + _LOWRANK_PARAMS.size:
        raise ValueError("payload truncated inside its low-rank parameters")
    rank, p_len = _LOWRANK_PARAMS.unpack_from(payload, offset)
    p_at = offset + _LOWRANK_PARAMS.size
    if len(payload) < p_at + p_len:
        raise ValueError("payload truncated inside its P factor")
    p = _decode_dense(payload[p_at : p_at + p_len])
    q = _decode_dense(payload[p_at + p_len :])
    m, n = shape[0], math.prod(shape[1:])
    if tuple(p.shape) != (rank, m) or tuple(q.shape) != (rank, n):
        raise ValueError(f"corrupt low-rank payload: factors {tuple(p.shape)}, {tuple(q.shape)} for {shape}")
    return (p.T @ q).reshape(shape)


_DENSE_DECODERS: dict[int, Callable[[bytes, tuple[int, ...], int], torch.Tensor]] = {
    _ID_NONE: _decode_none,
    _ID_FP16: _decode_fp16,
    _ID_INT8: _blockwise_decoder(Int8Codec._qmax, Int8Codec._data_bytes, _unpack_int8),
    _ID_INT4: _blockwise_decoder(Int4Codec._qmax, Int4Codec._data_bytes, _unpack_int4),
}
_DECODERS = {**_DENSE_DECODERS, _ID_LOWRANK: _decode_lowrank}


def _decode_with(
    payload: bytes, decoders: Mapping[int, Callable[[bytes, tuple[int, ...], int], torch.Tensor]]
) -> torch.Tensor:
    codec_id, shape, offset = _read_header(payload)
    decoder = decoders.get(codec_id)
    if decoder is None:
        raise ValueError(f"unknown or misplaced codec id {codec_id} in payload")
    return decoder(payload, shape, offset)


def _decode_dense(payload: bytes) -> torch.Tensor:
    return _decode_with(payload, _DENSE_DECODERS)


def decode(payload: bytes) -> torch.Tensor:
    """Reconstruct the float32 CPU tensor of any codec's payload; ValueError if it is malformed."""
    return _decode_with(bytes(payload), _DECODERS)


# --- specs and dict helpers ---------------------------------------------------------------------

_DENSE_CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}
_LOWRANK_SPEC = re.compile(r"lowrank:([1-9][0-9]*)(?::(none|fp16|int8|int4))?")


def make_codec(spec: str) -> Codec:
    """Build a fresh codec from a spec such as "int8", "lowrank:4" (int8 factors) or "lowrank:4:fp16"."""
    if spec in _DENSE_CODECS:
        return _DENSE_CODECS[spec]()
    match = _LOWRANK_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"unknown codec spec {spec!r}; valid: {_VALID_SPECS}")
    return LowRankCodec(int(match.group(1)), factor=_DENSE_CODECS[match.group(2) or "int8"]())


def encode_tensors(codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """Encode every tensor of a dict with `codec`, keyed by name."""
    return {key: codec.encode(key, tensor) for key, tensor in tensors.items()}


def decode_tensors(payloads: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """Decode every payload of a dict."""
    return {key: decode(payload) for key, payload in payloads.items()}


def wire_bytes_of(payloads: Mapping[str, bytes]) -> int:
    """Total bytes on the wire for a dict of payloads."""
    return sum(len(payload) for payload in payloads.values())
