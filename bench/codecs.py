"""Codec benchmark: wire bytes and compression error on real pseudo-gradients, and the effect on training.

Part A (fidelity) trains one `Peer` of the default configuration (tiny-llama, `TrainConfig()`) for a
few rounds through the real round path (train_round → contribute → reduce_group → apply_round) and
keeps the node pseudo-gradient Δ of every round. For each codec it measures, on those Δ:

- the exact wire bytes of the encoded Δ (`encode_tensors` + `wire_bytes_of`) and the compression
  ratio against the fp32 codec `none`;
- the single-shot relative error ‖Δ − D(C(Δ))‖/‖Δ‖ with a fresh codec (`measured_error`) at a few
  rounds;
- the error of the running mean of what receivers decode against the running mean of the true Δ
  over all rounds, compressing every round with a persistent codec (low-rank warm starts carry
  over), once without and once with `ErrorFeedback`: this is what error feedback buys, since the
  outer optimizer integrates the decoded Δ over rounds;
- what `choose_codec` picks for a few error bounds and byte budgets.

Part B (training) runs the in-process simulator (4 peers, sync) once per codec with a reduced
configuration and reports the bytes each peer sends per round, the total bytes and the validation
loss per round against the uncompressed run.

Part C (throughput) times `encode` and `decode` of every codec on the tensors of a GPT-2 124M
model's embedding and one transformer block (45.7M float32 values, 183 MB), on one thread, and
reports the median over `--reps` repetitions in GB/s of float32 values (input bytes for encode,
output bytes for decode). Beside it, the same timings of the codecs module as it was at
`--baseline-rev` (loaded from git, nowhere else), their ratio, and whether both produce identical
payloads and decode identical tensors.

Every figure is measured when the script runs. Run from the repository root:

    python bench/codecs.py                       # all three parts, ~6 min on 2 shared CPU cores
    python bench/codecs.py --skip-training       # parts A and C, ~3 min
    python bench/codecs.py --throughput-only     # part C only, ~2.5 min; keeps A and B in the JSON
    python bench/codecs.py --rounds 12 --out /tmp/codecs.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from adloco.node.data.corpus import Corpus
from adloco.node.sim.engine import RoundRecord, SimConfig, Simulator, initial_val_loss
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms import adaptive, codecs
from adloco.protocol.algorithms.allreduce import reduce_group
from adloco.protocol.algorithms.feedback import ErrorFeedback

Deltas = dict[str, torch.Tensor]
Row = dict[str, Any]

FIDELITY_SPECS: tuple[str, ...] = (
    "none",
    "fp16",
    "int8",
    "int4",
    "lowrank:4",
    "lowrank:8",
    "lowrank:16",
    "lowrank:32",
    "lowrank:8:int4",
)
SAMPLE_ROUNDS: tuple[int, ...] = (1, 3, 6)
ERROR_BOUNDS: tuple[float, ...] = (0.05, 0.1, 0.3)
BYTE_BUDGETS: tuple[int | None, ...] = (None, 200_000)
TRAINING_SPECS: tuple[str, ...] = ("none", "int8", "int4", "lowrank:8", "adaptive")
TRAINING_PEERS = 4
THROUGHPUT_SPECS: tuple[str, ...] = ("none", "fp16", "int8", "int4", "lowrank:8")
# GPT-2 124M: the token embedding and one of its 12 transformer blocks (ln_1, attn.c_attn,
# attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj; weights and biases), in HF Conv1D (in, out) layout.
GPT2_SHAPES: dict[str, tuple[int, ...]] = {
    "wte": (50257, 768),
    "ln_1.weight": (768,),
    "ln_1.bias": (768,),
    "attn.c_attn.weight": (768, 2304),
    "attn.c_attn.bias": (2304,),
    "attn.c_proj.weight": (768, 768),
    "attn.c_proj.bias": (768,),
    "ln_2.weight": (768,),
    "ln_2.bias": (768,),
    "mlp.c_fc.weight": (768, 3072),
    "mlp.c_fc.bias": (3072,),
    "mlp.c_proj.weight": (3072, 768),
    "mlp.c_proj.bias": (768,),
}
# The last commit before the vectorized codecs: part C's "before".
BASELINE_REV = "33a4e11c7f17746ea6f5ed93ad4f7c96bd1ab35a"
CODECS_PATH = "protocol/algorithms/codecs.py"
DEFAULT_OUT = Path("bench/results/codecs.json")


# --- part A: fidelity on real pseudo-gradients ----------------------------------------------------


def collect_deltas(cfg: TrainConfig, rounds: int) -> tuple[list[Deltas], int]:
    """Δ of each of `rounds` rounds of one peer (CPU copies), and the model's parameter count."""
    corpus, tokenizer = load_data(cfg)
    peer = Peer(
        peer_id="bench", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=tokenizer.vocab_size
    )
    deltas: list[Deltas] = []
    for _ in range(rounds):
        local = peer.train_round()
        deltas.append({n: d.detach().cpu().clone() for n, d in zip(peer.names, local.delta, strict=True)})
        contribution, _ = peer.contribute(local)
        assert contribution is not None  # a single on-time peer is never stale
        result = reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec))
        peer.apply_round(result)
    return deltas, sum(t.numel() for t in peer.state.theta)


