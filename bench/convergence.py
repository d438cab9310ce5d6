"""Issue 11 §2, convergence: DDP, DiLoCo and AdLoCo stage by stage, to a target val loss, in the simulator.

Four simulated peers (`adloco-sim`, the real peer code), the embedded corpus, the tiny default model
at seq_len 64, the simulator's default cost model (0.004 s per sample, 20 Mbit/s links, 50 ms
latency), one torch thread. The ladder, each an `adloco-sim` command line (`CONFIGS`):

- DiLoCo: one instance, fixed b = 8, H = 10, outer Nesterov 0.7, no compression;
- + adaptive batch: the norm test (η 0.8) grows b, at most b_max = 16 (no switch mode: a batch must
  fit the device, so the cap is b_max);
- + MIT: two instances per peer, merged every 2 rounds;
- + switch mode (full AdLoCo): b may pass b_max by gradient accumulation, up to the default cap 64;
- full AdLoCo + int8 (the default codec).

b_max is set to 16 for every run (a device that fits 16 sequences; probing would find thousands on
this CPU and switch mode would never engage). Overlap is off everywhere: it is DiLoCoX's, not
AdLoCo's, and would change the time of the runs it is on only.

DDP: every step each peer computes the gradient of its own batch (the stream of the same peer and
slot as DiLoCo's), the gradients are averaged in fp32, clipped as an inner step clips, and one AdamW
step with the inner optimizer's settings is taken (as bench/comm.py's DDP, at the inner lr). A round is
a step; its simulated time is the step's compute (8 × 0.004 s) plus a ring all-reduce of fp32
gradients through the simulator's link model (2(n−1)/n × 4P bytes each way, two latencies).

Budget and target: each seed runs DiLoCo to the token budget (`Budget.diloco_rounds` rounds of
4 × 8 × 10 sequences); its val loss there is that seed's target. Every other configuration runs to
the budget, and on past it (up to `Budget.overrun` × the budget) until it reaches the target.
Reported per configuration: val loss at the budget (last record at or before it), and the rounds,
simulated seconds and tokens at the first round whose val loss is at or below the target; medians
over seeds with min..max. The val loss is the simulator's: 32 held-out sequences, the same for all.

    python bench/convergence.py --out bench/results/convergence            # 3 seeds
    python bench/convergence.py --quick --out /tmp/convergence              # a few seconds per run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from adloco.bench.simruns import Row, SimRun, fmt, plot_curves, run_sim, set_threads, sim_config, spread
from adloco.node.data.corpus import Corpus
from adloco.node.data.sampling import evaluate, validation_batches
from adloco.node.model.devices import adamw
from adloco.node.model.loss import causal_lm_loss
from adloco.node.model.model import build_model
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import instance_sampler
from adloco.node.training.runtime import load_data

GOAL_PCT = 20.0
"""Issue 11 §2: full AdLoCo reaches the target in at least this much fewer rounds and simulated time."""

COMMON = ("--peers", "4", "--seq-len", "64", "--overlap", "off", "--b-max", "16", "--quiet")
CONFIGS: dict[str, tuple[str, ...]] = {
    "DiLoCo": ("--instances", "1", "--batch-test", "none", "--codec", "none"),
    "+ adaptive batch": ("--instances", "1", "--batch-test", "norm", "--batch-cap", "16", "--codec", "none"),
    "+ MIT": ("--instances", "2", "--batch-test", "norm", "--batch-cap", "16", "--codec", "none"),
    "+ switch mode (full AdLoCo)": ("--instances", "2", "--batch-test", "norm", "--codec", "none"),
    "full AdLoCo + int8": ("--instances", "2", "--batch-test", "norm", "--codec", "int8"),
}
BASELINE, ADLOCO = "DiLoCo", "+ switch mode (full AdLoCo)"


@dataclass(frozen=True)
class Budget:
    """The run's size: DiLoCo's rounds at the token budget, and how far past it a run may go to reach
    the target."""

    diloco_rounds: int = 20
    inner_steps: int = 10
    overrun: float = 3.0
    ddp_eval_every: int = 10  # DDP steps between evaluations: the resolution of its rounds to target
    step_curve: str | None = None  # a measured step time per batch (`adloco-sim --step-curve`)


FULL = Budget()
QUICK = Budget(diloco_rounds=2, inner_steps=2, overrun=3.0, ddp_eval_every=1)


def argv(name: str, budget: Budget) -> list[str]:
    curve = ["--step-curve", budget.step_curve] if budget.step_curve else []
    return [*COMMON, "--inner-steps", str(budget.inner_steps), *curve, *CONFIGS[name]]


def token_budget(cfg: TrainConfig, peers: int, budget: Budget) -> int:
    """DiLoCo's tokens after `budget.diloco_rounds` rounds: peers × b × H × seq_len per round."""
    return budget.diloco_rounds * peers * cfg.batch_size * budget.inner_steps * cfg.seq_len


