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

Every figure is measured when the script runs. Run from the repository root:

    python bench/codecs.py                       # both parts, ~3 min on 2 shared CPU cores
    python bench/codecs.py --skip-training       # part A only, ~30 s
    python bench/codecs.py --rounds 12 --out /tmp/codecs.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from adloco.node.sim.engine import RoundRecord, SimConfig, Simulator, initial_val_loss
from adloco.node.training.config import TrainConfig
from adloco.node.training.corpus import Corpus
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
    p.add_argument("--skip-training", action="store_true", help="run part A only")
    # On a shared 2-core machine, torch's default of one thread per core oversubscribes the CPU and
    # measured 16 s instead of 2.3 s for one default round; 1 thread is the safe default there.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    fidelity = run_fidelity()
    print(fidelity_tables(fidelity) + "\n\n" + choice_table(fidelity) + "\n", flush=True)
    training = None if args.skip_training else run_training(args.rounds)
    if training is not None:
        print(training_tables(training) + "\n", flush=True)
    total = time.perf_counter() - t0
    results = {"fidelity": fidelity, "training": training, "torch_threads": torch.get_num_threads()}
    results["wall_s"] = total
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"total {total:.0f}s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