def running_mean_errors(spec: str, deltas: Sequence[Deltas], *, error_feedback: bool) -> list[float]:
    """After each round t, rel. error of mean(decoded Δ_1..t) against mean(Δ_1..t)."""
    codec = codecs.make_codec(spec)
    feedback = ErrorFeedback()
    true_sum = {k: torch.zeros_like(t) for k, t in deltas[0].items()}
    decoded_sum = {k: torch.zeros_like(t) for k, t in deltas[0].items()}
    errors: list[float] = []
    for delta in deltas:
        payloads = feedback.compress(codec, delta) if error_feedback else codecs.encode_tensors(codec, delta)
        for key, value in codecs.decode_tensors(payloads).items():
            true_sum[key] += delta[key]
            decoded_sum[key] += value
        # Both sums have t terms, so the error of the sums is the error of the means.
        errors.append(adaptive.relative_error(true_sum, decoded_sum))
    return errors


def fidelity_row(spec: str, deltas: Sequence[Deltas], fp32_bytes: int, params: int) -> Row:
    """Bytes, ratio and errors of one codec on the collected Δ."""
    wire = codecs.wire_bytes_of(codecs.encode_tensors(codecs.make_codec(spec), deltas[-1]))
    no_ef = running_mean_errors(spec, deltas, error_feedback=False)
    with_ef = running_mean_errors(spec, deltas, error_feedback=True)
    return {
        "codec": spec,
        "wire_bytes": wire,
        "ratio_vs_fp32": fp32_bytes / wire,
        "bits_per_param": 8 * wire / params,
        "single_shot_error": {r: adaptive.measured_error(spec, deltas[r - 1]) for r in SAMPLE_ROUNDS},
        "mean_error_no_ef": no_ef,
        "mean_error_ef": with_ef,
    }


def choice_rows(deltas: Sequence[Deltas], candidates: Sequence[str]) -> list[Row]:
    """`choose_codec` on Δ of each sample round, for every error bound and byte budget."""
    rows: list[Row] = []
    for r in SAMPLE_ROUNDS:
        for bound in ERROR_BOUNDS:
            for budget in BYTE_BUDGETS:
                choice = adaptive.choose_codec(
                    deltas[r - 1], candidates=candidates, max_rel_error=bound, byte_budget=budget
                )
                rows.append(
                    {
                        "round": r,
                        "max_rel_error": bound,
                        "byte_budget": budget,
                        "choice": choice.spec,
                        "wire_bytes": choice.wire_bytes,
                        "rel_error": choice.rel_error,
                        "reason": choice.reason,
                    }
                )
    return rows


def run_fidelity() -> Row:
    """Part A: collect Δ from the default configuration and measure every codec on it."""
    cfg = TrainConfig()
    t0 = time.perf_counter()
    deltas, params = collect_deltas(cfg, max(SAMPLE_ROUNDS))
    collect_s = time.perf_counter() - t0
    fp32 = codecs.wire_bytes_of(codecs.encode_tensors(codecs.make_codec("none"), deltas[-1]))
    rows = [fidelity_row(spec, deltas, fp32, params) for spec in FIDELITY_SPECS]
    return {
        "params": params,
        "tensors": len(deltas[0]),
        "rounds": len(deltas),
        "trajectory_codec": cfg.codec,
        "delta_norms": [math.sqrt(sum(float(t.double().square().sum()) for t in d.values())) for d in deltas],
        "collect_s": collect_s,
        "candidates": list(cfg.codec_candidates),
        "codecs": rows,
        "choices": choice_rows(deltas, cfg.codec_candidates),
        "wall_s": time.perf_counter() - t0,
    }


# --- part B: effect on training -------------------------------------------------------------------


