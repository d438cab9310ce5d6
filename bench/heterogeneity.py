"""Issue 11 §3, heterogeneity: async DiLoCo with stale Δ (τ ≈ 14), HeLoCo and DyLU, in the simulator.

HeLoCo's heterogeneous setup (research/algorithms.md §5.3): five simulated peers with relative step
times 1, 15, 15, 15, 15 and non-IID data (each peer its own top-level packages of the embedded
corpus), the tiny default model at seq_len 64, one MIT instance, fixed b, H inner steps, no
compression (fp32: staleness alone), no overlap, one torch thread. The rounds are compute-dominated
so the slow peers' contributions arrive about 14 rounds late: 0.05 simulated seconds per sample
(a fast local round is H·b·0.05 s = 1 s) against a 1 Gbit/s link with 5 ms latency (an exchange of
the 2.4 MB fp32 Δ takes ~0.05 s), so the fast peer completes ~14 rounds while a slow one trains.

Configurations (`CONFIGS`, each an `adloco-sim` command line): sync DiLoCo (outer lr 0.7); async
Nesterov: late Δ applied uncorrected; async delayed Nesterov (Async DiLoCo's DN, `--outer-delay 5`:
the momentum term once every 5 rounds, about one push per peer, as the paper sets N to the number of
workers), late Δ uncorrected; async + DyLU; async + HeLoCo; async + HeLoCo + DyLU; async + HeLoCo +
delayed Nesterov (does the correction add to DN?). Every async run
uses the simulator's async outer lr (0.35), Nesterov N1 with μ 0.9, and the staleness weight
ρ(τ) = (1+τ)^−½, so the runs differ only in what is named; except delayed Nesterov, at 5 × 0.35:
each of its rounds steps θ by η Δ/N and its momentum, built from the mean Δ of N rounds, acts once
per N rounds, so at the same η its steady-state step per round would be 1/N of plain Nesterov's
(η Δ/(1−μ)); N η gives it the same (the grid also runs it at 0.35 and 0.7), and so does HeLoCo + DN.

Budgets: the simulated time T of `cycles` slow local rounds, and the token budget B that async
without DyLU trains in T (cycles × (15 + 4) local rounds of H·b sequences). Every run goes until it
has passed both; reported: val loss at B tokens and at T seconds (the last record at or before each),
the staleness τ of the late contributions, and what HeLoCo did to their tensors. HeLoCo's constants
are ours (the paper gives none): when the default misses, `grid` searches c_ok, κ and the staleness
weight on the first seed (`grid_variants`), and delayed Nesterov's outer lr (its steps are smaller).

    python bench/heterogeneity.py --out bench/results/heterogeneity            # 3 seeds and the grid
    python bench/heterogeneity.py --quick --out /tmp/heterogeneity
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from adloco.bench.simruns import Row, SimRun, fmt, plot_curves, run_sim, set_threads, sim_config, spread
from adloco.node.data.corpus import Corpus
from adloco.node.sim.engine import SimConfig, Simulator
from adloco.node.training.rounds import ContributionInfo, LocalRound
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.heloco import HelocoConfig

GOAL_VS_ASYNC_PCT = 5.0
"""Issue 11 §3: HeLoCo at least this much lower val loss than async Nesterov at fixed tokens ..."""
# ... and below sync DiLoCo at fixed simulated time.

SLOWDOWN = (1, 15, 15, 15, 15)
ASYNC_OUTER_LR = 0.35  # adloco-sim's outer lr in async mode: half the default 0.7 (node/cli/sim.py)
SEC_PER_SAMPLE = 0.05
COMMON = (
    "--peers", "5", "--slowdown", ",".join(map(str, SLOWDOWN)), "--non-iid", "--seq-len", "64",
    "--instances", "1", "--batch-test", "none", "--codec", "none", "--overlap", "off",
    "--sec-per-sample", str(SEC_PER_SAMPLE), "--bandwidth-mbps", "1000", "--latency-s", "0.005", "--quiet",
)  # fmt: skip
CONFIGS: dict[str, tuple[str, ...]] = {
    "sync DiLoCo": ("--mode", "sync"),
    "async Nesterov": ("--mode", "async", "--no-correction"),
    "async delayed Nesterov": (
        *("--mode", "async", "--no-correction", "--outer-delay", str(len(SLOWDOWN))),
        *("--outer-lr", f"{ASYNC_OUTER_LR * len(SLOWDOWN):g}"),
    ),
    "async + DyLU": ("--mode", "async", "--no-correction", "--dylu"),
    "async + HeLoCo": ("--mode", "async"),
    "async + HeLoCo + DyLU": ("--mode", "async", "--dylu"),
    # HeLoCo's correction on top of the best async baseline: does it add anything to DN?
    "async + HeLoCo + delayed Nesterov": (
        *("--mode", "async", "--outer-delay", str(len(SLOWDOWN))),
        *("--outer-lr", f"{ASYNC_OUTER_LR * len(SLOWDOWN):g}"),
    ),
}
DELAYED_LRS = (ASYNC_OUTER_LR, 2 * ASYNC_OUTER_LR)
SYNC, ASYNC, DELAYED, HELOCO = "sync DiLoCo", "async Nesterov", "async delayed Nesterov", "async + HeLoCo"
HELOCO_DN = "async + HeLoCo + delayed Nesterov"


@dataclass(frozen=True)
class Budget:
    """The run's size: b and H of every local round, and how many slow local rounds T spans."""

    batch: int = 4
    inner_steps: int = 5
    cycles: int = 8

    @property
    def fast_round_s(self) -> float:
        return self.batch * self.inner_steps * SEC_PER_SAMPLE

    @property
    def time_s(self) -> float:
        return self.cycles * max(SLOWDOWN) * self.fast_round_s

    def tokens(self, seq_len: int) -> int:
        rounds = self.cycles * (max(SLOWDOWN) + len(SLOWDOWN) - 1)
        return rounds * self.batch * self.inner_steps * seq_len


