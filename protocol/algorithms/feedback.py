"""Error feedback: what compression lost this round is added to what the peer sends in later rounds.

`ErrorFeedback` keeps one residual e per tensor: a peer sends c = C(Δ + e) through any `Codec` and
keeps e ← Δ + e − decode(c), the error measured on what receivers actually reconstruct. Over rounds
the receivers get the sum of the Δ up to the last residual, which is what makes aggressive codecs
(int4, low rank) usable (DiLoCoX-style adaptive compression, algorithms.md §4.4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .codecs import Codec, decode, to_cpu_float

RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ErrorFeedback:
    """Per-key residual e so that what receivers miss this round is sent in later rounds.

    `compress` sends c = C(Δ + e) and keeps e ← Δ + e − decode(c): the residual is measured on what
    receivers actually reconstruct (algorithms.md §4.4, step 4). Δ + e and the new residual are
    formed in fp32; e is stored in `dtype` (bf16 halves its memory and rounds it to 8 significant
    bits: the rounding error is itself fed back no more, about 2^-9 of e per round).
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in RESIDUAL_DTYPES.values():
            raise ValueError(f"residual dtype must be one of {sorted(RESIDUAL_DTYPES)}, got {dtype}")
        self.dtype = dtype
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        """Encode Δ + e for every tensor and update the residuals."""
        return {key: self.compress_tensor(codec, key, delta) for key, delta in tensors.items()}

    def compress_tensor(self, codec: Codec, key: str, delta: torch.Tensor) -> bytes:
        """Encode Δ + e for one tensor and update its residual.

        In fp32, e ← Δ + e − decode(c) in e's own buffer: besides e, one tensor's decoded payload
        is all this allocates (the same operations as out of place, so the same bits). In bf16,
        Δ + e is one fp32 temporary of this tensor, and the new e is rounded into e's buffer."""
        delta = to_cpu_float(delta)
        residual = self._residuals.get(key)
        if residual is not None and residual.shape != delta.shape:
            raise ValueError(
                f"{key}: shape {tuple(delta.shape)} != residual {tuple(residual.shape)}; reset()"
            )
        if residual is None:
            payload = codec.encode(key, delta)
            error = delta - decode(payload)
        elif residual.dtype == torch.float32:
            payload = codec.encode(key, residual.add_(delta))
            error = residual.sub_(decode(payload))
        else:
            error = delta + residual  # fp32 (type promotion)
            payload = codec.encode(key, error)
            error.sub_(decode(payload))
        # A non-finite round is rejected downstream; keeping its NaN would poison every later one.
        error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if residual is None:
            self._residuals[key] = error if self.dtype == torch.float32 else error.to(self.dtype)
        elif error is not residual:
            residual.copy_(error)
        return payload

    def residual_norm(self) -> float:
        """L2 norm of all residuals together."""
        return math.sqrt(sum(float(e.double().square().sum()) for e in self._residuals.values()))

    def reset(self) -> None:
        """Forget all residuals (e.g. after a codec or shape change)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residual per key, for checkpoints."""
        return {key: e.clone() for key, e in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore residuals saved by `state_dict` (in any float dtype: they are kept in this
        feedback's); ValueError, nothing changed, if one is no float tensor."""
        for key, e in state.items():
            if not (isinstance(key, str) and isinstance(e, torch.Tensor) and e.is_floating_point()):
                raise ValueError(f"error-feedback residual {key!r} is not a float tensor")
        self._residuals = {
            key: e.detach().to("cpu", self.dtype, copy=True).contiguous() for key, e in state.items()
        }
