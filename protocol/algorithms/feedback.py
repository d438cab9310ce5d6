"""Error feedback: what compression lost this round is added to what the peer sends in later rounds.

`ErrorFeedback` keeps one residual e per tensor: a peer sends c = C(Δ + e) through any `Codec` and
keeps e ← Δ + e − decode(c), the error measured on what receivers actually reconstruct. Over rounds
the receivers get the sum of the Δ up to the last residual, which is what makes aggressive codecs
(int4, low rank) usable (DiLoCoX-style adaptive compression, algorithms.md §4.4).

The residual is kept in fp32, bf16, or int8 with one scale per block of `RESIDUAL_BLOCK` values
(`Int8Residual`, 1.02 bytes per parameter). What a uniform quantizer (int8, int4) leaves behind is at
most half its step, so the int8 rounding of e (at most 1/127 of its block's largest value) is under
1 % of the codec's own error.

With a decay β < 1 (SparseLoCo, arXiv 2508.15706) the residual fades: c = C(β e + Δ). With the
outer momentum off, the residual then stands in for it: what was not sent keeps pushing, and fades
as a momentum buffer does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from .codecs import Codec, decode, decoded_spans, span_bounds, to_cpu_float

logger = logging.getLogger(__name__)

RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
# Values per scale of an int8 residual (a 4-byte scale per 256 one-byte codes).
RESIDUAL_BLOCK = 256
# Values quantized at a time: the fp32 temporaries of `Int8Residual.store` stay at 4 MiB.
_SLICE = RESIDUAL_BLOCK << 12


class Storage(Protocol):
    """Bytes kept outside memory (a node's unnamed file, `node.data.spill.SpillFile`): regions
    reserved zeroed, then read and rewritten in place."""

    def reserve(self, size: int) -> int:
        """`size` zero bytes at the end; where they start."""
        ...

    def read(self, at: int, size: int) -> bytes: ...

    def write(self, at: int, data: bytes | memoryview) -> None:
        """Overwrite reserved bytes from `at`."""
        ...


class Int8Residual:
    """A residual kept as int8 codes, each block of `RESIDUAL_BLOCK` values with its own scale (the
    smallest power of two ≥ the block's largest magnitude / 127): 1 + 4/256 bytes per value, each
    kept to within half its block's scale (at most 1/127 of the block's largest value). In memory,
    or with a `storage` in it (the codes, then the scales), read and written a slice at a time."""

    __slots__ = ("_at", "_storage", "codes", "numel", "scales", "shape")

    def __init__(
        self, values: torch.Tensor | None, shape: torch.Size | None = None, *, storage: Storage | None = None
    ) -> None:
        """`values` quantized, or with None zeros of `shape`."""
        self.shape = values.shape if values is not None else torch.Size(shape or ())
        self.numel = n = self.shape.numel()
        blocks = -(-n // RESIDUAL_BLOCK)
        self._storage = storage
        if storage is None:
            self.codes = torch.zeros(n, dtype=torch.int8)
            self.scales = torch.zeros(blocks, dtype=torch.float32)
        else:
            self.codes = self.scales = torch.empty(0)  # in the storage
            self._at = storage.reserve(n + 4 * blocks)
        if values is not None:
            self.store(values)

    def _read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes of values [start, end) (`start` a block's) and the scales of their blocks."""
        first, blocks = start // RESIDUAL_BLOCK, -(-(end - start) // RESIDUAL_BLOCK)
        if self._storage is None:
            return self.codes[start:end], self.scales[first : first + blocks]
        codes = self._storage.read(self._at + start, end - start)
        scales = self._storage.read(self._at + self.numel + 4 * first, 4 * blocks)
        return (
            torch.frombuffer(bytearray(codes), dtype=torch.int8),
            torch.frombuffer(bytearray(scales), dtype=torch.float32),
        )

    def _write(self, start: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        first = start // RESIDUAL_BLOCK
        if self._storage is None:
            self.codes[start : start + len(codes)] = codes
            self.scales[first : first + len(scales)] = scales
            return
        self._storage.write(self._at + start, codes.numpy().tobytes())
        self._storage.write(self._at + self.numel + 4 * first, scales.numpy().astype("<f4").tobytes())

    def store(self, values: torch.Tensor, at: int = 0) -> None:
        """Quantize `values` (any float dtype) into the codes from value `at` on (a multiple of
        `RESIDUAL_BLOCK`; by default the whole residual, of its shape), a slice at a time."""
        flat = values.reshape(-1)
        if at % RESIDUAL_BLOCK or at + flat.numel() > self.numel:
            raise ValueError(f"{flat.numel()} values at {at} of a residual of {self.numel}")
        for start in range(at, at + flat.numel(), _SLICE):
            part = flat[start - at : start - at + _SLICE].float()
            blocks = -(-part.numel() // RESIDUAL_BLOCK)
            if part.numel() != blocks * RESIDUAL_BLOCK:  # the tail: padded with zeros
                part = torch.nn.functional.pad(part, (0, blocks * RESIDUAL_BLOCK - part.numel()))
            grid = part.view(blocks, RESIDUAL_BLOCK)
            # A power of two at least the block's largest magnitude / 127, so code × scale is exact
            # in bf16 (a checkpoint's dtype) and quantizes back to the same code.
            scale = torch.exp2(torch.ceil(torch.log2(grid.abs().amax(dim=1).div_(127.0))))
            kept = scale.clone()
            codes = grid.div(scale.clamp_min_(torch.finfo(torch.float32).tiny)[:, None]).round_()
            end = min(start + _SLICE, at + flat.numel())
            self._write(start, codes.view(-1)[: end - start].to(torch.int8), kept)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The residual's values as a new tensor of its shape."""
        return self.values(0, self.numel, dtype).view(self.shape)

    def values(self, begin: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values [begin, end) of the flattened residual (`begin` a multiple of `RESIDUAL_BLOCK`) as a
        new 1-d tensor."""
        if begin % RESIDUAL_BLOCK:
            raise ValueError(f"a residual is read from a block's start, not from {begin}")
        out = torch.empty(end - begin, dtype=dtype)
        for start in range(begin, end, _SLICE):
            codes, scale = self._read(start, min(start + _SLICE, end))
            values = codes.float()
            full = values.numel() // RESIDUAL_BLOCK * RESIDUAL_BLOCK
            values[:full].view(-1, RESIDUAL_BLOCK).mul_(scale[: full // RESIDUAL_BLOCK, None])
            values[full:].mul_(scale[-1])  # the tail block, if any
            out[start - begin : start - begin + values.numel()] = values
        return out

    def nbytes(self) -> int:
        """The bytes it holds in memory."""
        return 0 if self._storage is not None else self.codes.numel() + 4 * self.scales.numel()


class ErrorFeedback:
    """Per-key residual e so that what receivers miss this round is sent in later rounds.

    `compress` sends c = C(Δ + e) and keeps e ← Δ + e − decode(c): the residual is measured on what
    receivers actually reconstruct (algorithms.md §4.4, step 4). Δ + e and the new residual are
    formed in fp32; e is stored in `dtype` (bf16 halves its memory and rounds it to 8 significant
    bits: the rounding error is itself fed back no more, about 2^-9 of e per round). `decay` is
    SparseLoCo's β: the residual is scaled by it before Δ is added (1: plain error feedback).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, *, decay: float = 1.0) -> None:
        if dtype not in RESIDUAL_DTYPES.values():
            raise ValueError(f"residual dtype must be one of {sorted(RESIDUAL_DTYPES)}, got {dtype}")
        if not (math.isfinite(decay) and 0 < decay <= 1):
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay}")
        self.dtype = dtype
        self.decay = decay
        self._residuals: dict[str, torch.Tensor | Int8Residual] = {}
        self.storage: Callable[[], Storage] | None = None
        self._store: Storage | None = None  # made at the first residual kept in it

    def keep_on_disk(self, storage: Callable[[], Storage]) -> None:
        """Keep int8 residuals made from now on in a `storage` (one for all; the networked node's is
        an unnamed file), read and rewritten a slice at a time as each contribution is encoded: 1
        B/param less in memory between contributions. Those already made stay where they are."""
        self.storage, self._store = storage, None

    def _int8(self, values: torch.Tensor | None, shape: torch.Size) -> Int8Residual:
        """A new int8 residual (of `values`, or zeros), in the storage when there is one. A storage
        that cannot hold it (a folder gone, a full disk) is never worth failing a round for: the
        residuals stay in memory from then on, with one warning."""
        if self.storage is not None:
            try:
                if self._store is None:
                    self._store = self.storage()
                return Int8Residual(values, shape, storage=self._store)
            except OSError as e:
                logger.warning("error-feedback residuals stay in memory from now on: %s", e)
                self.storage = self._store = None
        return Int8Residual(values, shape)

    def compress(self, codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        """Encode Δ + e for every tensor and update the residuals."""
        return {key: self.compress_tensor(codec, key, delta) for key, delta in tensors.items()}

    def compress_tensor(self, codec: Codec, key: str, delta: torch.Tensor) -> bytes:
        """Encode β e + Δ for one tensor and update its residual.

        In fp32, e ← Δ + e − decode(c) in e's own buffer: besides e, one tensor's decoded payload
        is all this allocates (the same operations as out of place, so the same bits). In bf16,
        Δ + e is one fp32 temporary of this tensor, and the new e is rounded into e's buffer."""
        delta = to_cpu_float(delta)
        residual = self._residuals.get(key)
        if residual is not None and residual.shape != delta.shape:
            raise ValueError(
                f"{key}: shape {tuple(delta.shape)} != residual {tuple(residual.shape)}; reset()"
            )
        decay = self.decay != 1.0
        if residual is None and self.dtype == torch.int8:
            # From a zero residual, span by span: e + Δ is Δ (a −0.0 of Δ becomes 0.0, the same value).
            residual = self._residuals[key] = self._int8(None, delta.shape)
        if residual is None:
            payload = codec.encode(key, delta)
            error = delta - decode(payload)
        elif isinstance(residual, Int8Residual):
            return self._compress_int8(codec, key, delta, residual)
        elif residual.dtype == torch.float32:
            payload = codec.encode(key, (residual.mul_(self.decay) if decay else residual).add_(delta))
            error = residual.sub_(decode(payload))
        else:
            error = residual.float().mul_(self.decay).add_(delta) if decay else delta + residual  # fp32
            payload = codec.encode(key, error)
            error.sub_(decode(payload))
        # A non-finite round is rejected downstream; keeping its NaN would poison every later one.
        error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if residual is None:
            self._residuals[key] = self._kept(error)
        elif isinstance(residual, Int8Residual):
            residual.store(error)
        elif error is not residual:
            residual.copy_(error)
        return payload

    def _compress_int8(self, codec: Codec, key: str, delta: torch.Tensor, residual: Int8Residual) -> bytes:
        """`compress_tensor` into an int8 residual, a span at a time: β e + Δ of each span is
        encoded as it is formed (`Codec.encode_spans`), then formed again, its decoded span taken
        off and stored. The same floats as formed whole, and never a whole tensor beside Δ's: the
        residual, Δ + e and the decoded payload whole were 3 × 4 B/param of the largest tensor (the
        embedding's 154 MB at GPT-2 124M; issue 28 §2)."""
        flat, n = delta.reshape(-1), delta.numel()

        def error(start: int, stop: int) -> torch.Tensor:
            e = residual.values(start, stop)
            return (e.mul_(self.decay) if self.decay != 1.0 else e).add_(flat[start:stop])

        payload = codec.encode_spans(key, tuple(delta.shape), (error(*s) for s in span_bounds(n)))
        for (start, stop), sent in zip(span_bounds(n), decoded_spans(payload), strict=True):
            # A non-finite round is rejected downstream; keeping its NaN would poison every later one.
            residual.store(
                error(start, stop).sub_(sent).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0), at=start
            )
        return payload

    def _kept(self, error: torch.Tensor) -> torch.Tensor | Int8Residual:
        if self.dtype == torch.int8:
            return self._int8(error, error.shape)
        return error if self.dtype == error.dtype else error.to(self.dtype)

    def residual_norm(self) -> float:
        """L2 norm of all residuals together."""
        return math.sqrt(sum(float(_values(e).double().square().sum()) for e in self._residuals.values()))

    def reset(self) -> None:
        """Forget all residuals (e.g. after a codec or shape change)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residual per key, for checkpoints (an int8 residual's values in bf16, which holds them
        exactly: a 7-bit code times a power of two)."""
        return {
            key: e.dequantize(torch.bfloat16) if isinstance(e, Int8Residual) else e.clone()
            for key, e in self._residuals.items()
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore residuals saved by `state_dict` (in any float dtype: they are kept in this
        feedback's); ValueError, nothing changed, if one is no float tensor."""
        for key, e in state.items():
            if not (isinstance(key, str) and isinstance(e, torch.Tensor) and e.is_floating_point()):
                raise ValueError(f"error-feedback residual {key!r} is not a float tensor")
        self._store = None  # a new storage: the old one goes with the residuals it held
        self._residuals = {key: self._kept(e.detach().to("cpu", copy=True)) for key, e in state.items()}


def _values(residual: torch.Tensor | Int8Residual) -> torch.Tensor:
    return residual.dequantize() if isinstance(residual, Int8Residual) else residual
