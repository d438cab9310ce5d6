"""Do the computations that decide θ give the same bits on every CPU kernel path and thread count?

Peers on different hardware must hold bit-identical θ after every round (issue 9 §3), or fork healing
downloads the whole state every round. This script runs the θ-deciding computations in fresh
processes that differ only in the kernels torch, MKL and numpy pick, and compares sha256 of what
each produces:

- `ATEN_CPU_CAPABILITY` default / avx2 (torch's elementwise and reduction kernels as on a machine
  without AVX-512, or without any vector unit it knows);
- torch intra-op threads 1 and 3 beside the default 2 (where a parallel loop splits a tensor, and so
  which values land in a vector body or a scalar tail, and the order of a reduction);
- `MKL_ENABLE_INSTRUCTIONS=AVX2` (MKL's matrix products as on AVX2 hardware) and `MKL_CBWR=COMPATIBLE`
  (its generic kernels, as on a CPU MKL has no tuned path for);
- `NPY_DISABLE_CPU_FEATURES` (numpy's loops without any SIMD beyond SSE3).

Each variant first builds the default model from its seed (θ_0, which peers never download).
The inputs (θ, m, and two rounds of averaged Δ̄ encoded with every codec) are drawn once by the
driver and saved, so every variant reads the same bits. Each variant then decodes every payload,
applies the two rounds as `Peer._apply` does (decode, then `outer_step`, tensor by tensor; both
Nesterov conventions), and on the first round's Δ̄ encodes the dense codecs, draws a fresh low-rank
codec's random start and measures the adaptive chooser's relative errors and choices. Tensor sizes
are a few million values with odd tails (`--size full`) or a few hundred thousand (`--size small`,
what tests/test_kernel_paths.py runs).

`--time-outer` also times `outer_step` on the tensors of a GPT-2 124M model (one process, default
threads) beside the fused step it replaced (`fused_outer_step`), and reports the medians.

    python bench/kernel_paths.py                          # full sizes, all variants, ~1 min
    python bench/kernel_paths.py --size small --variants reference,aten-default,threads-3 --json
    python bench/kernel_paths.py --time-outer --out bench/results/kernel_paths.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from adloco.node.model.model import build_model
from adloco.protocol.algorithms.adaptive import DEFAULT_CANDIDATES, choose_codec, measured_error
from adloco.protocol.algorithms.codecs import LowRankCodec, decode, encode_tensors, make_codec
from adloco.protocol.algorithms.outer import OuterConfig, outer_step

SPECS = ("none", "fp16", "int8", "int4", "lowrank:4", "lowrank:32")
MAX_REL_ERRORS = (0.01, 0.1, 0.3, 0.6, 0.9)
SHAPES = {
    "full": {
        "attn.c_attn.weight": (768, 2304),
        "mlp.c_proj.weight": (3072, 768),
        "odd.weight": (777, 1001),
        "tail": (1_000_003,),
        "ln.bias": (768,),
    },
    "small": {
        "attn.weight": (333, 1001),
        "tail": (100_003,),
        "narrow.weight": (64, 2304),
        "ln.bias": (768,),
    },
}
# numpy's dispatched SIMD targets, all off: its loops run their SSE3 baseline.
NUMPY_NO_SIMD = "SSSE3 SSE41 POPCNT SSE42 AVX F16C FMA3 AVX2 AVX512F AVX512CD AVX512_SKX AVX512_CLX"
VARIANTS: dict[str, dict[str, str]] = {
    "reference": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "threads-1": {"KERNEL_PATHS_THREADS": "1"},
    "threads-3": {"KERNEL_PATHS_THREADS": "3"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "numpy-sse3": {"NPY_DISABLE_CPU_FEATURES": NUMPY_NO_SIMD},
}


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --- inputs -------------------------------------------------------------------------------------


def make_inputs(size: str, path: Path) -> None:
    """θ, m and two rounds of Δ̄ of pseudo-gradient scale, every round encoded with every codec."""
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES[size]
    theta = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    momentum = {k: torch.randn(s, generator=gen) * 1e-3 for k, s in shapes.items()}
    rounds = []
    for _ in range(2):
        # A low-rank part plus noise, so low-rank codecs meet some error bounds and miss others.
        delta = {}
        for k, s in shapes.items():
            noise = torch.randn(s, generator=gen)
            if len(s) == 2:
                u, v = torch.randn(s[0], 2, generator=gen), torch.randn(2, s[1], generator=gen)
                noise = noise * 0.3 + u @ v
            delta[k] = noise * 1e-3
        rounds.append({spec: encode_tensors(make_codec(spec), delta) for spec in SPECS})
    torch.save({"theta": theta, "momentum": momentum, "rounds": rounds}, path)


# --- worker -------------------------------------------------------------------------------------


def run_worker(path: Path) -> dict[str, Any]:
    """Every θ-deciding result of this process's kernel path, as short sha256 digests or hex floats."""
    threads = os.environ.get("KERNEL_PATHS_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    data = torch.load(path)
    out: dict[str, Any] = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    # θ_0: every peer builds the seeded model instead of downloading it.
    out["model θ_0"] = digest([t.detach() for t in build_model(None, seed=0).parameters()])
    first = data["rounds"][0]
    for spec in SPECS:
        out[f"decode {spec}"] = digest([decode(p) for p in first[spec].values()])
    for spec in SPECS:
        for convention in ("n1", "n2"):
            theta, momentum = apply_rounds(data, spec, OuterConfig(convention=convention))
            out[f"apply {spec} {convention} θ"] = digest(theta)
            out[f"apply {spec} {convention} m"] = digest(momentum)
    averaged = {k: decode(p) for k, p in first["none"].items()}
    for spec in ("fp16", "int8", "int4"):
        payloads = encode_tensors(make_codec(spec), averaged).values()
        out[f"encode {spec}"] = hashlib.sha256(b"".join(payloads)).hexdigest()[:16]
    # The random start of a fresh low-rank codec, which every member's adaptive choice draws.
    start = LowRankCodec(4)._initial_q("attn.weight", 1001, 4)
    out["lowrank first Q"] = digest([start])
    for spec in DEFAULT_CANDIDATES:
        out[f"error {spec}"] = measured_error(spec, averaged).hex()
    out["choices"] = [choose_codec(averaged, max_rel_error=e).spec for e in MAX_REL_ERRORS]
    return out


def apply_rounds(
    data: dict[str, Any], spec: str, cfg: OuterConfig
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both rounds applied as `Peer._apply` applies one: decode a tensor, outer-step it, the next."""
    theta = [t.clone() for t in data["theta"].values()]
    momentum = [t.clone() for t in data["momentum"].values()]
    for payloads in data["rounds"]:
        for name, p, m in zip(data["theta"], theta, momentum, strict=True):
            outer_step([p], [m], [decode(payloads[spec][name])], cfg)
    return theta, momentum


# --- driver -------------------------------------------------------------------------------------


def run_variants(size: str, variants: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Each variant's worker output, every worker in a fresh process reading the same inputs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inputs.pt"
        make_inputs(size, path)
        results = {}
        for name, env in variants.items():
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", str(path)],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"variant {name} failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(proc.stdout)
        return results


def differences(results: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Result key -> the variants whose value differs from the first variant's."""
    names = list(results)
    reference = results[names[0]]
    found: dict[str, list[str]] = {}
    for key, value in reference.items():
        if key in ("capability", "threads"):
            continue
        differ = [n for n in names[1:] if results[n][key] != value]
        if differ:
            found[key] = differ
    return found


def relative_spread(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """For each measured error that differs: max |e − e_ref| / e_ref over the variants."""
    reference = next(iter(results.values()))
    spread = {}
    for key, value in reference.items():
        if key.startswith("error "):
            ref = float.fromhex(value)
            worst = max(abs(float.fromhex(r[key]) - ref) for r in results.values())
            if worst:
                spread[key] = worst / ref
    return spread


# --- outer-step timing --------------------------------------------------------------------------


def fused_outer_step(
    params: list[torch.Tensor], momentum: list[torch.Tensor], delta: list[torch.Tensor], cfg: OuterConfig
) -> None:
    """The outer step as it was before issue 9 §3 (fused `alpha=` ops), the timing's baseline."""
    new_weight = 1.0 if cfg.convention == "n1" else 1.0 - cfg.momentum
    with torch.no_grad():
        for p, m, d in zip(params, momentum, delta, strict=True):
            m.mul_(cfg.momentum).add_(d, alpha=new_weight)
            p.add_(d.add(m, alpha=cfg.momentum), alpha=-cfg.lr)


def gpt2_124m_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 124M (tied embedding counted once): 124.4M values."""
    block = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,)]
    block += [(768, 3072), (3072,), (3072, 768), (768,)]
    return [(50257, 768), (1024, 768), *block * 12, (768,), (768,)]


def time_outer(reps: int) -> dict[str, Any]:
    """Median seconds of one outer step over GPT-2 124M-shaped θ, m, Δ: now and fused as before."""
    gen = torch.Generator().manual_seed(1)
    shapes = gpt2_124m_shapes()
    delta = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    timings: dict[str, Any] = {"values": sum(d.numel() for d in delta), "threads": torch.get_num_threads()}
    steps = {"fused (before)": fused_outer_step, "now": outer_step}
    for convention in ("n1", "n2"):
        cfg = OuterConfig(convention=convention)
        states = {
            label: ([torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]) for label in steps
        }
        times: dict[str, list[float]] = {label: [] for label in steps}
        for _ in range(reps):  # alternating, so that both see the same load on a shared machine
            for label, step in steps.items():
                start = time.perf_counter()
                step(*states[label], delta, cfg)
                times[label].append(time.perf_counter() - start)
        for label, samples in times.items():
            median = round(statistics.median(samples), 4)
            timings[f"{label} {convention}"] = {"median_s": median, "reps": reps}
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SHAPES), default="full")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, the first is the reference"
    )
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--time-outer", action="store_true", help="also time outer_step at 124M values")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(run_worker(args.worker)))
        return
    chosen = {name: VARIANTS[name] for name in args.variants.split(",")}
    results = run_variants(args.size, chosen)
    report: dict[str, Any] = {
        "size": args.size,
        "variants": {
            n: {"env": chosen[n], "capability": r["capability"], "threads": r["threads"]}
            for n, r in results.items()
        },
        "differences": differences(results),
        "error_spread": relative_spread(results),
        "choices": {n: r["choices"] for n, r in results.items()},
    }
    if args.time_outer:
        report["outer_step"] = time_outer(args.reps)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
        return
    for name, info in report["variants"].items():
        print(f"{name:14s} capability {info['capability']:7s} threads {info['threads']}  {info['env']}")
    print("differs from the reference:" if report["differences"] else "every result identical")
    for key, names in report["differences"].items():
        print(f"  {key:28s} {', '.join(names)}")
    for key, spread in report["error_spread"].items():
        print(f"  {key:28s} relative spread {spread:.2e}")
    for key, value in report.get("outer_step", {}).items():
        print(f"  outer_step {key}: {value}")


if __name__ == "__main__":
    main()