FULL = Budget()
QUICK = Budget(batch=2, inner_steps=2, cycles=1)


@dataclass(frozen=True)
class Variant:
    """A configuration, optionally with HeLoCo constants other than the defaults (the grid)."""

    name: str
    config: str
    heloco: dict[str, float] = field(default_factory=dict)
    staleness_weight: str | None = None
    outer_lr: float | None = None


def variant_config(v: Variant, budget: Budget, seed: int) -> SimConfig:
    argv = [*COMMON, "--batch-size", str(budget.batch), "--inner-steps", str(budget.inner_steps)]
    cfg = sim_config([*argv, *CONFIGS[v.config]], seed=seed)
    train = cfg.train
    if v.heloco:
        train = replace(train, heloco=replace(train.heloco, **v.heloco))
    if v.staleness_weight is not None:
        train = replace(train, staleness_weight=v.staleness_weight)  # type: ignore[arg-type]
    if v.outer_lr is not None:
        train = replace(train, outer=replace(train.outer, lr=v.outer_lr))
    return replace(cfg, train=train)


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class HeteroRun:
    """A simulator run and every contribution's staleness and HeLoCo report."""

    run: SimRun
    contributions: list[Row]


def log_contributions(log: list[Row]) -> Callable[[Simulator], None]:
    """Wrap each virtual peer's `contribute` to record τ, the weight and HeLoCo's report (it does
    not change what the peer sends)."""

    def install(sim: Simulator) -> None:
        for index, peer in enumerate(sim.peers):
            original = peer.contribute

            def logged(
                local: LocalRound, *, bandwidth_bps: float = 0.0, _i: int = index, _f: Any = original
            ) -> tuple[Any, ContributionInfo]:
                contribution, info = _f(local, bandwidth_bps=bandwidth_bps)
                report = info.correction
                log.append(
                    {
                        "peer": _i,
                        "staleness": info.staleness,
                        "dropped": info.dropped,
                        "inner_steps": local.inner_steps,
                        "correction": None if report is None else asdict(report),
                    }
                )
                return contribution, info

            peer.contribute = logged  # type: ignore[method-assign]

    return install


