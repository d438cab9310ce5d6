"""The SparseLoCo-style codec: exact wire size, exact top-k support, bounded value error, a plain
reference for its bytes, malformed payloads refused, error feedback and the owner's re-encoding."""

from __future__ import annotations

import itertools
import math
import random
import struct
from typing import cast

import numpy as np
import pytest
import torch

from adloco.protocol.algorithms.codecs import SparseCodec, decode, make_codec, payload_shape
from adloco.protocol.algorithms.feedback import ErrorFeedback
from adloco.protocol.algorithms.parts import reduce_part

# GPT-2 124M (tied embedding): 124,439,808 values.
GPT2_124M_SHAPES = [(50257, 768), (1024, 768), (768,), (768,)] + 12 * [
    (768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
    (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,),
]  # fmt: skip


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def top_k_support(x: torch.Tensor, k: int, chunk: int) -> list[list[int]]:
    """Per chunk of the flattened `x`, the ascending indices of its k largest |x|, ties lowest
    index first, NaN and inf the largest; a partial last chunk keeps ceil(k * len / chunk)."""
    flat = x.reshape(-1).tolist()
    support = []
    for start in range(0, len(flat), chunk):
        part = flat[start : start + chunk]
        keep = k if len(part) == chunk else -(-k * len(part) // chunk)
        magnitude = [abs(v) if not math.isnan(v) else math.inf for v in part]
        support.append(sorted(sorted(range(len(part)), key=lambda i: (-magnitude[i], i))[:keep]))
    return support


def pack_bits(values: list[int], width: int) -> bytes:
    bits = sum(v << (i * width) for i, v in enumerate(values))
    return bits.to_bytes(-(-len(values) * width // 8), "little")


def reference_sparse(x: torch.Tensor, k: int, chunk: int, bits: int) -> bytes:
    """The payload by its definition, a value at a time in float32."""
    f32 = np.float32
    flat = x.reshape(-1).float().numpy()
    levels = 1 << (bits - 1)
    los, his, indices, codes = [], [], [], []
    for start, rows in zip(itertools.count(0, chunk), top_k_support(x, k, chunk), strict=False):
        picked = [flat[start + i] for i in rows]
        indices += rows
        if not all(math.isfinite(v) for v in picked):
            los.append(math.nan)
            his.append(math.nan)
            codes += [0] * len(rows)
            continue
        lo, hi = min(abs(v) for v in picked), max(abs(v) for v in picked)
        los.append(lo)
        his.append(hi)
        span = f32(f32(hi) - f32(lo))
        for v in picked:
            level = (
                0 if span == 0 else min(levels - 1, math.floor(f32(f32(abs(v)) - lo) / span * f32(levels)))
            )
            codes.append(level + levels * bool(v < 0))
    header = b"AC\x01\x05" + bytes([x.dim()]) + struct.pack(f"<{x.dim()}I", *x.shape)
    return (
        header
        + struct.pack("<IIB", chunk, k, bits)
        + np.array(los + his, dtype="<f4").tobytes()
        + pack_bits(indices, (chunk - 1).bit_length())
        + pack_bits(codes, bits)
    )


# --- wire format --------------------------------------------------------------------------------


def test_hand_computed_payload() -> None:
    x = torch.tensor([0.5, -3.0, 1.0, 2.0, 0.0, 0.0, -1.0, 4.0, 7.0])
    payload = SparseCodec(2, 4, 2).encode("k", x)
    # Chunk [0.5, -3, 1, 2]: picks 1 and 3, lo 2, hi 3, levels of width 0.5: -3 -> sign 1, level 1
    # (code 3), 2 -> level 0 (code 0). Chunk [0, 0, -1, 4]: picks 2 and 3, lo 1, hi 4 (width 1.5):
    # -1 -> code 2, 4 -> code 1. Tail [7]: keeps ceil(2 * 1 / 4) = 1 value, lo = hi = 7, code 0.
    assert payload == (
        b"AC\x01\x05\x01"
        + struct.pack("<I", 9)
        + struct.pack("<IIB", 4, 2, 2)
        + struct.pack("<6f", 2.0, 1.0, 7.0, 3.0, 4.0, 7.0)
        + bytes([1 | 3 << 2 | 2 << 4 | 3 << 6, 0])  # indices 1, 3, 2, 3, 0 at 2 bits
        + bytes([3 | 0 << 2 | 2 << 4 | 1 << 6, 0])  # codes 3, 0, 2, 1, 0 at 2 bits
    )
    expected = torch.tensor([0.0, -2.75, 0.0, 2.25, 0.0, 0.0, -1.75, 3.25, 7.0])
    assert torch.equal(decode(payload), expected)


@pytest.mark.parametrize(
    ("shape", "codec", "expected"),
    [
        # header 9, params 9, scales 8, 64 x 12-bit indices 96, 64 x 2-bit codes 16
        ((4096,), SparseCodec(), 9 + 9 + 8 + 96 + 16),
        # 2 chunks of 4096 and one of 808 keeping ceil(64 * 808 / 4096) = 13: 141 entries
        ((3, 3000), SparseCodec(), 13 + 9 + 24 + -(-141 * 12 // 8) + -(-141 * 2 // 8)),
        ((768,), SparseCodec(), 9 + 9 + 8 + -(-12 * 12 // 8) + -(-12 * 2 // 8)),
        ((0,), SparseCodec(), 9 + 9),
        ((), SparseCodec(), 5 + 9 + 8 + 2 + 1),
        ((5, 7), SparseCodec(1, 1, 1), 13 + 9 + 8 * 35 + 0 + 5),  # chunks of 1: no index bits
    ],
    ids=str,
)
def test_wire_bytes_is_exact(shape: tuple[int, ...], codec: SparseCodec, expected: int) -> None:
    assert codec.wire_bytes(shape) == expected
    x = gaussian(*shape) if shape else torch.tensor(0.5)
    assert len(codec.encode("k", x)) == expected


def test_compression_ratio_against_fp32() -> None:
    codec = make_codec("sparse")
    chunk = 4 * 4096 / (codec.wire_bytes((4096 * 4096,)) / 4096)
    numel = sum(math.prod(s) for s in GPT2_124M_SHAPES)
    model = 4 * numel / sum(codec.wire_bytes(s) for s in GPT2_124M_SHAPES)
    print(f"sparse:64/4096:2 vs fp32: {chunk:.1f}x per whole chunk, {model:.1f}x on GPT-2 124M")
    # A whole chunk: 64 x (12 + 2) bits + 2 x 32 bits of scales = 960 bits for 4096 x 32.
    assert chunk == pytest.approx(4096 * 32 / 960, rel=1e-3)
    assert numel == 124_439_808 and 130 < model < chunk


# --- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "k", "chunk", "bits"),
    [
        ((4096 * 3 + 100,), 64, 4096, 2),
        ((200,), 64, 4096, 2),
        ((33, 17), 5, 64, 3),
        ((1000,), 7, 100, 1),
        ((300,), 3, 7, 8),
    ],
    ids=str,
)
def test_round_trip_keeps_exactly_the_top_k_within_half_a_step(
    shape: tuple[int, ...], k: int, chunk: int, bits: int
) -> None:
    x = gaussian(*shape, seed=sum(shape)) * torch.logspace(-3, 3, math.prod(shape)).reshape(shape)
    y = decode(SparseCodec(k, chunk, bits).encode("k", x)).reshape(-1)
    flat, levels = x.reshape(-1), 1 << (bits - 1)
    for start, rows in zip(itertools.count(0, chunk), top_k_support(x, k, chunk), strict=False):
        part, got = flat[start : start + chunk], y[start : start + chunk]
        assert got.nonzero().reshape(-1).tolist() == rows
        picked = part[rows].abs()
        half_step = float(picked.max() - picked.min()) / (2 * levels)
        assert torch.equal(got[rows].sign(), part[rows].sign())
        rounding = 4 * float(torch.finfo(torch.float32).eps * picked.max())  # a few ulps of fp32
        assert float((got[rows] - part[rows]).abs().max()) <= half_step + rounding


def test_ties_zeros_and_signed_zeros() -> None:
    codec = SparseCodec(4, 16, 2)
    assert torch.equal(decode(codec.encode("k", torch.zeros(40))), torch.zeros(40))
    assert torch.equal(decode(codec.encode("k", torch.zeros(0, 3))), torch.zeros(0, 3))
    y = decode(codec.encode("k", torch.full((16,), -0.0)))
    assert torch.equal(y, torch.zeros(16))
    ties = torch.tensor([1.0, -1.0] * 8)
    assert torch.equal(decode(codec.encode("k", ties)), torch.tensor([1.0, -1.0] * 2 + [0.0] * 12))
    x = torch.tensor([0.0] * 10 + [2.0, 2.0, -2.0, 2.0, 3.0, 2.0])  # ties below the top one
    assert decode(codec.encode("k", x)).nonzero().reshape(-1).tolist() == [10, 11, 12, 14]


def random_case(seed: int) -> tuple[torch.Tensor, SparseCodec]:
    """Odd chunk sizes and partial chunks, ties (values on a coarse grid), NaN/inf, zero chunks."""
    rng = random.Random(seed)
    chunk = rng.choice([1, 2, 7, 64, 100, 4096])
    k = rng.randint(1, min(chunk, 70))
    n = rng.choice([1, 5, 63, 64, 65, 1000, 4097, 9000])
    x = gaussian(n, seed=seed) * 10.0 ** rng.uniform(-30, 30)
    if rng.random() < 0.4:
        x = torch.round(x / x.abs().max() * 4)
    for _ in range(rng.choice([0, 0, 1, 3])):
        x[rng.randrange(n)] = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0])
    return x, SparseCodec(k, chunk, rng.randint(1, 8))


@pytest.mark.parametrize("seed", range(30))
def test_payload_equals_the_reference(seed: int) -> None:
    x, codec = random_case(seed)
    payload = codec.encode("k", x)
    assert payload == reference_sparse(x, codec.k, codec.chunk, codec.bits), codec
    decoded = decode(payload)
    for start, rows in zip(
        itertools.count(0, codec.chunk), top_k_support(x, codec.k, codec.chunk), strict=False
    ):
        part = x[start : start + codec.chunk]
        poisoned = not bool(torch.isfinite(part[rows]).all())
        assert bool(decoded[start : start + codec.chunk].isnan().all()) == poisoned


def test_same_input_same_bytes_whatever_the_threads() -> None:
    x = torch.round(gaussian(5, 9000, seed=3) * 3)  # many ties
    before = torch.get_num_threads()
    payload = make_codec("sparse").encode("k", x)
    try:
        torch.set_num_threads(1)
        assert make_codec("sparse").encode("k", x) == payload
    finally:
        torch.set_num_threads(before)
    assert make_codec("sparse").encode("k", x.double()) == payload


def test_non_finite_chunk_decodes_to_nan_and_leaves_the_others() -> None:
    x = gaussian(3 * 64)
    x[70] = math.inf
    y = decode(SparseCodec(4, 64, 2).encode("k", x))
    assert y[64:128].isnan().all() and not y[:64].isnan().any() and not y[128:].isnan().any()


# --- specs and malformed payloads ---------------------------------------------------------------


def test_specs() -> None:
    assert make_codec("sparse").name == "sparse:64/4096:2"
    assert make_codec("sparse:32/1024").name == "sparse:32/1024:2"
    assert make_codec("sparse:8/8:8").name == "sparse:8/8:8"
    assert make_codec(make_codec("sparse:3/100:5").name).name == "sparse:3/100:5"


@pytest.mark.parametrize(
    "spec",
    ["sparse:0/4096", "sparse:65/64", "sparse:64/4096:9", "sparse:64/4096:0", "sparse:64", "sparse:64/0",
     f"sparse:1/{2**24 + 1}", "sparse:64/4096:2:1", "sparse:", "sparse:064/4096"],
)  # fmt: skip
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="valid: none, fp16"):
        make_codec(spec)


def test_bad_parameters_and_indices_are_refused() -> None:
    payload = SparseCodec(2, 4, 2).encode("k", torch.tensor([0.5, -3.0, 1.0, 2.0, 0.0, 0.0, -1.0, 4.0, 7.0]))
    params = 9  # where chunk, k, bits start
    for chunk, k, bits in [(0, 2, 2), (4, 0, 2), (4, 5, 2), (4, 2, 0), (4, 2, 9), (2**24 + 1, 2, 2)]:
        with pytest.raises(ValueError, match="corrupt sparse payload"):
            decode(payload[:params] + struct.pack("<IIB", chunk, k, bits) + payload[params + 9 :])
    indices = len(payload) - 4
    for bad in [
        [1, 1, 2, 3, 0],  # a repeated index
        [3, 1, 2, 3, 0],  # decreasing
        [1, 3, 2, 3, 1],  # past the end of the partial chunk of 1
    ]:
        corrupt = payload[:indices] + pack_bits(bad, 2) + payload[indices + 2 :]
        for check in (decode, payload_shape):
            with pytest.raises(ValueError, match="indices"):
                check(corrupt)
    # 7-value chunks take 3-bit indices, which can say 7: outside the chunk.
    seven = SparseCodec(1, 7, 1).encode("k", gaussian(7))
    with pytest.raises(ValueError, match="indices"):
        decode(seven[:-2] + bytes([7, seven[-1]]))


# --- error feedback -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "shape", "rounds"), [("sparse:4/64:2", (64, 48), 300), ("sparse", (2, 4096), 400)]
)
def test_error_feedback_sends_delta_over_rounds_with_a_bounded_residual(
    spec: str, shape: tuple[int, ...], rounds: int
) -> None:
    """Σ decoded = Σ Δ − e exactly (up to fp32 sums), the residual stops growing, and the mean of
    what was sent approaches Δ though a single round sends 1-6 % of its values."""
    delta = gaussian(*shape, seed=5)
    codec, feedback = make_codec(spec), ErrorFeedback()
    single = float((decode(codec.encode("w", delta)) - delta).norm() / delta.norm())
    sent = torch.zeros(shape, dtype=torch.float64)
    norms = []
    for _ in range(rounds):
        sent += decode(feedback.compress(codec, {"w": delta})["w"]).double()
        norms.append(feedback.residual_norm())
    residual = feedback.state_dict()["w"].double()
    torch.testing.assert_close(sent + residual, rounds * delta.double(), rtol=0, atol=1e-3)
    assert max(norms[rounds // 2 :]) <= 1.1 * max(norms[: rounds // 2])
    mean_error = float((sent / rounds - delta).norm() / delta.norm())
    print(f"{spec}: one round {single:.3f}, mean of {rounds} rounds {mean_error:.4f}")
    assert mean_error < 0.2 * single


def test_error_feedback_tracks_a_changing_delta() -> None:
    codec, feedback = make_codec("sparse:8/256:2"), ErrorFeedback()
    total_delta, total_sent, norms = torch.zeros(1000), torch.zeros(1000), []
    for r in range(200):
        delta = gaussian(1000, seed=100 + r)
        total_delta += delta
        total_sent += decode(feedback.compress(codec, {"w": delta})["w"])
        norms.append(feedback.residual_norm())
    torch.testing.assert_close(total_sent + feedback.state_dict()["w"], total_delta, rtol=0, atol=1e-3)
    assert max(norms[100:]) <= 1.5 * max(norms[:100])  # ‖Σ Δ‖ grows, ‖e‖ does not


# --- the owner's answer (the downlink) ----------------------------------------------------------


def test_the_owner_re_sparsifies_the_average_with_the_rounds_codec() -> None:
    """`parts.reduce_part` decodes the members' sparse payloads, averages them (up to 3 x 64 non-zeros
    per chunk) and encodes the average with the same codec: 64 per chunk go back, the rest is lost
    (no owner-side error feedback)."""
    codec = make_codec("sparse")
    members = [gaussian(2, 4096, seed=s) for s in range(3)]
    payloads = [codec.encode("w", m) for m in members]
    part = reduce_part(payloads, [1.0, 1.0, 1.0], codec, "w", outlier_factor=None)
    assert len(part.payload) == codec.wire_bytes((2, 4096)) and not part.rejected
    average = cast(torch.Tensor, sum(decode(p) for p in payloads) / 3)
    answer = decode(part.payload)
    assert int(average.count_nonzero()) > 2 * 64 * 2 and int(answer.count_nonzero()) == 2 * 64
    kept = answer.reshape(-1).nonzero().reshape(-1).tolist()
    assert kept == [c * 4096 + i for c, row in enumerate(top_k_support(average, 64, 4096)) for i in row]