# ---- DDP ----------------------------------------------------------------------------------------


@dataclass
class DdpRun:
    """DDP's curve: (steps, tokens, simulated seconds, val loss) at every evaluation."""

    seed: int
    points: list[tuple[int, int, float, float]]
    wall_s: float

    def val_at(self, tokens: float) -> float:
        return next(v for _, t, _, v in reversed(self.points) if t <= tokens)

    def first_below(self, target: float) -> tuple[int, int, float] | None:
        return next(((s, t, sim) for s, t, sim, v in self.points if v <= target), None)


def run_ddp(
    corpus: Corpus, vocab_size: int, *, seed: int, budget: Budget, tokens: int, target: float
) -> DdpRun:
    """fp32 data-parallel AdamW over the peers' streams until `tokens`, then on (up to the overrun)
    until the val loss reaches `target`."""
    t0 = time.perf_counter()
    sim = sim_config(argv(BASELINE, budget), seed=seed)
    cfg, n = sim.train, sim.peers
    model = build_model(cfg.model, vocab_size=vocab_size, seed=cfg.seed, max_seq_len=max(1024, cfg.seq_len))
    params = [p for p in model.parameters() if p.requires_grad]
    samplers = [instance_sampler(corpus, cfg, index=i, num_peers=n, slot=0) for i in range(n)]
    inner = cfg.inner
    optimizer = adamw(params, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))
    val = validation_batches(corpus, seq_len=cfg.seq_len, num_sequences=cfg.val_sequences)
    num_params = sum(p.numel() for p in params)
    ring = 2 * (n - 1) / n * 4 * num_params  # bytes each peer sends (and receives) per all-reduce
    compute_s = (
        sim.step_curve.step_s(cfg.batch_size) if sim.step_curve else cfg.batch_size * sim.sec_per_sample
    )
    step_s = compute_s + 2 * sim.latency_s + ring / (sim.bandwidth_mbps * 1e6 / 8)
    per_step = n * cfg.batch_size * cfg.seq_len
    points = [(0, 0, 0.0, evaluate(model, val, micro_batch=16))]
    step = 0
    while True:
        step += 1
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for sampler in samplers:
            # The mean of the n peers' gradients, accumulated in fp32: what the all-reduce computes.
            torch.autograd.backward(causal_lm_loss(model, sampler.next_batch(cfg.batch_size)) / n)
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        optimizer.step()
        done = step * per_step
        if step % budget.ddp_eval_every == 0:
            points.append((step, done, step * step_s, evaluate(model, val, micro_batch=16)))
            reached = points[-1][3] <= target
            if done >= tokens and (reached or done >= budget.overrun * tokens):
                break
    return DdpRun(seed=seed, points=points, wall_s=time.perf_counter() - t0)


# ---- the ladder ---------------------------------------------------------------------------------


def run_config(
    name: str,
    corpus: Corpus,
    vocab_size: int,
    *,
    seed: int,
    budget: Budget,
    tokens: int,
    target: float | None,
) -> SimRun:
    """One rung at one seed: to the token budget, then on until `target` (None: stop at the budget)."""
    cfg = sim_config(argv(name, budget), seed=seed)

    def stop(records: list[Any]) -> bool:
        done = records[-1].tokens_total
        if done < tokens:
            return False
        return target is None or records[-1].val_loss <= target or done >= budget.overrun * tokens

    return run_sim(name, cfg, corpus, vocab_size, stop=stop)