def run_variant(v: Variant, corpus: Corpus, vocab_size: int, *, seed: int, budget: Budget) -> HeteroRun:
    cfg = variant_config(v, budget, seed)
    tokens, horizon = budget.tokens(cfg.train.seq_len), budget.time_s
    log: list[Row] = []

    def stop(records: list[Any]) -> bool:
        last = records[-1]
        return last.tokens_total >= tokens and last.sim_time_s >= horizon

    run = run_sim(v.name, cfg, corpus, vocab_size, stop=stop, on_sim=log_contributions(log))
    last = run.records[-1]
    late = [c["staleness"] for c in log if c["staleness"] > 0]
    print(
        f"[heterogeneity seed {seed}] {v.name}: {len(run.records)} rounds, {last.tokens_total} tokens,"
        f" {last.sim_time_s:.0f} sim s, val@B {run.val_at('tokens_total', tokens):.3f},"
        f" val@T {run.val_at('sim_time_s', horizon):.3f}, τ late mean {_mean(late):.1f},"
        f" {run.wall_s:.0f}s wall",
        flush=True,
    )
    return HeteroRun(run=run, contributions=log)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


# ---- summaries ----------------------------------------------------------------------------------


def contribution_stats(runs: Sequence[HeteroRun]) -> Row:
    """Staleness of the late contributions and HeLoCo's actions on their tensors, over all seeds."""
    contribs = [c for r in runs for c in r.contributions]
    late = [c for c in contribs if c["staleness"] > 0]
    reports = [c["correction"] for c in late if c["correction"] is not None]
    return {
        "contributions": len(contribs),
        "late": len(late),
        "dropped": sum(c["dropped"] for c in contribs),
        "tau_mean_late": _mean([c["staleness"] for c in late]),
        "tau_max": max((c["staleness"] for c in contribs), default=0),
        "tau_mean_all": _mean([c["staleness"] for c in contribs]),
        "heloco_tensors": {k: sum(r[k] for r in reports) for k in ("keep", "shrink", "rotate", "skip")},
        "cos_before": _mean([r["mean_cos_before"] for r in reports if math.isfinite(r["mean_cos_before"])]),
        "cos_after": _mean([r["mean_cos_after"] for r in reports if math.isfinite(r["mean_cos_after"])]),
    }


def variant_row(v: Variant, runs: Sequence[HeteroRun], budget: Budget) -> Row:
    tokens = budget.tokens(variant_config(v, budget, 0).train.seq_len)
    return {
        "name": v.name,
        "argv": list(CONFIGS[v.config]),
        "heloco": v.heloco,
        "staleness_weight": v.staleness_weight,
        "outer_lr": v.outer_lr,
        "val_loss_at_tokens": spread([r.run.val_at("tokens_total", tokens) for r in runs]),
        "val_loss_at_time": spread([r.run.val_at("sim_time_s", budget.time_s) for r in runs]),
        "rounds_at_time": spread([_rounds_at(r.run, budget.time_s) for r in runs]),
        "tokens_at_time": spread(
            [(r.run.last_at("sim_time_s", budget.time_s) or _zero()).tokens_total for r in runs]
        ),
        "wall_s": spread([r.run.wall_s for r in runs]),
        **contribution_stats(runs),
    }


def _rounds_at(run: SimRun, t: float) -> int:
    return sum(1 for r in run.records if (r.sim_time_s or 0.0) <= t)


class _Zero:
    tokens_total = 0


def _zero() -> Any:
    return _Zero()


