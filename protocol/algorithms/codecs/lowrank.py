"""PowerSGD-style `lowrank:R`: one warm-started power iteration, the factors quantized by a dense
codec; its reader, and `low_rank_product`, the product of the factors that every CPU computes to
the same bits.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping

import numpy as np
import torch

from .dense import _DENSE_READERS, Int8Codec
from .frame import _ID_LOWRANK, Codec, _Build, _header, _header_size, _read, span_bounds, to_cpu_float

# --- low rank -----------------------------------------------------------------------------------

_PRODUCT_BLOCK = 1 << 18
"""float64 values per block of `low_rank_product` (2 MB): blocks of 2**15 were twice as slow, the
per-call overhead of the rank-1 updates dominating."""
_LOWRANK_PARAMS = struct.Struct("<II")


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


# --- reader -------------------------------------------------------------------------------------


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
    for start, stop in span_bounds(m, rows):
        block = acc[: stop - start]
        torch.outer(p64[0, start:stop], q64[0], out=block)
        for k in range(1, rank):
            block.addcmul_(p64[k, start:stop, None], q64[k, None, :])
        out[start:stop] = block
    return out
