"""Issue 11 §1, the communication frontier: wire bytes per training token against validation loss at
equal tokens, in the simulator (4 peers, embedded corpus), for fp32 DDP and DiLoCo with each codec.

Every run trains the same model from the same seed on the same data shards with the same per-peer
batch (the adaptive batch test off, one MIT instance per peer, no overlap), for the same number of
inner steps per peer, so every run sees the same training tokens.

- DDP: every step each of the n peers computes the gradient of its own batch (the stream of the
  same peer and slot in the DiLoCo runs, `peer.instance_sampler`), the gradients are averaged in
  fp32 (clipped as an inner step clips) and one AdamW step is taken with the inner optimizer's
  settings; its lr is the best of a small grid (`DDP_LRS`, each run at every seed), never worse than
  the DiLoCo runs' inner lr. Bytes as a ring all-reduce sends them: per peer per step
  2(n−1)/n × 4P sent and as many received.
- DiLoCo: the simulator's sync rounds of H inner steps (`node/sim/engine.py`) at the setup's inner
  lr and outer step, chosen like DDP's lr by a grid (`--tune`, docs/decisions/ 032), bytes exactly as
  the in-process transport counts its payloads (`parts.round_traffic`: each part to its owner, the
  owner's answer to every other member), plus the members' reports as the swarm relays them (each
  to one owner, who answers every member with all of them), which the in-process transport leaves
  out.

Bytes per token = all bytes every peer sends and receives / all training tokens. Each figure is the
median over the seeds with its spread (min..max); the val-loss gap is paired by seed (same θ_0 and
data order as the DDP run of that seed). `run(quick, seeds, out)` is what `adloco-bench` calls; the
runs go to a pool of worker processes (`python bench/comm.py --one ...`), one torch thread each.

    python -m adloco.bench.comm --device cpu --jobs 2 --seeds 0 1 2   # the full sweep: 42 runs,
                                                    # about 50 min on 2 cores (167 s for 36 on an H100)
    python -m adloco.bench.comm --tune --seeds 0 --jobs 2              # the lr grid: 26 runs, ~33 min
    python -m adloco.bench.comm --quick --seeds 0 --out /tmp/comm      # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from adloco.node.data.sampling import evaluate, validation_batches
from adloco.node.model.devices import adamw, autocast, resolve_device, resolve_precision
from adloco.node.model.loss import causal_lm_loss
from adloco.node.model.model import build_model
from adloco.node.sim.engine import SimConfig, Simulator
from adloco.node.training.config import TrainConfig
from adloco.node.training.instances import InnerConfig
from adloco.node.training.peer import instance_sampler
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.outer import OuterConfig
from adloco.protocol.algorithms.schedule import ScheduleConfig

GOAL_RATIO = 5000.0
"""Issue 11 §1: at least this many times fewer bytes per token than fp32 DDP ..."""
GOAL_GAP_PCT = 2.0
"""... at no more than this much higher validation loss (%) at equal tokens."""
DDP_LRS = (8e-4, 1.2e-3, 1.6e-3)
"""DDP's lr grid: it holds the DiLoCo runs' inner lr (1.2e-3), and its best lies inside it, not at
an edge (seed 0: 1.2e-3 1.439, 8e-4 1.454, 1.6e-3 1.515; 6e-4 1.501 and 4e-4 worse still)."""
SPARSELOCO_OUTER_LR = 1.0
"""The outer lr of the runs whose residual stands in for the outer momentum (`--ef-momentum`):
SparseLoCo's step is the plain averaged descent θ ← θ − α Δ̄; DiLoCo's default 0.7 is for Nesterov."""


@dataclass(frozen=True)
class Setup:
    """What every run of one sweep shares."""

    peers: int = 4
    steps: int = 480  # inner steps per peer (DDP: steps), the same tokens for every run
    batch: int = 8
    seq_len: int = 128
    val_sequences: int = 32
    # DiLoCo's inner AdamW lr and outer step θ ← θ − outer_lr · Δ̄ (Nesterov at outer_momentum),
    # the best of the `--tune` grid at seed 0: at 16 rounds plain averaging beats DiLoCo's (0.7, 0.9).
    inner_lr: float = 1.2e-3
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    device: str = "auto"
    max_corpus_mb: float | None = None

    @property
    def tokens(self) -> int:
        return self.peers * self.steps * self.batch * self.seq_len


@dataclass(frozen=True)
class Variant:
    """One point of the frontier: DDP at an lr, or DiLoCo with a codec, H and downlink options."""

    name: str
    method: str  # "ddp" or "diloco"
    codec: str = "none"
    inner_steps: int = 0
    downlink: str = "encode"
    ef_momentum: float | None = None
    lr: float | None = None  # DDP's lr; DiLoCo: its inner lr (None: the setup's)
    outer_lr: float | None = None  # DiLoCo's outer step (None: the setup's)
    outer_momentum: float | None = None


def variants(quick: bool, setup: Setup) -> list[Variant]:
    """The sweep: DDP over its lr grid; DiLoCo fp32, int8, int4 and the adaptive chooser at H = 30;
    the sparse codec at H = 30, 60 (each downlink, and the residual as momentum) and 120 (gather,
    which needs twice the H of the others for the same bytes). `quick`: DDP, fp32 and sparse."""
    if quick:
        h = setup.steps // 2
        return [
            Variant(f"ddp lr={setup.inner_lr:.1e}", "ddp", lr=setup.inner_lr),
            Variant(f"none H={h}", "diloco", "none", h),
            Variant(f"sparse H={h} feedback", "diloco", "sparse", h, "feedback"),
        ]
    out = [Variant(f"ddp lr={lr:.1e}", "ddp", lr=lr) for lr in DDP_LRS]
    out.append(Variant("none H=10", "diloco", "none", 10))
    out += [Variant(f"{codec} H=30", "diloco", codec, 30) for codec in ("none", "int8", "int4", "adaptive")]
    out.append(Variant("sparse H=30 feedback", "diloco", "sparse", 30, "feedback"))
    out += [Variant(f"sparse H=60 {d}", "diloco", "sparse", 60, d) for d in ("encode", "feedback", "gather")]
    out.append(Variant("sparse H=60 feedback ef-mom", "diloco", "sparse", 60, "feedback", 0.95))
    out.append(Variant("sparse H=120 gather", "diloco", "sparse", 120, "gather"))
    return [v for v in out if v.method == "ddp" or setup.steps % v.inner_steps == 0]


TUNE_DDP_LRS = (4e-4, 6e-4, *DDP_LRS)
TUNE_DILOCO = (
    *((4e-4, 0.7, 0.9), (6e-4, 0.7, 0.9), (1.6e-3, 0.7, 0.9)),
    *((8e-4, lr, m) for lr, m in ((0.7, 0.9), (1.0, 0.9), (0.5, 0.9), (0.5, 0.95), (0.9, 0.8), (0.7, 0.8))),
    *((8e-4, lr, m) for lr, m in ((0.5, 0.8), (0.7, 0.6), (1.0, 0.5), (1.0, 0.3), (1.0, 0.0), (1.3, 0.0))),
    *((1.2e-3, lr, m) for lr, m in ((0.7, 0.6), (0.5, 0.6), (1.0, 0.3), (1.0, 0.0))),
    *((1.6e-3, 0.7, 0.6), (1.6e-3, 1.0, 0.0)),
)
"""(inner lr, outer lr, outer momentum) of the fp32 DiLoCo runs at H = 30 that chose the setup's."""


