"""Codecs: exact wire sizes, bounded round-trip error, hand-computed quantization, error feedback, chooser."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import re
import resource
import struct
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from adloco.protocol.algorithms.adaptive import (
    DEFAULT_CANDIDATES,
    REASON_LOWEST_ERROR,
    REASON_MEETS_BOTH,
    REASON_OVER_BUDGET,
    Payloads,
    choose_codec,
    measured_error,
    predicted_wire_bytes,
    relative_error,
)
from adloco.protocol.algorithms.codecs import (
    SPAN,
    Codec,
    Int4Codec,
    Int8Codec,
    LowRankCodec,
    NoneCodec,
    SparseCodec,
    decode,
    decode_tensors,
    decoded_spans,
    encode_tensors,
    make_codec,
    payload_shape,
    wire_bytes_of,
)
from adloco.protocol.algorithms.feedback import RESIDUAL_BLOCK, ErrorFeedback, Int8Residual

ALL_SPECS = (*DEFAULT_CANDIDATES, "lowrank:3:none", "lowrank:3:fp16", "lowrank:5:int4", "lowrank:500")
SHAPES = [(), (1,), (7,), (64,), (65,), (129,), (3, 5), (2, 3, 4), (128, 96), (33, 17, 5), (0,), (4, 0)]


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def low_rank_matrix(m: int, n: int, rank: int, seed: int = 0) -> torch.Tensor:
    return gaussian(m, rank, seed=seed) @ gaussian(rank, n, seed=seed + 1)


def every_codec() -> list[Codec]:
    return [make_codec(spec) for spec in ALL_SPECS] + [
        Int8Codec(block_size=7),
        Int4Codec(block_size=5),
        make_codec("sparse"),
        SparseCodec(3, 7, 3),
        SparseCodec(1, 1, 1),
    ]


# --- wire format --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_wire_bytes_predicts_exact_payload_length(shape: tuple[int, ...]) -> None:
    x = gaussian(*shape) if shape else torch.tensor(1.5)
    for codec in every_codec():
        assert len(codec.encode("k", x)) == codec.wire_bytes(shape), codec


def test_low_rank_path_is_taken_for_large_matrices() -> None:
    assert LowRankCodec(4).plan((128, 96)) == (128, 96, 4)
    assert LowRankCodec(2).plan((33, 17, 5)) == (33, 85, 2)
    assert LowRankCodec(4).plan((10, 10)) is None  # 4 * 20 >= 0.5 * 100
    assert LowRankCodec(4).plan((64,)) is None


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1,), (), (40, 30), (8, 4, 5)], ids=str)
def test_decode_restores_shape_and_float32(shape: tuple[int, ...]) -> None:
    x = gaussian(*shape) if shape else torch.tensor(-2.0)
    for codec in every_codec():
        y = decode(codec.encode("k", x))
        assert y.shape == x.shape and y.dtype == torch.float32, codec


def test_any_input_dtype_decodes_to_float32() -> None:
    x = gaussian(3, 5)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        y = decode(make_codec("none").encode("k", x.to(dtype)))
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, x.to(dtype).float())


def test_header_layout_is_literal() -> None:
    payload = NoneCodec().encode("k", torch.tensor([[1.0, 2.0, 3.0]]))
    assert payload == b"AC\x01\x00\x02" + struct.pack("<II", 1, 3) + struct.pack("<3f", 1.0, 2.0, 3.0)


# --- hand-computed quantization -----------------------------------------------------------------


def test_int8_hand_computed() -> None:
    x = torch.tensor([0.5, -1.0, 0.25, 1.0])
    payload = make_codec("int8").encode("k", x)
    # absmax 1.0; q = round(x / 1.0 * 127), half to even: 63.5 -> 64, 31.75 -> 32.
    assert payload == (
        b"AC\x01\x02\x01" + struct.pack("<I", 4) + struct.pack("<I", 64) + struct.pack("<f", 1.0)
    ) + bytes([64, 256 - 127, 32, 127])
    torch.testing.assert_close(decode(payload), torch.tensor([64 / 127, -1.0, 32 / 127, 1.0]))


def test_int4_hand_computed() -> None:
    x = torch.tensor([0.5, -1.0, 0.25, 1.0])
    payload = make_codec("int4").encode("k", x)
    # q = round(x * 7) = [4 (3.5, half to even), -7, 2 (1.75), 7]; nibbles q + 8 = [12, 1, 10, 15].
    assert payload[-2:] == bytes([0x1C, 0xFA])
    assert len(payload) == 5 + 4 + 4 + 4 + 2
    torch.testing.assert_close(decode(payload), torch.tensor([4 / 7, -1.0, 2 / 7, 1.0]))


def test_int4_odd_length_two_blocks_hand_computed() -> None:
    x = torch.tensor([3.0, -1.5, 0.1])
    payload = Int4Codec(block_size=2).encode("k", x)
    # block [3.0, -1.5]: absmax 3, q = [7, round(-3.5) = -4]; block [0.1]: absmax 0.1, q = [7].
    assert payload[-2:] == bytes([15 | (4 << 4), 15 | (8 << 4)])  # last byte padded with q = 0
    torch.testing.assert_close(decode(payload), torch.tensor([3.0, -4 * 3.0 / 7, 0.1]))


def test_zero_tensor_quantizes_to_zero() -> None:
    for spec in ("int8", "int4", "lowrank:2"):
        assert torch.equal(decode(make_codec(spec).encode("k", torch.zeros(64, 64))), torch.zeros(64, 64))


# --- error bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "bound"), [("none", 0.0), ("fp16", 4e-4), ("int8", 8e-3), ("int4", 0.13)])
def test_dense_round_trip_error_is_bounded(spec: str, bound: float) -> None:
    # Measured on this input: fp16 2.1e-4, int8 5.9e-3, int4 0.107 (block 64, fp32 absmax).
    x = {"a": gaussian(256, 128, seed=3), "b": gaussian(1000, seed=4)}
    error = relative_error(x, decode_tensors(encode_tensors(make_codec(spec), x)))
    assert error <= bound


@pytest.mark.parametrize(("factor", "bound"), [("none", 1e-5), ("fp16", 1e-3), ("int8", 0.02)])
def test_low_rank_is_exact_for_low_rank_input(factor: str, bound: float) -> None:
    m = low_rank_matrix(40, 30, rank=3)
    assert relative_error(m, decode(make_codec(f"lowrank:4:{factor}").encode("k", m))) < bound
    m3 = low_rank_matrix(8, 20, rank=2).reshape(8, 4, 5)
    assert relative_error(m3, decode(make_codec(f"lowrank:2:{factor}").encode("k", m3))) < bound


def test_low_rank_error_decreases_with_rank() -> None:
    x = gaussian(128, 128, seed=5)
    errors = [relative_error(x, decode(make_codec(f"lowrank:{r}").encode("k", x))) for r in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors


def test_low_rank_fresh_instances_give_identical_bytes() -> None:
    x = gaussian(64, 48, seed=6)
    assert make_codec("lowrank:4").encode("w", x) == make_codec("lowrank:4").encode("w", x)


def test_low_rank_warm_start_improves_repeated_encodes() -> None:
    u, _ = torch.linalg.qr(gaussian(64, 64, seed=7))
    v, _ = torch.linalg.qr(gaussian(48, 48, seed=8))
    spectrum = 0.7 ** torch.arange(48, dtype=torch.float32)
    x = u[:, :48] @ torch.diag(spectrum) @ v.T
    codec = make_codec("lowrank:4:none")
    errors = [relative_error(x, decode(codec.encode("w", x))) for _ in range(4)]
    assert errors[-1] < errors[0]
    assert errors[-1] < 1.05 * math.sqrt(float((spectrum[4:] ** 2).sum() / (spectrum**2).sum()))


def test_low_rank_state_dict_round_trip() -> None:
    x = gaussian(64, 48, seed=9)
    a = LowRankCodec(4)
    a.encode("w", x)
    b = LowRankCodec(4)
    b.load_state_dict(a.state_dict())
    assert a.encode("w", x) == b.encode("w", x)


@pytest.mark.parametrize(
    "bad", [{"w": torch.zeros(3)}, {"w": torch.zeros(3, 2, dtype=torch.int64)}, {"w": 1}]
)
def test_codec_load_state_dict_refuses_a_bad_state_and_keeps_its_own(bad: dict[str, object]) -> None:
    x = gaussian(64, 48, seed=9)
    a = LowRankCodec(4)
    a.encode("w", x)
    before = a.state_dict()
    with pytest.raises(ValueError):
        a.load_state_dict(bad)  # type: ignore[arg-type]
    assert torch.equal(a.state_dict()["w"], before["w"])
    assert make_codec("int8").state_dict() == {}
    with pytest.raises(ValueError, match="keeps no state"):
        make_codec("int8").load_state_dict({"w": torch.zeros(3, 2)})


def test_low_rank_falls_back_to_dense_factor_codec() -> None:
    for shape in [(64,), (10, 10)]:
        x = gaussian(*shape)
        assert make_codec("lowrank:4").encode("k", x) == Int8Codec().encode("k", x)
        assert make_codec("lowrank:4:fp16").encode("k", x) == make_codec("fp16").encode("k", x)


# --- specs --------------------------------------------------------------------------------------


def test_make_codec_names_are_canonical_specs() -> None:
    for spec in DEFAULT_CANDIDATES:
        assert make_codec(spec).name == spec
    assert make_codec("lowrank:4:int8").name == "lowrank:4"
    assert make_codec("lowrank:4:fp16").name == "lowrank:4:fp16"
    assert make_codec(make_codec("lowrank:8:int4").name).name == "lowrank:8:int4"


@pytest.mark.parametrize(
    "spec",
    ["", "int16", "lowrank", "lowrank:0", "lowrank:x", "lowrank:2:lowrank:2", "lowrank:4:bf16", " int8"],
)
def test_make_codec_rejects_unknown_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="valid: none, fp16") as info:
        make_codec(spec)
    assert "\n" not in str(info.value)


# --- malformed payloads -------------------------------------------------------------------------


def test_truncated_or_padded_payloads_raise_value_error() -> None:
    x = gaussian(40, 30)
    for codec in every_codec():
        payload = codec.encode("k", x)
        for cut in sorted({0, 1, 4, 5, 8, 12, 13, 20, len(payload) // 2, len(payload) - 1}):
            with pytest.raises(ValueError):
                decode(payload[:cut])
            with pytest.raises(ValueError):
                payload_shape(payload[:cut])
        with pytest.raises(ValueError):
            decode(payload + b"\x00")
        with pytest.raises(ValueError):
            payload_shape(payload + b"\x00")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_payload_shape_is_the_decoded_shape(shape: tuple[int, ...]) -> None:
    x = gaussian(*shape) if shape else torch.tensor(1.5)
    for codec in every_codec():
        payload = codec.encode("k", x)
        assert payload_shape(payload) == tuple(decode(payload).shape) == shape, codec


def test_payload_shape_rejects_exactly_what_decode_rejects() -> None:
    """Every single-byte corruption of the first 80 bytes (all of a sparse payload here: its
    indices are checked too), and every cut: both raise or neither."""
    for payload in [
        make_codec("int8").encode("k", gaussian(3, 5)),
        make_codec("int4").encode("k", gaussian(7)),
        make_codec("fp16").encode("k", gaussian(2, 3)),
        make_codec("lowrank:4").encode("k", gaussian(40, 30)),
        SparseCodec(3, 16, 2).encode("k", gaussian(4, 11)),
        SparseCodec(2, 7, 5).encode("k", gaussian(20)),
        make_codec("sparse").encode("k", gaussian(300)),
    ]:
        variants = [payload[:cut] for cut in range(len(payload))]
        for index, value in itertools.product(range(min(len(payload), 80)), (0, 1, 2, 4, 9, 128, 255)):
            variants.append(payload[:index] + bytes([value]) + payload[index + 1 :])
        for variant in variants:
            try:
                shape = tuple(decode(variant).shape)
            except ValueError:
                with pytest.raises(ValueError):
                    payload_shape(variant)
            else:
                assert payload_shape(variant) == shape


def test_corrupted_headers_raise_value_error() -> None:
    payload = bytearray(make_codec("int8").encode("k", gaussian(3, 5)))
    for index, value in [(0, ord("X")), (2, 9), (3, 77), (4, 3)]:
        corrupt = bytearray(payload)
        corrupt[index] = value
        with pytest.raises(ValueError):
            decode(bytes(corrupt))
    zero_block = payload[:13] + struct.pack("<I", 0) + payload[17:]
    with pytest.raises(ValueError, match="block size 0"):
        decode(bytes(zero_block))


def test_corrupted_low_rank_payload_raises_value_error() -> None:
    payload = make_codec("lowrank:4").encode("k", gaussian(40, 30))
    assert payload[3] == 4
    with pytest.raises(ValueError):
        decode(payload[:13] + struct.pack("<I", 5) + payload[17:])  # rank disagrees with factors
    with pytest.raises(ValueError):
        decode(payload[:17] + struct.pack("<I", 10**6) + payload[21:])  # P length past the end
    nested = make_codec("lowrank:4").encode("k", gaussian(40, 30))
    header = payload[:13] + struct.pack("<II", 4, len(nested))
    with pytest.raises(ValueError, match="codec id"):
        decode(header + nested + nested)  # a factor may not itself be low-rank


# --- the vectorized codecs against a plain reference -------------------------------------------


def reference_blockwise(x: torch.Tensor, block: int, qmax: int) -> bytes:
    """The int8/int4 payload by its definition, whole-tensor torch as in the first release.

    Zero-pad to whole blocks; absmax = max |x| per block (a NaN block's absmax is the canonical
    NaN); q = round(x / absmax * qmax), half to even, dividing by 1 where absmax is not > 0; NaN
    q -> 0, then clamped to ±qmax; int4 packs q + 8 two per byte, low nibble first, an odd last
    value paired with q = 0.
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    nblocks = -(-n // block)
    blocks = torch.nn.functional.pad(flat, (0, nblocks * block - n)).view(nblocks, block)
    absmax = blocks.abs().amax(dim=1)
    absmax[absmax.isnan()] = math.nan
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    q = torch.round(blocks / safe[:, None] * qmax)
    values = torch.nan_to_num(q, nan=0.0).clamp(-qmax, qmax).to(torch.int8).reshape(-1)[:n].tolist()
    if qmax == 127:
        data = bytes(v & 0xFF for v in values)
    else:
        nibbles = [v + 8 for v in values] + [8] * (n % 2)
        data = bytes(lo | hi << 4 for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True))
    codec_id = 2 if qmax == 127 else 3
    header = b"AC\x01" + bytes([codec_id, x.dim()]) + struct.pack(f"<{x.dim()}I", *x.shape)
    return header + struct.pack("<I", block) + absmax.numpy().astype("<f4").tobytes() + data