def training_config(spec: str) -> TrainConfig:
    """The default configuration reduced (seq_len 64, H 6) so five 4-peer runs fit in ~2 min."""
    return replace(TrainConfig(), codec=spec, seq_len=64, inner_steps=6, instances=2, max_corpus_mb=4)


def run_one(spec: str, rounds: int, corpus: Corpus, vocab_size: int) -> Row:
    """One simulated sync run with codec `spec`; its bytes and validation losses."""
    t0 = time.perf_counter()
    cfg = SimConfig(peers=TRAINING_PEERS, rounds=rounds, train=training_config(spec))
    sim = Simulator(cfg, corpus, vocab_size=vocab_size)
    initial = initial_val_loss(sim)
    records: list[RoundRecord] = sim.run()
    return {
        "codec": spec,
        "codecs_used": dict(Counter(r.codec for r in records)),
        "bytes_per_round_per_peer": statistics.fmean(r.round_bytes / r.group_size for r in records),
        "total_wire_bytes": records[-1].bytes_sent,
        "initial_val_loss": initial,
        "val_loss": [r.val_loss for r in records],
        "batch_sizes": [r.batch_sizes for r in records],
        "final_val_loss": records[-1].val_loss,
        "wall_s": time.perf_counter() - t0,
    }


def run_training(rounds: int) -> Row:
    """Part B: one simulator run per codec on a shared corpus, compared with `none` round by round."""
    corpus, tokenizer = load_data(training_config("none"))
    runs = [run_one(spec, rounds, corpus, tokenizer.vocab_size) for spec in TRAINING_SPECS]
    baseline = next(run["val_loss"] for run in runs if run["codec"] == "none")
    for run in runs:
        gaps = [v - b for v, b in zip(run["val_loss"], baseline, strict=True)]
        run["final_gap_vs_none"] = gaps[-1]
        run["mean_gap_vs_none"] = statistics.fmean(gaps)
    cfg = training_config("none")
    return {
        "peers": TRAINING_PEERS,
        "rounds": rounds,
        "config": {k: getattr(cfg, k) for k in ("seq_len", "batch_size", "inner_steps", "instances")},
        "max_corpus_mb": cfg.max_corpus_mb,
        "runs": runs,
    }


# --- part C: throughput ---------------------------------------------------------------------------


def load_baseline(rev: str) -> ModuleType:
    """The codecs module as it was at git revision `rev`, imported under a name of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{CODECS_PATH}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    name = "bench_codecs_baseline"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # classes look their module up by name
    exec(compile(source, f"{rev[:10]}:{CODECS_PATH}", "exec"), module.__dict__)
    return module


def gpt2_tensors(seed: int = 0) -> Deltas:
    """Pseudo-gradient-like tensors of GPT-2 shapes: Gaussian, a different scale per tensor."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) * 10 ** -(2 + i % 3)
        for i, (name, shape) in enumerate(GPT2_SHAPES.items())
    }


CLOCKS: tuple[str, ...] = ("cpu", "wall")


def time_encode(module: Any, spec: str, tensors: Deltas) -> tuple[dict[str, float], dict[str, bytes]]:
    """CPU and wall seconds to encode every tensor with a fresh `spec` codec of `module`, and the
    payloads."""
    # A fresh codec each time, so that every repetition does the same work (low-rank warm starts).
    codec = module.make_codec(spec)
    cpu, wall = time.thread_time(), time.perf_counter()
    payloads = {k: codec.encode(k, t) for k, t in tensors.items()}
    return {"cpu": time.thread_time() - cpu, "wall": time.perf_counter() - wall}, payloads