def seed_runs(
    seed: int, corpus: Corpus, vocab_size: int, budget: Budget
) -> tuple[dict[str, SimRun], DdpRun, int, float]:
    """Every configuration at one seed: DiLoCo first (it sets the target), then the others and DDP."""
    tokens = token_budget(sim_config(argv(BASELINE, budget), seed=seed).train, 4, budget)
    runs = {
        BASELINE: run_config(
            BASELINE, corpus, vocab_size, seed=seed, budget=budget, tokens=tokens, target=None
        )
    }
    target = runs[BASELINE].val_at("tokens_total", tokens)
    _progress(runs[BASELINE])
    for name in CONFIGS:
        if name != BASELINE:
            runs[name] = run_config(
                name, corpus, vocab_size, seed=seed, budget=budget, tokens=tokens, target=target
            )
            _progress(runs[name])
    ddp = run_ddp(corpus, vocab_size, seed=seed, budget=budget, tokens=tokens, target=target)
    print(f"[convergence seed {seed}] DDP: {ddp.points[-1][0]} steps, {ddp.wall_s:.0f}s wall", flush=True)
    return runs, ddp, tokens, target


def _progress(run: SimRun) -> None:
    last = run.records[-1]
    print(
        f"[convergence seed {run.seed}] {run.name}: {len(run.records)} rounds, {last.tokens_total} tokens,"
        f" val {last.val_loss:.3f}, b={last.batch_sizes}, {run.wall_s:.0f}s wall",
        flush=True,
    )


def config_row(name: str, runs: Sequence[SimRun], tokens: Sequence[int], targets: Sequence[float]) -> Row:
    reached = [r.first_below(t) for r, t in zip(runs, targets, strict=True)]
    return {
        "name": name,
        "argv": argv(name, FULL) if name in CONFIGS else None,
        "val_loss_at_budget": spread(
            [r.val_at("tokens_total", b) for r, b in zip(runs, tokens, strict=True)]
        ),
        "rounds_to_target": spread([None if x is None else x[0] for x in reached]),
        "time_to_target_s": spread([None if x is None else x[1].sim_time_s for x in reached]),
        "tokens_to_target": spread([None if x is None else x[1].tokens_total for x in reached]),
        "final_batch": [r.records[-1].batch_sizes for r in runs],
        "sec_per_round": spread([r.records[-1].sim_time_s / len(r.records) for r in runs]),
        "wall_s": spread([r.wall_s for r in runs]),
    }


def ddp_row(runs: Sequence[DdpRun], tokens: Sequence[int], targets: Sequence[float]) -> Row:
    reached = [r.first_below(t) for r, t in zip(runs, targets, strict=True)]
    return {
        "name": "DDP",
        "argv": None,
        "val_loss_at_budget": spread([r.val_at(b) for r, b in zip(runs, tokens, strict=True)]),
        "rounds_to_target": spread([None if x is None else x[0] for x in reached]),
        "time_to_target_s": spread([None if x is None else x[2] for x in reached]),
        "tokens_to_target": spread([None if x is None else x[1] for x in reached]),
        "final_batch": None,
        "sec_per_round": spread([r.points[-1][2] / max(1, r.points[-1][0]) for r in runs]),
        "wall_s": spread([r.wall_s for r in runs]),
    }


def _reduction(base: Row, ours: Row) -> float | None:
    """How much less (%) the median of `ours` is than the median of `base`."""
    if base["median"] is None or ours["median"] is None:
        return None
    return 100.0 * (1.0 - ours["median"] / base["median"])


def _paired(runs: dict[str, list[SimRun]], targets: Sequence[float], what: str) -> Row:
    """AdLoCo's reduction against DiLoCo seed by seed (%), `what`: rounds or time."""
    out: list[float | None] = []
    for base, ours, t in zip(runs[BASELINE], runs[ADLOCO], targets, strict=True):
        b, o = base.first_below(t), ours.first_below(t)
        if b is None or o is None:
            out.append(None)
        elif what == "rounds":
            out.append(100.0 * (1 - o[0] / b[0]))
        else:
            out.append(100.0 * (1 - _time(o[1]) / _time(b[1])))
    return spread(out)


