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

Wire format (all little-endian):

    header  = b"AC" | version u8 | codec id u8 | ndim u8 | ndim x u32 dims
    none    = header | numel x f32
    fp16    = header | numel x f16
    int8    = header | block u32 | nblocks x f32 absmax | numel x i8
    int4    = header | block u32 | nblocks x f32 absmax | ceil(numel/2) x u8 (two nibbles, q+8,
              first value in the low nibble)
    lowrank = header | rank u32 | len(P) u32 | P payload | Q payload
              (P, Q: dense payloads of shapes (rank, m) and (rank, n); tensor = P.T @ Q)
    sparse  = header | chunk u32 | k u32 | bits u8 | nchunks x f32 lo | nchunks x f32 hi
              | n x index (ceil(log2(chunk)) bits each) | n x value code (bits each)
              (n = k per whole chunk + ceil(k * tail / chunk) for a partial last chunk of tail
              values; indices within their chunk, strictly increasing; each bit array
              little-endian, first value in the lowest bits, zero-padded to a whole byte)
    sum     = header | count u32 | count x f32 factor | count x u32 length | the count payloads
              (each a payload of this shape of any codec but sum; decodes to the sum of
              factor x decode(payload), each product and sum rounded to float32, in order)

The rooms: `frame` (the header every payload starts with, the codec ids, the `Codec` base class
and the helpers encoders and readers share), `dense` (none, fp16, int8, int4), `lowrank`,
`sparse`, `sums` (the sum payload; not `sum`, which as an attribute of this package would hide
the builtin from the code below), each codec with its reader, and `decoding` (`decode`,
`payload_shape`, and what a payload says of itself: `payload_codec`, `error_bound`). Here:
`make_codec` and the dict helpers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from .decoding import (
    ErrorBound,
    Rounding,
    decode,
    decoded_spans,
    error_bound,
    payload_codec,
    payload_shape,
)
from .dense import Fp16Codec, Int4Codec, Int8Codec, NoneCodec
from .frame import DEFAULT_BLOCK_SIZE, MAGIC, SPAN, VERSION, Codec, span_bounds, to_cpu_float
from .lowrank import LowRankCodec, low_rank_product
from .sparse import _MAX_SPARSE_CHUNK, SparseCodec
from .sums import sum_count, sum_parts, sum_payload, sum_payload_bytes

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MAGIC",
    "SPAN",
    "VERSION",
    "Codec",
    "ErrorBound",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "LowRankCodec",
    "NoneCodec",
    "Rounding",
    "SparseCodec",
    "decode",
    "decode_tensors",
    "decoded_spans",
    "encode_tensors",
    "error_bound",
    "low_rank_product",
    "make_codec",
    "payload_codec",
    "payload_shape",
    "span_bounds",
    "sum_count",
    "sum_parts",
    "sum_payload",
    "sum_payload_bytes",
    "to_cpu_float",
    "wire_bytes_of",
]

_VALID_SPECS = (
    "none, fp16, int8, int4, lowrank:R, lowrank:R:{none,fp16,int8,int4} (R >= 1),"
    " sparse, sparse:K/C, sparse:K/C:B (1 <= K <= C <= 2**24, 1 <= B <= 8)"
)


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