def reference_dequantize(payload: bytes, block: int, qmax: int, shape: tuple[int, ...]) -> torch.Tensor:
    """q * absmax / qmax per block, from the payload's bytes, one value at a time."""
    n = math.prod(shape)
    nblocks = -(-n // block)
    at = 5 + 4 * len(shape) + 4
    absmax = struct.unpack_from(f"<{nblocks}f", payload, at)
    data = payload[at + 4 * nblocks :]
    if qmax == 127:
        q = [b - 256 if b > 127 else b for b in data]
    else:
        q = [nibble - 8 for b in data for nibble in (b & 0x0F, b >> 4)][:n]
    f32 = np.float32
    with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf -> NaN, 127 * 3e38 -> inf
        values = [f32(f32(v) * f32(absmax[i // block])) / f32(qmax) for i, v in enumerate(q)]
    return torch.tensor(np.array(values, dtype=np.float32)).reshape(shape)


def random_case(seed: int) -> tuple[torch.Tensor, int]:
    """A tensor and block size: odd sizes and blocks, partial last blocks, steps crossed, scales from
    subnormal to near overflow, and blocks of NaN, ±inf, zeros and signed zeros."""
    rng = random.Random(seed)
    block = rng.choice([1, 2, 3, 5, 7, 64, 64, 100, 1000])
    n = rng.choice([1, 2, 3, 63, 64, 65, 129, 1001, 4097, 65535, 65536, 65537, 131075])
    x = gaussian(n, seed=seed) * 10.0 ** rng.uniform(-42, 37)
    for _ in range(rng.choice([0, 0, 1, 4])):
        x[rng.randrange(n)] = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3e38, -3e38])
    if n > 2 * block and rng.random() < 0.4:
        start = rng.randrange(n - block)
        x[start : start + block] = rng.choice([0.0, -0.0])
    if n % 3 == 0 and rng.random() < 0.5:
        return x.reshape(3, n // 3), block
    return x, block


@pytest.mark.parametrize("seed", range(40))
def test_blockwise_codecs_equal_the_reference(seed: int) -> None:
    x, block = random_case(seed)
    for codec, qmax in [(Int8Codec(block), 127), (Int4Codec(block), 7)]:
        payload = codec.encode("k", x)
        assert payload == reference_blockwise(x, block, qmax), (codec, block, x.shape)
        decoded = decode(payload)
        if x.numel() <= 5000:  # the value-at-a-time reference is slow
            expected = reference_dequantize(payload, block, qmax, tuple(x.shape))
            assert torch.equal(decoded.isnan(), expected.isnan())
            assert torch.equal(
                decoded.nan_to_num(0.0, math.inf, -math.inf), expected.nan_to_num(0.0, math.inf, -math.inf)
            )


@pytest.mark.parametrize("seed", range(10))
def test_dense_codecs_equal_the_reference(seed: int) -> None:
    x, _ = random_case(seed)
    header = b"AC\x01" + bytes([0, x.dim()]) + struct.pack(f"<{x.dim()}I", *x.shape)
    assert make_codec("none").encode("k", x) == header + x.numpy().astype("<f4").tobytes()
    fp16 = header[:3] + b"\x01" + header[4:] + x.to(torch.float16).numpy().astype("<f2").tobytes()
    assert make_codec("fp16").encode("k", x) == fp16
    for payload, expected in [(make_codec("none").encode("k", x), x), (fp16, x.to(torch.float16).float())]:
        decoded = decode(payload)
        assert decoded.dtype == torch.float32 and decoded.shape == x.shape
        assert torch.equal(decoded.nan_to_num(0.5), expected.nan_to_num(0.5))


@contextlib.contextmanager
def address_space_headroom(nbytes: int) -> Iterator[None]:
    """Allocations past `nbytes` more address space fail at once (MemoryError), never page in."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs Linux /proc")
    used = re.search(r"VmSize:\s+(\d+) kB", status.read_text())
    assert used is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (int(used.group(1)) * 1024 + nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_block_larger_than_the_tensor_costs_only_the_tensor() -> None:
    """Nothing is padded to a whole block: a payload's block size comes from the network, up to
    2**32 - 1, and a padded block that large would take 16 GB (here: a MemoryError). The first
    release padded on both sides: 4 bytes of a payload could make its receiver allocate 16 GB."""
    x = gaussian(10)
    for big, small in [(Int8Codec(2**32 - 1), Int8Codec(10)), (Int4Codec(2**32 - 1), Int4Codec(10))]:
        expected = small.encode("k", x)
        with address_space_headroom(1 << 30):
            payload = big.encode("k", x)
            decoded = decode(payload)
        assert payload[:9] == expected[:9] and payload[13:] == expected[13:]  # one block either way
        assert torch.equal(decoded, decode(expected))
    with address_space_headroom(1 << 30):  # a chunk of 2**24 values: nothing chunk-sized either
        decoded = decode(SparseCodec(1, 2**24, 8).encode("k", x))
    assert decoded.count_nonzero() == 1 and float(decoded.abs().max()) == float(x.abs().max())


def test_decoded_tensors_are_writable_and_do_not_alias_the_payload() -> None:
    x = gaussian(3, 70)
    for codec in every_codec():
        payload = codec.encode("k", x)
        copy = bytearray(payload)
        first = decode(payload)
        first.add_(1.0)
        assert not torch.equal(decode(payload), first)
        assert payload == copy


def test_encode_and_decode_never_warn() -> None:
    """No numpy floating-point warnings (inf / inf, 0 * inf are the point) and no torch warning
    about tensors over read-only memory: decoded payloads come from the network as `bytes`."""
    x = gaussian(300)
    x[3], x[70], x[140], x[141] = math.nan, math.inf, -math.inf, 3e38
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for codec in every_codec():
            decode(codec.encode("k", x))
            decode(codec.encode("k", x.reshape(3, 100)))


# --- non-finite input ---------------------------------------------------------------------------


def test_nan_input_is_carried_not_hidden() -> None:
    x = gaussian(128)
    x[3] = math.nan
    x[70] = math.inf
    for spec in ("none", "fp16"):
        y = decode(make_codec(spec).encode("k", x))
        assert math.isnan(y[3]) and math.isinf(y[70]) and torch.isfinite(y[[0, 64, 127]]).all()
    for spec in ("int8", "int4"):
        y = decode(make_codec(spec).encode("k", x))
        assert torch.isnan(y[:64]).all() and torch.isnan(y[64:]).all()
    y = decode(make_codec("int8").encode("k", torch.cat([x[:64], gaussian(64)])))
    assert torch.isnan(y[:64]).all() and torch.isfinite(y[64:]).all()


def test_nan_input_poisons_low_rank_output_but_not_its_warm_start() -> None:
    clean = gaussian(64, 48)
    dirty = clean.clone()
    dirty[5, 5] = math.nan
    codec = make_codec("lowrank:4")
    payload = codec.encode("w", dirty)
    assert len(payload) == codec.wire_bytes((64, 48))
    assert torch.isnan(decode(payload)).all()
    assert codec.encode("w", clean) == make_codec("lowrank:4").encode("w", clean)


# --- dict helpers -------------------------------------------------------------------------------


def test_tensor_dict_helpers() -> None:
    x = {"a": gaussian(3, 5), "b": gaussian(7)}
    payloads = encode_tensors(make_codec("none"), x)
    assert wire_bytes_of(payloads) == (5 + 8 + 60) + (5 + 4 + 28)
    decoded = decode_tensors(payloads)
    assert decoded.keys() == x.keys() and all(torch.equal(decoded[k], x[k]) for k in x)


def test_relative_error_hand_computed() -> None:
    x = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([0.0, 4.0])}
    x_hat = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([0.0, 0.0])}
    assert relative_error(x, x_hat) == pytest.approx(0.8)
    assert relative_error(torch.tensor([2.0]), torch.tensor([1.0])) == pytest.approx(0.5)
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError):
        relative_error(x, {"a": x_hat["a"]})
    with pytest.raises(ValueError):
        relative_error(torch.zeros(3), torch.zeros(4))


# --- error feedback -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "steps"), [("int4", 50), ("lowrank:2", 100), ("lowrank:2:int4", 100)])
def test_error_feedback_mean_converges_to_delta(spec: str, steps: int) -> None:
    delta = {"w": gaussian(32, 24, seed=3), "b": gaussian(24, seed=4)}
    single = relative_error(delta, decode_tensors(encode_tensors(make_codec(spec), delta)))
    feedback, codec = ErrorFeedback(), make_codec(spec)
    total = {key: torch.zeros_like(t) for key, t in delta.items()}
    for _ in range(steps):
        for key, t in decode_tensors(feedback.compress(codec, delta)).items():
            total[key] += t
    mean = {key: t / steps for key, t in total.items()}
    # sum of decoded = steps * delta - final residual, so the mean's error is |e| / steps.
    assert relative_error(delta, mean) < 0.1 * single
    expected = (
        feedback.residual_norm() / steps / math.sqrt(sum(float(t.square().sum()) for t in delta.values()))
    )
    assert relative_error(delta, mean) == pytest.approx(expected, rel=1e-3)


def test_error_feedback_residual_is_what_receivers_miss() -> None:
    delta = {"w": gaussian(100)}
    feedback = ErrorFeedback()
    payloads = feedback.compress(make_codec("int4"), delta)
    residual = feedback.state_dict()["w"]
    torch.testing.assert_close(residual, delta["w"] - decode(payloads["w"]))
    assert feedback.residual_norm() == pytest.approx(float(residual.norm()), rel=1e-5)
    payloads = feedback.compress(make_codec("int4"), delta)
    torch.testing.assert_close(
        decode(payloads["w"]), decode(make_codec("int4").encode("w", delta["w"] + residual))
    )


def test_error_feedback_in_place_gives_the_out_of_place_bits_and_leaves_delta_alone() -> None:
    delta = {"w": gaussian(300, seed=5)}
    original = delta["w"].clone()
    feedback, codec = ErrorFeedback(), make_codec("int8")
    first = feedback.compress(codec, delta)["w"]
    e1 = original - decode(first)
    second = feedback.compress_tensor(codec, "w", delta["w"])
    assert second == codec.encode("w", original + e1)
    assert torch.equal(feedback.state_dict()["w"], (original + e1) - decode(second))
    assert torch.equal(delta["w"], original)  # the caller's Δ is read, never written


def test_error_feedback_in_bf16_sends_fp32_delta_plus_e_and_keeps_its_rounding() -> None:
    """A bf16 residual costs 2 bytes per value; what is encoded is Δ + e formed in fp32, and what is
    kept is exactly Δ + e − decode(c) rounded once to bf16."""
    delta = {"w": gaussian(300, seed=6)}
    feedback, codec = ErrorFeedback(torch.bfloat16), make_codec("int8")
    first = feedback.compress(codec, delta)["w"]
    e1 = (delta["w"] - decode(first)).to(torch.bfloat16)
    assert torch.equal(feedback.state_dict()["w"], e1) and e1.element_size() == 2
    second = feedback.compress_tensor(codec, "w", delta["w"])
    assert second == codec.encode("w", delta["w"] + e1.float())
    e2 = feedback.state_dict()["w"]
    assert e2.dtype == torch.bfloat16
    assert torch.equal(e2, ((delta["w"] + e1.float()) - decode(second)).to(torch.bfloat16))


def test_error_feedback_in_bf16_still_sends_delta_on_average() -> None:
    delta = {"w": gaussian(32, 24, seed=3), "b": gaussian(24, seed=4)}
    single = relative_error(delta, decode_tensors(encode_tensors(make_codec("int4"), delta)))
    feedback, codec = ErrorFeedback(torch.bfloat16), make_codec("int4")
    total = {key: torch.zeros_like(t) for key, t in delta.items()}
    for _ in range(50):
        for key, t in decode_tensors(feedback.compress(codec, delta)).items():
            total[key] += t
    assert relative_error(delta, {key: t / 50 for key, t in total.items()}) < 0.1 * single


def test_int8_residual_keeps_each_value_to_half_its_blocks_power_of_two_scale() -> None:
    """1 + 4/256 bytes per value; every value within half its block's scale, a power of two ≤ 2 ×
    the block's largest magnitude / 127; a block of zeros stays zero; the input is not written."""
    values = gaussian(3 * RESIDUAL_BLOCK + 17, seed=7) * torch.linspace(0.0, 5.0, 3 * RESIDUAL_BLOCK + 17)
    values[RESIDUAL_BLOCK : 2 * RESIDUAL_BLOCK] = 0.0
    original = values.clone()
    kept = Int8Residual(values)
    assert torch.equal(values, original)
    assert kept.nbytes() == values.numel() + 4 * 4
    restored = kept.dequantize()
    for block, scale in enumerate(kept.scales.tolist()):
        part = slice(block * RESIDUAL_BLOCK, (block + 1) * RESIDUAL_BLOCK)
        largest = float(values[part].abs().max())
        if largest == 0.0:
            assert scale == 0.0 and not restored[part].any()
            continue
        assert math.log2(scale).is_integer() and largest / 127 <= scale < 2 * largest / 127
        assert float((restored[part] - values[part]).abs().max()) <= scale / 2


def test_error_feedback_in_int8_sends_fp32_delta_plus_e_and_checkpoints_exactly() -> None:
    delta = {"w": gaussian(1000, seed=8)}
    feedback, codec = ErrorFeedback(torch.int8), make_codec("int8")
    first = feedback.compress(codec, delta)["w"]
    e1 = Int8Residual(delta["w"] - decode(first)).dequantize()
    saved = feedback.state_dict()["w"]
    assert saved.dtype == torch.bfloat16 and torch.equal(saved.float(), e1)  # code × 2^k: exact in bf16
    second = feedback.compress_tensor(codec, "w", delta["w"])
    assert second == codec.encode("w", delta["w"] + e1)
    reloaded = ErrorFeedback(torch.int8)
    reloaded.load_state_dict(feedback.state_dict())
    assert torch.equal(reloaded.state_dict()["w"], feedback.state_dict()["w"])
    assert reloaded.residual_norm() == feedback.residual_norm() > 0


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_error_feedback_in_int8_still_sends_delta_on_average(spec: str) -> None:
    delta = {"w": gaussian(32, 24, seed=3), "b": gaussian(24, seed=4)}
    single = relative_error(delta, decode_tensors(encode_tensors(make_codec(spec), delta)))
    feedback, codec = ErrorFeedback(torch.int8), make_codec(spec)
    total = {key: torch.zeros_like(t) for key, t in delta.items()}
    for _ in range(50):
        for key, t in decode_tensors(feedback.compress(codec, delta)).items():
            total[key] += t
    assert relative_error(delta, {key: t / 50 for key, t in total.items()}) < 0.1 * single


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.int8, torch.float32)],
)
def test_error_feedback_loads_a_residual_saved_in_the_other_dtype(
    saved: torch.dtype, loaded: torch.dtype
) -> None:
    source = ErrorFeedback(saved)
    source.compress(make_codec("int4"), {"w": gaussian(100)})
    target = ErrorFeedback(loaded)
    target.load_state_dict(source.state_dict())
    restored = target.state_dict()["w"]
    assert restored.dtype == loaded
    assert torch.equal(restored, source.state_dict()["w"].to(loaded))


def test_error_feedback_refuses_another_residual_dtype() -> None:
    with pytest.raises(ValueError, match="residual dtype"):
        ErrorFeedback(torch.float16)


def test_error_feedback_lossless_codec_keeps_no_residual() -> None:
    feedback = ErrorFeedback()
    feedback.compress(make_codec("none"), {"w": gaussian(10)})
    assert feedback.residual_norm() == 0.0


def test_error_feedback_state_reset_and_shape_change() -> None:
    delta = {"w": gaussian(100)}
    a = ErrorFeedback()
    a.compress(make_codec("int4"), delta)
    b = ErrorFeedback()
    b.load_state_dict(a.state_dict())
    assert b.compress(make_codec("int4"), delta) == a.compress(make_codec("int4"), delta)
    with pytest.raises(ValueError, match="reset"):
        a.compress(make_codec("int4"), {"w": gaussian(50)})
    a.reset()
    assert a.residual_norm() == 0.0
    a.compress(make_codec("int4"), {"w": gaussian(50)})
    residual = b.state_dict()["w"]
    with pytest.raises(ValueError, match="not a float tensor"):
        b.load_state_dict({"w": torch.zeros(100), "v": torch.zeros(3, dtype=torch.int64)})
    assert torch.equal(b.state_dict()["w"], residual)


def test_error_feedback_drops_non_finite_residual() -> None:
    feedback = ErrorFeedback()
    dirty = gaussian(100)
    dirty[0] = math.nan
    feedback.compress(make_codec("int8"), {"w": dirty})
    assert math.isfinite(feedback.residual_norm())


# --- adaptive chooser ---------------------------------------------------------------------------


def gaussian_dict() -> dict[str, torch.Tensor]:
    return {"w": gaussian(128, 96, seed=11), "b": gaussian(96, seed=12)}


def test_choose_cheapest_meeting_error() -> None:
    tensors = gaussian_dict()
    choice = choose_codec(tensors, candidates=DEFAULT_CANDIDATES, max_rel_error=0.01, byte_budget=None)
    assert (choice.spec, choice.reason) == ("int8", REASON_MEETS_BOTH)
    assert choice.wire_bytes == wire_bytes_of(encode_tensors(make_codec("int8"), tensors))
    assert choice.rel_error < 0.01
    assert choose_codec(tensors, max_rel_error=1.0).spec == "lowrank:1"


def test_choose_low_rank_for_low_rank_input() -> None:
    tensors = {"w": low_rank_matrix(128, 96, rank=2)}
    assert choose_codec(tensors, max_rel_error=0.05).spec == "lowrank:2"


def test_choose_lowest_error_within_budget_when_error_unreachable() -> None:
    tensors = gaussian_dict()
    fp16_bytes = wire_bytes_of(encode_tensors(make_codec("fp16"), tensors))
    choice = choose_codec(tensors, max_rel_error=1e-6, byte_budget=fp16_bytes)
    assert (choice.spec, choice.reason) == ("fp16", REASON_LOWEST_ERROR)


def test_choose_cheapest_overall_when_nothing_fits_budget() -> None:
    choice = choose_codec(
        gaussian_dict(), candidates=["int8", "fp16", "int4"], max_rel_error=0.01, byte_budget=10
    )
    assert (choice.spec, choice.reason) == ("int4", REASON_OVER_BUDGET)


def test_choose_is_deterministic_and_ignores_warm_state() -> None:
    tensors = gaussian_dict()
    first = choose_codec(tensors, max_rel_error=0.9)
    warm = make_codec(first.spec)
    for _ in range(3):
        warm.encode("w", tensors["w"])
    assert choose_codec(tensors, max_rel_error=0.9) == first
    assert choose_codec(tensors, candidates=["int8", "int8"], max_rel_error=0.0).spec == "int8"
    with pytest.raises(ValueError):
        choose_codec(tensors, candidates=[], max_rel_error=0.1)


def test_choose_reads_payloads_a_tensor_at_a_time_and_chooses_as_over_the_decoded_tensors() -> None:
    """Given the encoded tensors (`Payloads`, the averaged Δ̄'s payloads as the node gives them), every
    candidate's bytes and error and the choice are those over the decoded dict, bit for bit, and the
    errors those `relative_error` takes over the whole; and at each decode at most one other decoded
    tensor is alive: the whole (ten tensors here) is never held."""
    tensors = {f"t{k}": gaussian(64, 48, seed=k) for k in range(9)} | {"low": low_rank_matrix(64, 48, rank=2)}
    payloads = encode_tensors(make_codec("fp16"), tensors)
    decoded = decode_tensors(payloads)
    for spec in DEFAULT_CANDIDATES:
        whole = relative_error(decoded, decode_tensors(encode_tensors(make_codec(spec), decoded)))
        assert measured_error(spec, Payloads(payloads)) == measured_error(spec, decoded) == whole
        assert predicted_wire_bytes(spec, Payloads(payloads)) == predicted_wire_bytes(spec, decoded)

    class Watched(Payloads):
        def __init__(self, payloads: dict[str, bytes]) -> None:
            super().__init__(payloads)
            self.live: list[StorageWeakRef] = []
            self.most_others = 0

        def __getitem__(self, key: str) -> torch.Tensor:
            self.live = [ref for ref in self.live if not ref.expired()]  # type: ignore[no-untyped-call]
            self.most_others = max(self.most_others, len(self.live))
            tensor = super().__getitem__(key)
            self.live.append(StorageWeakRef(tensor.untyped_storage()))  # type: ignore[no-untyped-call]
            return tensor

    for bound in (0.5, 1e-3, 1e-9):
        watched = Watched(payloads)
        choice = choose_codec(watched, max_rel_error=bound)
        assert choice == choose_codec(decoded, max_rel_error=bound)
        assert watched.most_others <= 1
        # (the norm summed once for all candidates: the error of the candidate chosen, alone)
        assert choice.rel_error == measured_error(choice.spec, decoded)


# --- span by span (an owner's reduction and a member's checks, issue 28 §2) ---------------------

SPAN_SHAPES = [(), (0,), (7,), (SPAN + 77,), (3 * SPAN,), (1025, 2049)]
SPAN_CODECS: list[Callable[[], Codec]] = [
    *(
        functools.partial(make_codec, spec)
        for spec in ("none", "fp16", "int8", "int4", "sparse", "lowrank:3")
    ),
    functools.partial(Int8Codec, 100),  # blocks that straddle spans
    functools.partial(Int4Codec, 33),
]


@pytest.mark.parametrize("make", SPAN_CODECS)
@pytest.mark.parametrize("shape", SPAN_SHAPES)
def test_a_payload_decoded_span_by_span_is_its_whole_decode_bit_for_bit(
    make: Callable[[], Codec], shape: tuple[int, ...]
) -> None:
    """`decoded_spans` yields `SPAN` values at a time (the last fewer), and together they are
    `decode`'s values bit for bit, NaN included, whatever the block size."""
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    if tensor.numel() > 10:
        tensor.view(-1)[5] = math.nan
    payload = make().encode("w", tensor)
    spans = list(decoded_spans(payload))
    assert [len(s) for s in spans[:-1]] == [SPAN] * (len(spans) - 1)
    whole = decode(payload).reshape(-1)
    joined = torch.cat(spans) if spans else torch.empty(0)
    assert torch.equal(joined.view(torch.int32), whole.view(torch.int32))


@pytest.mark.parametrize("make", SPAN_CODECS)
@pytest.mark.parametrize("shape", SPAN_SHAPES)
def test_a_codec_encodes_from_spans_the_bytes_it_encodes_whole(
    make: Callable[[], Codec], shape: tuple[int, ...]
) -> None:
    """`encode_spans` of a tensor's values, `SPAN` at a time, gives `encode`'s bytes (the dense
    codecs encode each span as it comes; the others gather them first)."""
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    flat = tensor.reshape(-1)
    spans = (flat[start : start + SPAN] for start in range(0, flat.numel(), SPAN))
    assert make().encode_spans("w", tuple(shape), spans) == make().encode("w", tensor)
    with pytest.raises(ValueError, match="span"):  # too few values for the shape
        make().encode_spans("w", (flat.numel() + 1,), [flat])


def test_a_dense_payload_is_read_a_span_at_a_time() -> None:
    """Reading an int8 payload of 16 Mi values span by span allocates a few spans' worth of memory
    (numpy's allocations, traced), not the 64 MiB its whole decode does."""
    payload = make_codec("int8").encode("w", gaussian(16 * SPAN, seed=5))
    tracemalloc.start()
    try:
        for _ in decoded_spans(payload):
            pass
        _, spans_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        decode(payload)
        _, whole_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert spans_peak < 3 * 4 * SPAN < 64 * 2**20 <= whole_peak


def test_an_int8_residual_is_fed_back_a_span_at_a_time() -> None:
    """Two rounds of error feedback into an int8 residual over a tensor of 16 Mi values, the first
    from no residual: the payloads and the residual are those of the arithmetic done whole (e + Δ
    encoded, the decoded payload taken off, e stored), bit for bit, and each round allocates (traced)
    about its payload's bytes, twice, and a few spans, where decoding the payload whole alone is
    64 MiB: the residual, e + Δ and the decoded payload whole were 12 B/param of the largest tensor
    in every contribution."""
    numel = 16 * SPAN
    generator = torch.Generator().manual_seed(12)
    deltas = [torch.randn(numel, generator=generator) for _ in range(2)]
    codec = make_codec("int8")
    feedback = ErrorFeedback(torch.int8)
    residual = Int8Residual(torch.zeros(numel))
    for delta in deltas:
        tracemalloc.start()
        try:
            payload = feedback.compress_tensor(codec, "w", delta)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        whole = residual.dequantize().add_(delta)
        assert payload == codec.encode("w", whole)
        residual.store(whole.sub_(decode(payload)))
        assert torch.equal(feedback.state_dict()["w"], residual.dequantize(torch.bfloat16))
        assert peak < 2 * len(payload) + 6 * 4 * SPAN < 4 * numel
