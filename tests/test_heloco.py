"""HeLoCo correction branches, staleness weights and DyLU on hand-computed 2-D examples."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adloco.protocol.algorithms.heloco import (
    CorrectionReport,
    HelocoConfig,
    correct,
    correct_tensor,
    dylu_inner_steps,
    staleness_weight,
)

F64 = torch.float64
CFG = HelocoConfig()  # c_ok 0.2, k_s 1, beta_max 0.5, k_d 0.5, kappa 1, eps 1e-12


def test_rotate_branch_hand_values() -> None:
    # Δ = [1, 0], m = [0, 1]: c = 0 ∈ [0, c_ok) → rotate; conf = 1/(1 + 1·1) = 0.5
    # λ = min(0.5·(1 − 0)·0.5, 1) = 0.25; ũ = 0.75·[1, 0] + 0.25·[0, 1] = [0.75, 0.25]
    # ||ũ|| = √0.625; Δ̂ = 1·ũ/||ũ|| = [3, 1]/√10 = [0.9486832980505138, 0.31622776601683794]
    out, action = correct_tensor(
        torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0.0, 1.0], dtype=F64), CFG
    )
    assert action == "rotate"
    assert out.tolist() == pytest.approx([0.9486832980505138, 0.31622776601683794], abs=1e-9)


def test_shrink_branch_hand_values() -> None:
    # Δ = [−1, 0.5], m = [1, 0]: ||Δ|| = √5/2, c = −1/(√5/2) = −2/√5 < 0 → shrink
    # conf = (√5/2)/(√5/2 + 1) = √5/(√5 + 2) = 5 − 2√5
    # β = min(1·(2/√5)·(5 − 2√5), 0.5) = 2√5 − 4 ≈ 0.4721
    # Δ̂ = Δ − β·c·||Δ||·v = [−1, 0.5] − (2√5 − 4)·(−1)·[1, 0] = [2√5 − 5, 0.5] = [−0.5278640450004206, 0.5]
    out, action = correct_tensor(
        torch.tensor([-1.0, 0.5], dtype=F64), torch.tensor([1.0, 0.0], dtype=F64), CFG
    )
    assert action == "shrink"
    assert out.tolist() == pytest.approx([-0.5278640450004206, 0.5], abs=1e-9)


def test_shrink_capped_at_beta_max() -> None:
    # Δ = [−1, 0], m = [1, 0]: c = −1, conf = 1/2, k_s = 2 → β = min(2·1·0.5, 0.5) = 0.5
    # Δ̂ = [−1, 0] − 0.5·(−1)·1·[1, 0] = [−0.5, 0]
    cfg = HelocoConfig(k_s=2.0)
    out, action = correct_tensor(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 0.0]), cfg)
    assert action == "shrink"
    assert out.tolist() == [-0.5, 0.0]


def test_keep_and_skip_return_input() -> None:
    delta = torch.tensor([1.0, 1.0])
    # c = ⟨[1, 1], [1, 0]⟩/√2 = 0.707 ≥ 0.2 → keep
    out, action = correct_tensor(delta, torch.tensor([2.0, 0.0]), CFG)
    assert action == "keep" and out is delta
    out, action = correct_tensor(delta, torch.zeros(2), CFG)
    assert action == "skip" and out is delta
    out, action = correct_tensor(torch.zeros(2), torch.ones(2), CFG)
    assert action == "skip"


@pytest.mark.parametrize("cfg", [HelocoConfig(c_ok=-1.0), HelocoConfig(k_s=0.0, k_d=0.0)])
def test_correction_can_be_turned_off(cfg: HelocoConfig) -> None:
    for delta, mom in [([-1.0, 0.5], [1.0, 0.0]), ([1.0, 0.0], [0.0, 1.0]), ([-1.0, 0.0], [1.0, 0.0])]:
        d = torch.tensor(delta)
        out, action = correct_tensor(d, torch.tensor(mom), cfg)
        assert action == "keep" and out is d


def test_rotate_preserves_norm_and_shrink_touches_only_momentum_component() -> None:
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        d, m = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
        out, action = correct_tensor(d, m, CFG)
        seen.add(action)
        v = m / m.norm()
        if action == "rotate":
            assert float(out.norm()) == pytest.approx(float(d.norm()), rel=1e-12)
            assert float((out * v).sum()) > float((d * v).sum())
        if action == "shrink":
            change = out - d
            # the change is parallel to m, so the part of Δ orthogonal to m is untouched
            assert torch.allclose(out - (out * v).sum() * v, d - (d * v).sum() * v, atol=1e-12)
            assert float(change.norm()) == pytest.approx(abs(float((change * v).sum())), rel=1e-9)
            assert float((change * v).sum()) > 0  # moved toward m
    assert seen == {"keep", "shrink", "rotate"}


def test_keeps_dtype_and_shape() -> None:
    d = torch.tensor([[-1.0, 0.5]], dtype=torch.bfloat16)
    out, action = correct_tensor(d, torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16), CFG)
    assert action == "shrink" and out.dtype == torch.bfloat16 and out.shape == (1, 2)
    with pytest.raises(ValueError):
        correct_tensor(torch.zeros(2), torch.zeros(3), CFG)


def test_correct_report() -> None:
    deltas = [
        torch.tensor([1.0, 1.0]),
        torch.tensor([1.0, 0.0]),
        torch.tensor([-1.0, 0.5]),
        torch.tensor([1.0]),
    ]
    momenta = [
        torch.tensor([2.0, 0.0]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([1.0, 0.0]),
        torch.tensor([0.0]),
    ]
    out, report = correct(deltas, momenta, CFG)
    assert len(out) == 4 and out[3] is deltas[3]
    assert (report.keep, report.shrink, report.rotate, report.skip) == (1, 1, 1, 1)
    # before: keep 1/√2, rotate 0, shrink −2/√5 → mean (0.70711 + 0 − 0.89443)/3 = −0.06244
    assert report.mean_cos_before == pytest.approx((1 / math.sqrt(2) - 2 / math.sqrt(5)) / 3, abs=1e-9)
    # after: keep 1/√2; rotate [3, 1]/√10 → 1/√10; shrink [2√5 − 5, 0.5] → (2√5 − 5)/||·||
    shrunk = 2 * math.sqrt(5) - 5
    shrink_after = shrunk / math.hypot(shrunk, 0.5)
    expected_after = (1 / math.sqrt(2) + 1 / math.sqrt(10) + shrink_after) / 3
    assert report.mean_cos_after == pytest.approx(expected_after, abs=1e-9)
    _, empty = correct([torch.zeros(1)], [torch.zeros(1)], CFG)
    assert empty.skip == 1 and math.isnan(empty.mean_cos_before)
    assert isinstance(empty, CorrectionReport)
    with pytest.raises(ValueError):
        correct(deltas, momenta[:2], CFG)


@pytest.mark.parametrize(
    "kwargs",
    [{"c_ok": 1.5}, {"k_s": -1.0}, {"beta_max": 2.0}, {"kappa": -0.1}, {"eps": 0.0}, {"k_d": math.inf}],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HelocoConfig(**kwargs)


def test_staleness_weight() -> None:
    assert staleness_weight(5, kind="constant") == 1.0
    # 1/√(1 + 3) = 0.5; 1/√1 = 1
    assert staleness_weight(3, kind="inv_sqrt") == 0.5
    assert staleness_weight(0, kind="inv_sqrt") == 1.0
    # (50/100)·1/√(1 + 3) = 0.25
    assert staleness_weight(3, kind="tokens", tokens=50, ref_tokens=100) == 0.25
    with pytest.raises(ValueError):
        staleness_weight(-1, kind="constant")
    with pytest.raises(ValueError):
        staleness_weight(1, kind="tokens", tokens=50)
    with pytest.raises(ValueError):
        staleness_weight(1, kind="bogus")  # type: ignore[arg-type]


def test_dylu_inner_steps() -> None:
    # ⌊0.5/1·10⌋ = 5; ⌊0.05/1·10⌋ = 0 → min_steps 1; faster than the reference → H
    assert dylu_inner_steps(10, 0.5, 1.0) == 5
    assert dylu_inner_steps(10, 0.05, 1.0) == 1
    assert dylu_inner_steps(10, 0.05, 1.0, min_steps=2) == 2
    assert dylu_inner_steps(10, 2.0, 1.0) == 10
    # 0.3/0.4·4 is 2.9999999999999996 in floats; it means 3
    assert dylu_inner_steps(4, 0.3, 0.4) == 3
    with pytest.raises(ValueError):
        dylu_inner_steps(10, 1.0, 0.0)
    with pytest.raises(ValueError):
        dylu_inner_steps(10, 1.0, 1.0, min_steps=11)
    with pytest.raises(ValueError):
        dylu_inner_steps(0, 1.0, 1.0)


_PEAK = """
import sys
import torch
from adloco.protocol.algorithms.heloco import Correction, HelocoConfig

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

n = 16 * 2**20
g = torch.Generator().manual_seed(1)
m = torch.randn(n, generator=g)
d = torch.randn(n, generator=g) - float(sys.argv[1]) * m
correction = Correction(HelocoConfig())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident memory starts again from here
before = status("VmRSS:")
out = correction.apply(d, m, scale=0.1)
report = correction.report()
print(status("VmHWM:") - before, report.shrink + report.rotate)
"""


@pytest.mark.parametrize("lean", [2.0, -0.1], ids=["shrink", "rotate"])
def test_a_late_delta_is_corrected_a_slice_at_a_time(lean: float) -> None:
    """Correcting a tensor of 16 Mi values (64 MiB) against 0.1 × its momentum, in a fresh process
    whose large blocks are mapped apart: the peak resident memory grows by the corrected tensor and
    a few float64 slices, not by the float64 copies of Δ, m, v and Δ̂ (4 × 128 MiB) nor a scaled m
    (64 MiB) that a late contribution's largest tensor cost before (issue 28 §2)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident memory")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(lean)], capture_output=True, text=True, check=True, env=env
    )
    grown, corrected = (int(x) for x in out.stdout.split())
    assert corrected == 1
    assert grown < 64 * 2**20 + 4 * 8 * 2**20