def tune_variants() -> list[Variant]:
    """`--tune`: the lr grid that chose the setup's lrs (run at seed 0): DDP over `TUNE_DDP_LRS`
    and fp32 DiLoCo at H = 30 (the frontier's fp32 point) over `TUNE_DILOCO`, from DiLoCo's own
    (0.7, 0.9) at the old inner lr 4e-4 towards smaller outer steps and larger inner lrs."""
    out = [Variant(f"ddp lr={lr:.1e}", "ddp", lr=lr) for lr in TUNE_DDP_LRS]
    for inner, lr, mom in TUNE_DILOCO:
        name = f"none H=30 inner={inner:.1e} outer={lr:g}/{mom:g}"
        out.append(Variant(name, "diloco", "none", 30, lr=inner, outer_lr=lr, outer_momentum=mom))
    return out


# ---- one run ---------------------------------------------------------------------------------


def train_config(setup: Setup, seed: int, variant: Variant) -> TrainConfig:
    """The peers' configuration: fixed batch, one instance, no overlap, fp32."""
    outer = OuterConfig(
        lr=setup.outer_lr if variant.outer_lr is None else variant.outer_lr,
        momentum=setup.outer_momentum if variant.outer_momentum is None else variant.outer_momentum,
    )
    if variant.ef_momentum is not None:
        outer = OuterConfig(lr=SPARSELOCO_OUTER_LR, momentum=0.0)
    return TrainConfig(
        seq_len=setup.seq_len,
        batch_size=setup.batch,
        instances=1,
        inner_steps=max(1, variant.inner_steps),
        inner=InnerConfig(lr=variant.lr or setup.inner_lr),
        outer=outer,
        schedule=replace(ScheduleConfig(), test="none"),
        codec=variant.codec,
        downlink=variant.downlink,  # type: ignore[arg-type]
        ef_decay=1.0 if variant.ef_momentum is None else variant.ef_momentum,
        val_sequences=setup.val_sequences,
        max_corpus_mb=setup.max_corpus_mb,
        b_max=setup.batch,
        seed=seed,
        device=setup.device,
        precision="fp32",
        overlap="off",
    )