def milestones(runs: dict[str, list[SimRun]], budget: Budget) -> list[Row]:
    """Rounds and simulated time each configuration takes to reach DiLoCo's val loss after a quarter,
    half, three quarters and all of its rounds (per seed, DiLoCo's own curve): the goal's comparison
    at looser targets, which every run reaches."""
    out = []
    for k in sorted({max(1, round(f * budget.diloco_rounds)) for f in (0.25, 0.5, 0.75, 1.0)}):
        targets = [base.records[min(k, len(base.records)) - 1].val_loss for base in runs[BASELINE]]
        for name, rs in runs.items():
            hits = [r.first_below(t) for r, t in zip(rs, targets, strict=True)]
            out.append(
                {
                    "diloco_round": k,
                    "name": name,
                    "rounds": spread([None if h is None else h[0] for h in hits]),
                    "time_s": spread([None if h is None else _time(h[1]) for h in hits]),
                }
            )
    return out


def _time(record: Any) -> float:
    return float(record.sim_time_s)


def plot(
    runs: dict[str, list[SimRun]], ddps: Sequence[DdpRun], targets: Sequence[float], out: Path
) -> list[str]:
    """Val loss against rounds, simulated time and tokens (medians over seeds, shaded min..max)."""
    target = statistics.median(targets)
    ddp_points = [list(zip(*d.points, strict=True)) for d in ddps]
    n = min(len(p[0]) for p in ddp_points)

    def ddp_curve(axis: int) -> tuple[list[float], list[float]]:
        xs = [statistics.median(p[axis][i] for p in ddp_points) for i in range(n)]
        return xs, [statistics.median(p[3][i] for p in ddp_points) for i in range(n)]

    title = f"4 simulated peers, median over {len(targets)} seed(s) (shaded: min..max)"
    hline = [(target, f"target {target:.3f} (DiLoCo at the budget)")]
    files = [
        plot_curves(
            runs,
            out / "convergence_rounds.png",
            key="round",
            xlabel="communication rounds (DDP: steps)",
            title=title,
            hlines=hline,
            extra={"DDP": ddp_curve(0)},
            logx=True,
        ),
        plot_curves(
            runs,
            out / "convergence_time.png",
            key="sim_time_s",
            xlabel="simulated time (s)",
            title=title,
            hlines=hline,
            extra={"DDP": ddp_curve(2)},
            logx=True,
        ),
        plot_curves(
            runs,
            out / "convergence_tokens.png",
            key="tokens_total",
            xlabel="training tokens (all peers)",
            title=title,
            hlines=hline,
            extra={"DDP": ddp_curve(1)},
        ),
    ]
    return [f.name for f in files]


