"""The frame every payload shares: its header (magic, version, codec id, shape: the first line of
the package docstring's wire-format table), the codec ids, the `Codec` base class, and the helpers
every encoder and reader uses.

Encoding and decoding are vectorized numpy/torch passes over steps of whole blocks (`_spans`), so
that the temporaries of a step stay in the CPU cache, and each payload is assembled with a single
copy; outputs are allocated by numpy, whose large allocations the kernel can back with huge pages.

A reader (`_Reader`) checks a payload whole and returns the function that builds its tensor;
`_read` hands a payload to the reader of its codec id, among the readers it is given.
"""

from __future__ import annotations

import abc
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping

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

SPAN = 1 << 20
"""Values per span of a span-wise decode (`decoding.decoded_spans`) and encode (`Codec.encode_spans`):
4 MB of float32. A multiple of `_STEP`, of the default block and of the chunks the norms and
projections sum in (2**16 values), so that a sum taken span by span is the one taken whole."""

# The codec ids of the header; the wire format of each codec's body is in the package docstring.
_ID_NONE, _ID_FP16, _ID_INT8, _ID_INT4, _ID_LOWRANK, _ID_SPARSE, _ID_SUM = range(7)
_HEADER = struct.Struct("<2sBBB")
_U32 = struct.Struct("<I")
_MAX_U32 = 2**32 - 1


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

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        """`encode(key, t)` of the float32 tensor `t` of `shape` whose flattened values `spans`
        yields in order, `SPAN` at a time (the last span may be shorter). A dense codec encodes them
        span by span, never holding `t` whole (an owner's average, `parts.reduce_part`); this
        default gathers them into `t` and encodes it."""
        whole = torch.empty(math.prod(shape), dtype=torch.float32)
        at = 0
        for span in spans:
            whole[at : at + span.numel()] = span.reshape(-1)
            at += span.numel()
        if at != whole.numel():
            raise ValueError(f"spans of {at} values for a tensor of shape {shape}")
        return self.encode(key, whole.view(shape))

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


def span_bounds(numel: int, span: int = SPAN) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges covering `numel` values, `span` at a time (the last one shorter)."""
    for start in range(0, numel, span):
        yield start, min(start + span, numel)


def _spans(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges covering `numel` values in steps of `_step(block)` values."""
    return span_bounds(numel, _step(block))


def _little_endian(array: npt.NDArray[np.generic], dtype: str) -> memoryview:
    """`array`'s bytes in the wire's little-endian `dtype` (no copy on a little-endian host)."""
    return np.ascontiguousarray(array.reshape(-1), dtype=dtype).data.cast("B")


# --- decode -------------------------------------------------------------------------------------
#
# A reader checks a payload whole (header, codec parameters, exact length, low-rank factors) and
# returns the function that builds its tensor, which checks nothing more: `payload_shape` runs the
# checks alone, `decode` both, so a payload that passed one passes the other.

_Build = Callable[[], torch.Tensor]
_Reader = Callable[[bytes, tuple[int, ...], int], _Build]


def _read(payload: bytes, readers: Mapping[int, _Reader]) -> tuple[tuple[int, ...], _Build]:
    codec_id, shape, offset = _read_header(payload)
    reader = readers.get(codec_id)
    if reader is None:
        raise ValueError(f"unknown or misplaced codec id {codec_id} in payload")
    return shape, reader(payload, shape, offset)