def time_decode(module: Any, payloads: dict[str, bytes]) -> dict[str, float]:
    """CPU and wall seconds to decode every payload with `module` (each result dropped at once)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for payload in payloads.values():
        module.decode(payload)
    return {"cpu": time.thread_time() - cpu, "wall": time.perf_counter() - wall}


def same_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype, NaN positions and bit-equal values elsewhere."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return bool(torch.equal(a.nan_to_num(0.0, math.inf, -math.inf), b.nan_to_num(0.0, math.inf, -math.inf)))


def throughput_row(spec: str, tensors: Deltas, modules: dict[str, Any], reps: int) -> Row:
    """Median encode/decode GB/s of `spec` over `reps` repetitions, the modules interleaved.

    GB/s by CPU time (this thread's: torch runs on one thread) is the throughput of one core even
    on a shared machine; by wall time it is what a caller waited, other processes included.
    """
    values = sum(t.numel() for t in tensors.values())
    times: dict[tuple[str, str, str], list[float]] = {}
    payloads: dict[str, dict[str, bytes]] = {}
    for _ in range(reps):
        measured: dict[tuple[str, str], dict[str, float]] = {}
        for label, module in modules.items():
            measured[label, "encode"], payloads[label] = time_encode(module, spec, tensors)
        for label, module in modules.items():
            measured[label, "decode"] = time_decode(module, payloads[label])
        for (label, op), seconds in measured.items():
            for clock in CLOCKS:
                times.setdefault((op, label, clock), []).append(seconds[clock])
    row: Row = {"codec": spec, "values": values, "fp32_bytes": 4 * values, "reps": reps}
    for (op, label, clock), seconds_list in times.items():
        row[f"{op}_{label}_{clock}_s"] = seconds_list
        row[f"{op}_{label}_{clock}_gbps"] = 4 * values / statistics.median(seconds_list) / 1e9
    row["wire_bytes"] = codecs.wire_bytes_of(payloads["after"])
    if "before" in modules:
        before, after = payloads["before"], payloads["after"]
        row["identical_payloads"] = before == after
        row["identical_decode"] = all(
            same_tensors(modules["before"].decode(before[k]), codecs.decode(after[k])) for k in after
        )
        for op in ("encode", "decode"):
            for clock in CLOCKS:
                after_gbps, before_gbps = row[f"{op}_after_{clock}_gbps"], row[f"{op}_before_{clock}_gbps"]
                row[f"{op}_{clock}_speedup"] = after_gbps / before_gbps
    return row


def run_throughput(reps: int, baseline_rev: str | None) -> Row:
    """Part C: encode/decode GB/s of every codec, now and (if given) at `baseline_rev`."""
    modules: dict[str, Any] = {"after": codecs}
    if baseline_rev is not None:
        modules = {"before": load_baseline(baseline_rev), "after": codecs}
    tensors = gpt2_tensors()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows = [throughput_row(spec, tensors, modules, reps) for spec in THROUGHPUT_SPECS]
    return {
        "tensors": {k: list(s) for k, s in GPT2_SHAPES.items()},
        "values": sum(t.numel() for t in tensors.values()),
        "reps": reps,
        "baseline_rev": baseline_rev,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "codecs": rows,
        "wall_s": time.perf_counter() - t0,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- output ---------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fidelity_tables(part: Row) -> str:
    head = (
        f"## A. Codec fidelity on real Δ (tiny-llama, {part['params']:,} params in {part['tensors']} tensors;"
        f" {part['rounds']} rounds of TrainConfig(), trajectory codec {part['trajectory_codec']})\n\n"
        "‖Δ_r‖ per round: " + ", ".join(f"{n:.3f}" for n in part["delta_norms"]) + "\n\n"
    )
    rounds = ", ".join(f"r{r}" for r in SAMPLE_ROUNDS)
    headers = ["codec", "bytes/round", "ratio vs fp32", "bits/param", f"single-shot err ({rounds})"]
    headers += [f"mean-Δ err no EF (r{part['rounds']})", f"mean-Δ err EF (r{part['rounds']})"]
    rows = [
        [
            row["codec"],
            f"{row['wire_bytes']:,}",
            f"{row['ratio_vs_fp32']:.2f}×",
            f"{row['bits_per_param']:.2f}",
            " / ".join(f"{e:.4f}" for e in row["single_shot_error"].values()),
            f"{row['mean_error_no_ef'][-1]:.4f}",
            f"{row['mean_error_ef'][-1]:.4f}",
        ]
        for row in part["codecs"]
    ]
    return head + markdown_table(headers, rows)


def choice_table(part: Row) -> str:
    head = f"### choose_codec on Δ (candidates: {', '.join(part['candidates'])})\n\n"
    rows = [
        [
            row["round"],
            row["max_rel_error"],
            "none" if row["byte_budget"] is None else f"{row['byte_budget']:,}",
            row["choice"],
            f"{row['wire_bytes']:,}",
            f"{row['rel_error']:.4f}",
            row["reason"],
        ]
        for row in part["choices"]
    ]
    headers = ["round", "max_rel_error", "byte budget", "choice", "bytes", "rel error", "reason"]
    return head + markdown_table(headers, rows)


def training_tables(part: Row) -> str:
    cfg = part["config"]
    head = (
        f"## B. Training effect ({part['peers']} simulated peers, sync, {part['rounds']} rounds;"
        f" seq_len {cfg['seq_len']}, b0 {cfg['batch_size']}, H {cfg['inner_steps']},"
        f" K0 {cfg['instances']}, corpus ≤ {part['max_corpus_mb']} MB)\n\n"
    )
    headers = ["codec", "codecs used (rounds)", "bytes/round/peer", "total bytes", "final val loss"]
    headers += ["final − none", "mean over rounds − none", "wall s"]
    rows = [
        [
            run["codec"],
            ", ".join(f"{c}×{n}" for c, n in run["codecs_used"].items()),
            f"{run['bytes_per_round_per_peer']:,.0f}",
            f"{run['total_wire_bytes']:,}",
            f"{run['final_val_loss']:.4f}",
            f"{run['final_gap_vs_none']:+.4f}",
            f"{run['mean_gap_vs_none']:+.4f}",
            f"{run['wall_s']:.0f}",
        ]
        for run in part["runs"]
    ]
    return head + markdown_table(headers, rows) + "\n\n" + val_loss_table(part["runs"])


def throughput_table(part: Row) -> str:
    rev = part["baseline_rev"]
    head = (
        f"## C. Throughput (GPT-2 124M embedding + 1 block, {part['values']:,} float32 values;"
        f" {part['torch_threads']} torch thread, median of {part['reps']};"
        f" before = {rev[:10] if rev else 'not measured'}; {part['cpu']},"
        f" load {part['loadavg_before'][0]:.1f} → {part['loadavg_after'][0]:.1f})\n\n"
        "GB/s of float32 values: by this thread's CPU time (one core's throughput), and by wall time.\n\n"
    )
    with_before = rev is not None
    headers = ["codec"]
    rows = []
    for op, clock in itertools.product(("encode", "decode"), CLOCKS):
        headers += [f"{op} GB/s, {clock}" + (" (before → after, ×)" if with_before else "")]
    if with_before:
        headers += ["identical payloads / decode"]
    for row in part["codecs"]:
        cells = [row["codec"]]
        for op, clock in itertools.product(("encode", "decode"), CLOCKS):
            after = f"{row[f'{op}_after_{clock}_gbps']:.3f}"
            if with_before:
                before, speedup = row[f"{op}_before_{clock}_gbps"], row[f"{op}_{clock}_speedup"]
                after = f"{before:.3f} → {after} ({speedup:.1f}×)"
            cells.append(after)
        if with_before:
            cells.append(f"{row['identical_payloads']} / {row['identical_decode']}")
        rows.append(cells)
    return head + markdown_table(headers, rows)


def val_loss_table(runs: Sequence[Row]) -> str:
    head = "### Validation loss per round (round 0 = initial θ)\n\n"
    curves = [[run["initial_val_loss"], *run["val_loss"]] for run in runs]
    rows = [[r, *(f"{curve[r]:.4f}" for curve in curves)] for r in range(len(curves[0]))]
    return head + markdown_table(["round", *(run["codec"] for run in runs)], rows)


# --- entry point ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds of each part B training run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the results as JSON")
    p.add_argument("--skip-training", action="store_true", help="skip part B")
    p.add_argument(
        "--throughput-only",
        action="store_true",
        help="run part C only, keeping parts A and B of an existing --out file",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions of each part C timing (median)")
    p.add_argument(
        "--baseline-rev",
        default=BASELINE_REV,
        help="git revision whose codecs part C times beside the current ones ('' to skip)",
    )
    # On a shared 2-core machine, torch's default of one thread per core oversubscribes the CPU and
    # measured 16 s instead of 2.3 s for one default round; 1 thread is the safe default there.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results: Row = {}
    if args.throughput_only and args.out.exists():
        results = json.loads(args.out.read_text())
    if not args.throughput_only:
        fidelity = run_fidelity()
        print(fidelity_tables(fidelity) + "\n\n" + choice_table(fidelity) + "\n", flush=True)
        training = None if args.skip_training else run_training(args.rounds)
        if training is not None:
            print(training_tables(training) + "\n", flush=True)
        results = {"fidelity": fidelity, "training": training, "torch_threads": torch.get_num_threads()}
    throughput = run_throughput(args.reps, args.baseline_rev or None)
    print(throughput_table(throughput) + "\n", flush=True)
    total = time.perf_counter() - t0
    results["throughput"] = throughput
    if not args.throughput_only:
        results["wall_s"] = total  # of all parts; part C alone has its own
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"total {total:.0f}s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