def run(quick: bool, seeds: list[int], out: Path, step_curve: str | None = None) -> dict[str, Any]:
    """The ladder and DDP at every seed; writes out/convergence.json and the plots; returns the
    summary (the keys issue 11 names, the table, the goal's verdict). `step_curve`: the simulated
    peers compute at a measured step time per batch (a GPU's) instead of a time linear in it."""
    if not seeds:
        raise ValueError("convergence: at least one seed")
    set_threads(1)
    budget = replace(QUICK if quick else FULL, step_curve=step_curve)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus, tokenizer = load_data(sim_config(argv(BASELINE, budget), seed=seeds[0]).train)
    runs: dict[str, list[SimRun]] = {name: [] for name in CONFIGS}
    ddps: list[DdpRun] = []
    tokens: list[int] = []
    targets: list[float] = []
    for seed in seeds:
        seed_run, ddp, seed_tokens, target = seed_runs(seed, corpus, tokenizer.vocab_size, budget)
        for name, r in seed_run.items():
            runs[name].append(r)
        ddps.append(ddp)
        tokens.append(seed_tokens)
        targets.append(target)
    summary = summarize(runs, ddps, tokens, targets, budget=budget, seeds=seeds, quick=quick, out=out)
    summary["duration_s"] = time.perf_counter() - t0
    (out / "convergence.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def summarize(
    runs: dict[str, list[SimRun]],
    ddps: Sequence[DdpRun],
    tokens: Sequence[int],
    targets: Sequence[float],
    *,
    budget: Budget,
    seeds: Sequence[int],
    quick: bool,
    out: Path,
) -> dict[str, Any]:
    """The table, the goal's figures and the plots from the runs of every seed."""
    table = [ddp_row(ddps, tokens, targets)] + [config_row(n, runs[n], tokens, targets) for n in CONFIGS]
    rows = {r["name"]: r for r in table}
    base, ours = rows[BASELINE], rows[ADLOCO]
    rounds_cut = _reduction(base["rounds_to_target"], ours["rounds_to_target"])
    time_cut = _reduction(base["time_to_target_s"], ours["time_to_target_s"])
    sim = sim_config(argv(BASELINE, budget), seed=0)
    summary: dict[str, Any] = {
        "diloco_rounds_to_target": base["rounds_to_target"]["median"],
        "adloco_rounds_to_target": ours["rounds_to_target"]["median"],
        "diloco_time_to_target_s": base["time_to_target_s"]["median"],
        "adloco_time_to_target_s": ours["time_to_target_s"]["median"],
        "target_val_loss": statistics.median(targets),
        "target": "each seed's DiLoCo val loss at the token budget",
        "token_budget": statistics.median(tokens),
        "rounds_reduction_pct": rounds_cut,
        "time_reduction_pct": time_cut,
        "rounds_reduction_pct_paired": _paired(runs, targets, "rounds"),
        "time_reduction_pct_paired": _paired(runs, targets, "time"),
        "goal_pct": GOAL_PCT,
        # 16 of 20 rounds is 20 % less, which floating point puts a hair below 20.
        "goal_met": rounds_cut is not None
        and time_cut is not None
        and rounds_cut >= GOAL_PCT - 1e-9
        and time_cut >= GOAL_PCT - 1e-9,
        "table": table,
        "milestones": milestones(runs, budget),
        "setup": {
            "common_argv": list(COMMON),
            "budget": asdict(budget),
            "sim": {k: v for k, v in asdict(sim).items() if k != "train"},
            "ddp_lr": TrainConfig().inner.lr,
        },
        "seeds": list(seeds),
        "quick": quick,
        "curves": {
            name: [{"seed": r.seed, "initial_val_loss": r.initial_val_loss, "records": r.curve()} for r in rs]
            for name, rs in runs.items()
        },
        "ddp_curves": [{"seed": d.seed, "points": d.points} for d in ddps],
    }
    summary["plots"] = plot(runs, ddps, targets, out)
    return summary


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        "| config | val loss at budget | rounds to target | sim. s to target | tokens to target | s/round |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["table"]:
        lines.append(
            f"| {r['name']} | {fmt(r['val_loss_at_budget'])} | {fmt(r['rounds_to_target'], 0)}"
            f" | {fmt(r['time_to_target_s'], 1)} | {fmt(r['tokens_to_target'], 0)}"
            f" | {fmt(r['sec_per_round'], 2)} |"
        )
    return "\n".join(lines)


def format_milestones(summary: dict[str, Any]) -> str:
    lines = [
        "| DiLoCo's loss after round | config | rounds to it | sim. s to it |",
        "| ---: | --- | ---: | ---: |",
    ]
    for m in summary["milestones"]:
        lines.append(f"| {m['diloco_round']} | {m['name']} | {fmt(m['rounds'], 0)} | {fmt(m['time_s'], 1)} |")
    return "\n".join(lines)


def main(argv_: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny budget, for CI")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("bench/results/convergence"))
    ap.add_argument(
        "--step-curve",
        default=None,
        help="bench/step_curve.py JSON: compute at a measured step time per batch",
    )
    args = ap.parse_args(argv_)
    summary = run(args.quick, args.seeds, args.out, step_curve=args.step_curve)
    print(format_table(summary))
    print(format_milestones(summary))
    rc, tc = summary["rounds_reduction_pct"], summary["time_reduction_pct"]
    verdict = "meets" if summary["goal_met"] else "misses"
    print(
        f"target {summary['target_val_loss']:.4f} ({summary['target']}); full AdLoCo vs DiLoCo:"
        f" {_pct(rc)} fewer rounds, {_pct(tc)} less simulated time;"
        f" {verdict} the goal (>= {GOAL_PCT:g} % both)."
        f" {summary['duration_s']:.0f} s for {len(args.seeds)} seed(s)"
    )
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f} %"


if __name__ == "__main__":
    raise SystemExit(main())