def _pct_lower(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None:
        return None
    return 100.0 * (1.0 - ours / base)


def _paired_pct(ours: Sequence[HeteroRun], base: Sequence[HeteroRun], key: str, budget: float) -> Row:
    return spread(
        [
            100.0 * (1.0 - o.run.val_at(key, budget) / b.run.val_at(key, budget))
            for o, b in zip(ours, base, strict=True)
        ]
    )


# ---- the grid -----------------------------------------------------------------------------------


def grid_variants() -> list[Variant]:
    """HeLoCo's keep threshold c_ok and confidence weight κ around our defaults (ρ = inv_sqrt), and
    the constant staleness weight for both async Nesterov and HeLoCo (each against its own baseline)."""
    out = [
        Variant(f"HeLoCo c_ok={c_ok:g} κ={kappa:g}", HELOCO, {"c_ok": c_ok, "kappa": kappa})
        for c_ok in (0.2, 0.6, 0.9)
        for kappa in (1.0, 0.1)
        if (c_ok, kappa) != (0.2, 1.0)  # the default, measured at every seed already
    ]
    out.append(Variant("async Nesterov ρ=constant", ASYNC, staleness_weight="constant"))
    out.append(Variant("HeLoCo ρ=constant", HELOCO, staleness_weight="constant"))
    # Delayed Nesterov at the async outer lr itself and at twice it (its row runs at N times it).
    out += [Variant(f"delayed Nesterov η={lr:g}", DELAYED, outer_lr=lr) for lr in DELAYED_LRS]
    return out


# ---- entry points -------------------------------------------------------------------------------


def plot(runs: dict[str, list[HeteroRun]], budget: Budget, tokens: int, out: Path) -> list[str]:
    groups = {name: [r.run for r in rs] for name, rs in runs.items()}
    title = (
        f"5 simulated peers, step times {','.join(map(str, SLOWDOWN))}, non-IID;"
        f" median over {len(next(iter(runs.values())))} seed(s) (shaded: min..max)"
    )
    files = [
        plot_curves(
            groups,
            out / "heterogeneity_tokens.png",
            key="tokens_total",
            xlabel="training tokens (all peers)",
            title=title,
            vlines=[(tokens, "token budget B")],
        ),
        plot_curves(
            groups,
            out / "heterogeneity_time.png",
            key="sim_time_s",
            xlabel="simulated time (s)",
            title=title,
            vlines=[(budget.time_s, "time budget T")],
        ),
    ]
    return [f.name for f in files]


def run(quick: bool, seeds: list[int], out: Path, *, grid: bool | None = None) -> dict[str, Any]:
    """Every configuration at every seed (and the HeLoCo grid on the first seed when `grid`, by
    default in a full run); writes out/heterogeneity.json and the plots; returns the summary."""
    if not seeds:
        raise ValueError("heterogeneity: at least one seed")
    set_threads(1)
    budget = QUICK if quick else FULL
    grid = (not quick) if grid is None else grid
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    variants = [Variant(name, name) for name in CONFIGS]
    seq_len = variant_config(variants[0], budget, seeds[0]).train.seq_len
    tokens = budget.tokens(seq_len)
    corpus, tokenizer = load_data(variant_config(variants[0], budget, seeds[0]).train)
    runs: dict[str, list[HeteroRun]] = {v.name: [] for v in variants}
    for seed in seeds:
        for v in variants:
            runs[v.name].append(run_variant(v, corpus, tokenizer.vocab_size, seed=seed, budget=budget))
    table = [variant_row(v, runs[v.name], budget) for v in variants]
    rows = {r["name"]: r for r in table}
    grid_rows: list[Row] = []
    if grid:
        for v in grid_variants():
            one = run_variant(v, corpus, tokenizer.vocab_size, seed=seeds[0], budget=budget)
            grid_rows.append(variant_row(v, [one], budget))
    asy, hel, syn, dn, hel_dn = rows[ASYNC], rows[HELOCO], rows[SYNC], rows[DELAYED], rows[HELOCO_DN]
    vs_async = _pct_lower(hel["val_loss_at_tokens"]["median"], asy["val_loss_at_tokens"]["median"])
    hel_t, syn_t = hel["val_loss_at_time"]["median"], syn["val_loss_at_time"]["median"]
    summary: dict[str, Any] = {
        "async_nesterov_val_loss": asy["val_loss_at_tokens"]["median"],
        "heloco_val_loss": hel["val_loss_at_tokens"]["median"],
        "sync_val_loss_at_fixed_time": syn_t,
        "heloco_val_loss_at_fixed_time": hel_t,
        "tau_mean": hel["tau_mean_late"],
        "heloco_vs_async_pct": vs_async,
        "heloco_vs_async_pct_paired": _paired_pct(runs[HELOCO], runs[ASYNC], "tokens_total", tokens),
        "delayed_nesterov_val_loss": dn["val_loss_at_tokens"]["median"],
        "heloco_vs_delayed_nesterov_pct": _pct_lower(
            hel["val_loss_at_tokens"]["median"], dn["val_loss_at_tokens"]["median"]
        ),
        "heloco_delayed_nesterov_val_loss": hel_dn["val_loss_at_tokens"]["median"],
        "heloco_dn_vs_delayed_nesterov_pct": _pct_lower(
            hel_dn["val_loss_at_tokens"]["median"], dn["val_loss_at_tokens"]["median"]
        ),
        "heloco_vs_sync_at_time_pct": _pct_lower(hel_t, syn_t),
        "goal_vs_async_pct": GOAL_VS_ASYNC_PCT,
        "goal_vs_async_met": vs_async is not None and vs_async >= GOAL_VS_ASYNC_PCT,
        "goal_vs_sync_met": hel_t is not None and syn_t is not None and hel_t < syn_t,
        "token_budget": tokens,
        "time_budget_s": budget.time_s,
        "table": table,
        "grid": grid_rows,
        "grid_seed": seeds[0] if grid else None,
        "setup": {
            "common_argv": list(COMMON),
            "budget": asdict(budget),
            "heloco_defaults": asdict(HelocoConfig()),
        },
        "seeds": list(seeds),
        "quick": quick,
        "curves": {n: [{"seed": r.run.seed, "records": r.run.curve()} for r in rs] for n, rs in runs.items()},
    }
    summary["plots"] = plot(runs, budget, tokens, out)
    summary["duration_s"] = time.perf_counter() - t0
    (out / "heterogeneity.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| config | val loss at B tokens | val loss at T s | rounds by T | τ of late Δ (mean, max)"
        " | HeLoCo tensors keep/shrink/rotate |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        t = r["heloco_tensors"]
        acted = f"{t['keep']}/{t['shrink']}/{t['rotate']}" if sum(t.values()) else "—"
        lines.append(
            f"| {r['name']} | {fmt(r['val_loss_at_tokens'])} | {fmt(r['val_loss_at_time'])}"
            f" | {fmt(r['rounds_at_time'], 0)} | {r['tau_mean_late']:.1f}, {r['tau_max']} | {acted} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny budget, for CI")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("bench/results/heterogeneity"))
    ap.add_argument("--grid", action=argparse.BooleanOptionalAction, default=None, help="HeLoCo grid")
    args = ap.parse_args(argv)
    s = run(args.quick, args.seeds, args.out, grid=args.grid)
    print(format_table(s["table"]))
    if s["grid"]:
        print(f"\nGrid (seed {s['grid_seed']}):\n" + format_table(s["grid"]))
    print(
        f"B = {s['token_budget']} tokens, T = {s['time_budget_s']:g} s; τ of late Δ (HeLoCo run)"
        f" {s['tau_mean']:.1f}. HeLoCo vs async Nesterov at B: {_pct(s['heloco_vs_async_pct'])} lower"
        f" (goal >= {GOAL_VS_ASYNC_PCT:g} %: {'met' if s['goal_vs_async_met'] else 'missed'});"
        f" vs sync at T: {_pct(s['heloco_vs_sync_at_time_pct'])} lower"
        f" (goal > 0: {'met' if s['goal_vs_sync_met'] else 'missed'}). {s['duration_s']:.0f} s"
    )
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f} %"


if __name__ == "__main__":
    raise SystemExit(main())