def run_ddp(setup: Setup, seed: int, variant: Variant) -> dict[str, Any]:
    """fp32 data-parallel AdamW on the peers' data: val loss at the end and every tenth of the run."""
    cfg = train_config(setup, seed, variant)
    corpus, tokenizer = load_data(cfg)
    device = resolve_device(cfg.device)
    model = build_model(
        cfg.model, vocab_size=tokenizer.vocab_size, seed=cfg.seed, max_seq_len=max(1024, cfg.seq_len)
    )
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    samplers = [
        instance_sampler(corpus, cfg, index=i, num_peers=setup.peers, slot=0) for i in range(setup.peers)
    ]
    inner = cfg.inner
    optimizer = adamw(params, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))
    val = validation_batches(corpus, seq_len=cfg.seq_len, num_sequences=cfg.val_sequences)
    dtype = resolve_precision(cfg.precision, device)
    curve = [(0, evaluate(model, val, micro_batch=16))]
    every = max(1, setup.steps // 10)
    for step in range(1, setup.steps + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for sampler in samplers:
            batch = sampler.next_batch(cfg.batch_size).to(device)
            with autocast(device, dtype):
                loss = causal_lm_loss(model, batch)
            # The mean of the n peers' gradients, accumulated in fp32: what the all-reduce computes.
            torch.autograd.backward(loss / setup.peers)
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        optimizer.step()
        if step % every == 0 or step == setup.steps:
            curve.append(
                (step * setup.peers * cfg.batch_size * cfg.seq_len, evaluate(model, val, micro_batch=16))
            )
    n = setup.peers
    # Ring all-reduce: every peer sends 2(n−1) chunks of P/n values (reduce-scatter, then all-gather)
    # and receives as many; all bytes sent and received by all peers per step: 2 · 2(n−1) · 4P.
    bytes_total = 2 * 2 * (n - 1) * 4 * num_params * setup.steps
    return {
        "val_loss": curve[-1][1],
        "bytes": bytes_total,
        "tokens": setup.tokens,
        "curve": curve,
        "params": num_params,
    }


class _ReportTally:
    """Wraps a virtual peer's averager to count the report bytes its contributions carry."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.report_bytes: list[int] = []

    def average(self, contribution: Any, **kwargs: Any) -> Any:
        self.report_bytes.append(len(contribution.metadata))
        return self.inner.average(contribution, **kwargs)


def run_diloco(setup: Setup, seed: int, variant: Variant) -> dict[str, Any]:
    """The simulator for steps / H sync rounds: val loss after each round, payload and report bytes."""
    cfg = train_config(setup, seed, variant)
    corpus, tokenizer = load_data(cfg)
    sim = Simulator(
        SimConfig(peers=setup.peers, rounds=setup.steps // cfg.inner_steps, train=cfg),
        corpus,
        vocab_size=tokenizer.vocab_size,
    )
    tallies = [_ReportTally(a) for a in sim.averagers]
    sim.averagers = tallies  # type: ignore[assignment]
    curve = [(0, sim.peers[0].validation_loss())]
    records = sim.run()
    curve += [(r.tokens_total, r.val_loss) for r in records]
    n = setup.peers
    payload = 2 * sum(r.round_bytes for r in records)  # every byte sent is received once
    # Reports: each member's to one owner, who sends all n to each of the others (both directions).
    rounds = zip(*(t.report_bytes for t in tallies), strict=True)
    reports = sum(2 * ((n - 1) * sum(sizes) / n + (n - 1) * sum(sizes)) for sizes in rounds)
    return {
        "val_loss": records[-1].val_loss,
        "bytes": payload + reports,
        "report_bytes": reports,
        "tokens": records[-1].tokens_total,
        "curve": curve,
        "codecs": sorted({r.codec for r in records}),
    }


def run_one(setup: Setup, seed: int, variant: Variant) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = (run_ddp if variant.method == "ddp" else run_diloco)(setup, seed, variant)
    return {**result, "wall_s": time.perf_counter() - t0}


# ---- the sweep -------------------------------------------------------------------------------


def _spawn(setup: Setup, seed: int, variant: Variant, work: Path, index: int) -> dict[str, Any]:
    """One run in a fresh worker process (one torch thread), its result read back."""
    spec = json.dumps({"setup": asdict(setup), "seed": seed, "variant": asdict(variant)})
    result = work / f"{index}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", spec, "--result", str(result)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{variant.name} seed {seed} failed:\n{done.stderr[-3000:]}")
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


def machine(device: str, jobs: int) -> str:
    """Where the sweep ran, in words (the results table shows it beside the figures)."""
    where = str(resolve_device(device))
    if where.startswith("cuda"):
        where = torch.cuda.get_device_name(0)
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, runs on {where};"
        f" {jobs} worker processes"
    )


def _median(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def frontier(
    setup: Setup, seeds: Sequence[int], runs: dict[tuple[str, int], dict[str, Any]], vs: Sequence[Variant]
) -> dict[str, Any]:
    """The table (one row per variant) and the headline figures against the best DDP lr."""
    ddp = [v for v in vs if v.method == "ddp"]
    best_ddp = min(ddp, key=lambda v: statistics.median(runs[(v.name, s)]["val_loss"] for s in seeds))
    ddp_bpt = runs[(best_ddp.name, seeds[0])]["bytes"] / runs[(best_ddp.name, seeds[0])]["tokens"]
    rows = []
    for v in vs:
        cfg = train_config(setup, seeds[0], v)  # the lrs as the runs took them
        per_seed = [runs[(v.name, s)] for s in seeds]
        bpt = [r["bytes"] / r["tokens"] for r in per_seed]
        gaps = [
            100 * (runs[(v.name, s)]["val_loss"] / runs[(best_ddp.name, s)]["val_loss"] - 1) for s in seeds
        ]
        rows.append(
            {
                "name": v.name,
                "method": v.method,
                "codec": v.codec,
                "inner_steps": v.inner_steps,
                "downlink": v.downlink,
                "ef_momentum": v.ef_momentum,
                "lr": cfg.inner.lr,
                "outer": None if v.method == "ddp" else f"{cfg.outer.lr:g}/{cfg.outer.momentum:g}",
                "bytes_per_token": _median(bpt),
                "ratio_vs_ddp": ddp_bpt / statistics.median(bpt),
                "val_loss": _median([r["val_loss"] for r in per_seed]),
                "val_loss_gap_pct": _median(gaps),
                "codecs_used": sorted({c for r in per_seed for c in r.get("codecs", [])}),
                "wall_s": _median([r["wall_s"] for r in per_seed]),
            }
        )
    diloco = [r for r in rows if r["method"] == "diloco"]
    meeting = [r for r in diloco if r["val_loss_gap_pct"]["median"] <= GOAL_GAP_PCT]
    if meeting:
        best, goal_gap_met = max(meeting, key=lambda r: r["ratio_vs_ddp"]), True
    else:  # the closest miss: the smallest gap
        best, goal_gap_met = min(diloco, key=lambda r: r["val_loss_gap_pct"]["median"]), False
    at_goal = [r for r in meeting if r["ratio_vs_ddp"] >= GOAL_RATIO]
    # The other side of a miss: the smallest gap among the runs that save enough bytes.
    cheap = [r for r in diloco if r["ratio_vs_ddp"] >= GOAL_RATIO]
    closest = min(cheap, key=lambda r: r["val_loss_gap_pct"]["median"]) if cheap else None
    return {
        "ddp_bytes_per_token": ddp_bpt,
        "ddp_lr": best_ddp.lr,
        "best": best["name"],
        "best_bytes_per_token": best["bytes_per_token"]["median"],
        "ratio_vs_ddp": best["ratio_vs_ddp"],
        "val_loss_gap_pct": best["val_loss_gap_pct"]["median"],
        "gap_goal_met": goal_gap_met,
        "goal_met": bool(at_goal),
        "goal": {"ratio_vs_ddp": GOAL_RATIO, "val_loss_gap_pct": GOAL_GAP_PCT},
        "meeting_goal": [r["name"] for r in at_goal],
        "best_at_goal_ratio": None
        if closest is None
        else {
            "name": closest["name"],
            "bytes_per_token": closest["bytes_per_token"]["median"],
            "ratio_vs_ddp": closest["ratio_vs_ddp"],
            "val_loss_gap_pct": closest["val_loss_gap_pct"]["median"],
        },
        "table": rows,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bytes per token (log x) against the val-loss gap to DDP, one point per variant with its
    seeds' spread; the goal's lines (a point below and left of both meets it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ddp_bpt = summary["ddp_bytes_per_token"]
    for row in summary["table"]:
        bpt, gap = row["bytes_per_token"]["median"], row["val_loss_gap_pct"]
        marker = "s" if row["method"] == "ddp" else ("o" if row["codec"] == "sparse" else "^")
        ax.errorbar(
            bpt,
            gap["median"],
            yerr=[[gap["median"] - gap["min"]], [gap["max"] - gap["median"]]],
            fmt=marker,
            capsize=3,
            label=row["name"],
        )
    ax.axhline(GOAL_GAP_PCT, color="tab:green", linestyle="--", linewidth=1, label=f"+{GOAL_GAP_PCT:g} % gap")
    ax.axvline(
        ddp_bpt / GOAL_RATIO, color="tab:green", linestyle=":", linewidth=1, label=f"DDP / {GOAL_RATIO:g}"
    )
    ax.set_xscale("log")
    ax.set_xlabel("bytes per training token (all peers, sent + received)")
    ax.set_ylabel("val loss gap to fp32 DDP at equal tokens (%)")
    ax.set_title("Communication frontier (4 simulated peers; median over seeds, bars: min..max)")
    ax.legend(fontsize=6, ncol=2, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(
    quick: bool,
    seeds: list[int],
    out: Path,
    *,
    jobs: int | None = None,
    device: str = "auto",
    tune: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """The sweep (`quick`: a few steps, DDP, fp32 DiLoCo and one sparse run), written to
    out/comm.json and out/comm_frontier.png; returns the summary (see `frontier`). `tune`: the lr
    grid of `tune_variants` instead, written to out/comm_tune.json. `command`: how it was started,
    recorded beside the machine."""
    if not seeds:
        raise ValueError("comm: at least one seed")
    setup = Setup(steps=16, val_sequences=16, device=device) if quick else Setup(device=device)
    vs = tune_variants() if tune else variants(quick, setup)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load_data(train_config(setup, seeds[0], vs[0]))  # the token cache, built once before the workers read it
    # DDP and the shortest H first (the most rounds, the longest runs): the pool ends on short ones.
    tasks = sorted(((v, s) for v in vs for s in seeds), key=lambda t: t[0].inner_steps)
    jobs = jobs or max(1, min(len(tasks), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="adloco-comm-") as work, ThreadPoolExecutor(jobs) as pool:
        results = list(
            pool.map(
                lambda item: _spawn(setup, item[1][1], item[1][0], Path(work), item[0]), enumerate(tasks)
            )
        )
    runs = {(v.name, s): r for (v, s), r in zip(tasks, results, strict=True)}
    summary = frontier(setup, seeds, runs, vs)
    summary.update(
        {
            "setup": asdict(setup),
            "seeds": list(seeds),
            "quick": quick,
            "machine": machine(setup.device, jobs),
            "command": command,
            "duration_s": time.perf_counter() - t0,
            "runs": [{"name": v.name, "seed": s, **runs[(v.name, s)]} for v, s in tasks],
        }
    )
    if tune:
        (out / "comm_tune.json").write_text(json.dumps(summary, indent=1))
        return summary
    (out / "comm.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "comm_frontier.png")
    return summary


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        "| run | bytes/token | × less than DDP | val loss | gap to DDP (%) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["table"]:
        b, v, g = r["bytes_per_token"], r["val_loss"], r["val_loss_gap_pct"]
        lines.append(
            f"| {r['name']} | {b['median']:.4g} | {r['ratio_vs_ddp']:,.0f} | {v['median']:.4f}"
            f" ({v['min']:.4f}..{v['max']:.4f}) | {g['median']:+.2f} ({g['min']:+.2f}..{g['max']:+.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps and runs (CI)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the CPUs)")
    ap.add_argument(
        "--device", default="auto", help="where the runs train: auto (CUDA when present), cpu, cuda"
    )
    ap.add_argument(
        "--tune", action="store_true", help="the lr grid that chose the setup's lrs (out/comm_tune.json)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        torch.set_num_threads(1)
        spec = json.loads(args.one)
        result = run_one(Setup(**spec["setup"]), spec["seed"], Variant(**spec["variant"]))
        args.result.write_text(json.dumps(result))
        return 0
    if args.tune and args.quick:
        ap.error("--tune runs the full setup; --quick a toy one")
    command = "python -m adloco.bench.comm " + " ".join(sys.argv[1:] if argv is None else argv)
    summary = run(
        args.quick, args.seeds, args.out, jobs=args.jobs, device=args.device, tune=args.tune, command=command
    )
    print(format_table(summary))
    verdict = "meets" if summary["goal_met"] else "misses"
    within = "best within" if summary["gap_goal_met"] else "nothing within; closest to"
    print(
        f"DDP (lr {summary['ddp_lr']:g}) {summary['ddp_bytes_per_token']:.4g} B/token; {within}"
        f" {GOAL_GAP_PCT:g} %: {summary['best']}: {summary['best_bytes_per_token']:.4g} B/token,"
        f" {summary['ratio_vs_ddp']:,.0f}x less, gap {summary['val_loss_gap_pct']:+.2f} %;"
        f" {verdict} the goal ({GOAL_RATIO:g}x at <= {GOAL_GAP_PCT:g} %)."
        f" {len(summary['runs'])} runs in {summary['duration_s']:.0f} s"
    )
    cheap = summary["best_at_goal_ratio"]
    if cheap is not None:
        print(
            f"smallest gap at >= {GOAL_RATIO:g}x: {cheap['name']}: {cheap['ratio_vs_ddp']:,.0f}x,"
            f" gap {cheap['val_loss_gap_pct']:+.2f} %"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
