"""Async benchmark: what HeLoCo correction, staleness weighting and DyLU do for a heterogeneous swarm.

Five simulated peers, one of them five times slower (slowdown 1,1,1,1,5, as in HeLoCo's
heterogeneous setup), non-IID data so the slow peer holds packages nobody else trains on (HeLoCo
ties a language to each worker). Training is real (the tiny default model, reduced to seq_len 64,
one instance, b 8 fixed, H 6); time is the simulator's model. Scenarios:

1. sync DiLoCo: every round waits for the slow peer (outer lr 0.7);
2. async, HeLoCo correction on, ρ(τ) = (1+τ)^−½ (outer lr 0.35 here and below);
3. async, correction off (the raw late Δ), ρ = inv_sqrt;
4. async, correction off, ρ = 1 (naive async);
5. async + DyLU (the slow peer shortens H by its speed), correction on;
6. async, correction on with stronger settings (`STRONG_HELOCO`), since the defaults do not act here.

Each run stops at a fixed *simulated* time budget T: the simulator runs with a generous round cap
and the callback stops it at the first record past T, which is discarded. Reported per scenario:
the rounds, tokens and simulated time within T; the validation loss at T and at a common token
budget B (the fewest tokens any scenario of that seed reached by T), each taken at the last record
at or before the budget (the model that exists then, no interpolation); staleness, late
contributions, what HeLoCo did to them, and drops.

The two budget points are evaluated on the whole held-out set (every non-overlapping window of the
validation documents) and on its slow-peer domain (the validation documents of the packages the
slow peer trains on), from a θ snapshot kept after every round. The per-round curve uses the
simulator's own, smaller validation set. Medians over seeds, with each seed's value, where repeated.
Every figure is measured when the script runs. Run from the repository root:

    python bench/async_heloco.py                          # 2 seeds, T = 12 s, ~5 min on 2 shared cores
    python bench/async_heloco.py --seeds 1 --time-budget 8 --out /tmp/async.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from adloco.node.data.corpus import Corpus
from adloco.node.data.sampling import evaluate, shard_documents
from adloco.node.model.model import build_model
from adloco.node.sim.engine import RoundRecord, SimConfig, Simulator, initial_val_loss, records_as_dicts
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.rounds import ContributionInfo, LocalRound
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.heloco import HelocoConfig
from adloco.protocol.algorithms.outer import OuterConfig
from adloco.protocol.algorithms.pseudograd import tensors_hash
from adloco.protocol.algorithms.schedule import ScheduleConfig

Row = dict[str, Any]
Theta = list[torch.Tensor]

PEERS = 5
SLOWDOWN: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 5.0)
SLOW_PEER = 4  # the peer with slowdown 5
ROUND_CAP = 10_000
DEFAULT_OUT = Path("bench/results/async_heloco.json")
# The per-round fields kept in the JSON (the rest are constant in this benchmark).
RECORD_FIELDS: tuple[str, ...] = (
    "round",
    "sim_time_s",
    "tokens_total",
    "val_loss",
    "inner_loss",
    "group_size",
    "staleness_mean",
    "staleness",
    "late_corrected",
    "corrected_tensors",
    "late_dropped",
    "comm_s",
    "round_bytes",
    "theta_hash",
)


@dataclass(frozen=True)
class Scenario:
    """One swarm configuration; everything not named here is shared by all scenarios."""

    name: str
    mode: Literal["sync", "async"]
    outer_lr: float
    correct_late: bool = True
    staleness_weight: Literal["constant", "inv_sqrt", "tokens"] = "inv_sqrt"
    dylu: bool = False
    heloco: HelocoConfig = field(default_factory=HelocoConfig)


# The defaults never act here (see the staleness table): every tensor of the τ = 2 contributions of
# this setup has cos(Δ, m) above c_ok = 0.2, and with the default N1 outer momentum ||m|| grows toward
# 1/(1−μ) = 10× ||Δ|| (the formula sheet's N2 keeps it near ||Δ||), so the confidence
# ||Δ||/(||Δ|| + κ||m||) is small at κ = 1. This variant raises c_ok and scales κ by (1−μ) so the
# correction does act (our choice; the paper's values are unknown).
STRONG_HELOCO = HelocoConfig(c_ok=0.9, k_d=1.0, kappa=0.1)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("sync", "sync", 0.7),
    Scenario("async+heloco", "async", 0.35),
    Scenario("async raw", "async", 0.35, correct_late=False),
    Scenario("async naive", "async", 0.35, correct_late=False, staleness_weight="constant"),
    Scenario("async+dylu+heloco", "async", 0.35, dylu=True),
    Scenario("async+heloco strong", "async", 0.35, heloco=STRONG_HELOCO),
)


def train_config(s: Scenario, seed: int) -> TrainConfig:
    """The reduced configuration: b fixed (no batch test), so scenarios differ only in what is named."""
    return TrainConfig(
        seq_len=64,
        batch_size=8,
        instances=1,
        inner_steps=6,
        max_corpus_mb=4,
        non_iid=True,
        b_max=64,  # skips the probe; b stays 8, far below any limit
        schedule=ScheduleConfig(test="none"),
        outer=OuterConfig(lr=s.outer_lr),
        correct_late=s.correct_late,
        heloco=s.heloco,
        staleness_weight=s.staleness_weight,
        dylu=s.dylu,
        seed=seed,
    )


def sim_config(s: Scenario, seed: int, bandwidth_mbps: float) -> SimConfig:
    return SimConfig(
        peers=PEERS,
        rounds=ROUND_CAP,
        mode=s.mode,
        train=train_config(s, seed),
        slowdown=SLOWDOWN,
        bandwidth_mbps=bandwidth_mbps,
    )


# --- evaluation sets ------------------------------------------------------------------------------


def windows(streams: Sequence[torch.Tensor], seq_len: int) -> torch.Tensor | None:
    """Every non-overlapping seq_len window of the concatenated streams; None if there is none."""
    if not streams:
        return None
    stream = torch.cat(list(streams))
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len).long() if n else None


def slow_domain_windows(corpus: Corpus, seq_len: int, seed: int) -> tuple[torch.Tensor | None, list[str]]:
    """Held-out windows of the packages the slowest peer trains on, and those packages.

    The peer's groups are those of its non-IID shard's documents, so this follows whatever
    `shard_documents` (and hence `shard_corpus`) decides.
    """
    shard = shard_documents(
        corpus,
        peer_index=SLOW_PEER,
        num_peers=PEERS,
        instance_index=0,
        num_instances=1,
        non_iid=True,
        seed=seed,
    )
    if shard is None:
        return None, []
    groups = sorted({corpus.groups[int(g)] for g in shard.group})
    val = [d.tokens for d in corpus.documents(corpus.val) if d.group in groups]
    return windows(val, seq_len), groups


@dataclass
class Evaluator:
    """Loss of a θ snapshot on the full held-out set and on the slow peer's domain."""

    model: torch.nn.Module
    full: torch.Tensor
    domain: torch.Tensor | None

    @torch.no_grad()
    def losses(self, theta: Theta) -> tuple[float, float | None]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p, t in zip(params, theta, strict=True):
            p.copy_(t)
        full = evaluate(self.model, self.full, micro_batch=64)
        domain = None if self.domain is None else evaluate(self.model, self.domain, micro_batch=64)
        return full, domain


def make_evaluator(corpus: Corpus, vocab_size: int, seed: int) -> tuple[Evaluator, list[str]]:
    cfg = train_config(SCENARIOS[0], seed)
    model = build_model(cfg.model, vocab_size=vocab_size, seed=seed, max_seq_len=max(1024, cfg.seq_len))
    full = windows([d.tokens for d in corpus.documents(corpus.val)], cfg.seq_len)
    if full is None:
        raise SystemExit("the corpus has no validation window; raise max_corpus_mb")
    domain, groups = slow_domain_windows(corpus, cfg.seq_len, seed)
    return Evaluator(model=model, full=full, domain=domain), groups


def window_counts(evaluator: Evaluator) -> tuple[int, int]:
    return evaluator.full.shape[0], 0 if evaluator.domain is None else evaluator.domain.shape[0]


# --- one run --------------------------------------------------------------------------------------


class _BudgetReached(Exception):
    """Raised from the round callback to stop the simulator at the time budget."""


@dataclass
class Run:
    """One scenario and seed: records within the budget, θ after each, and every contribution."""

    scenario: Scenario
    seed: int
    initial_val_loss: float
    theta0: Theta
    records: list[RoundRecord] = field(default_factory=list)
    thetas: list[Theta] = field(default_factory=list)
    contributions: list[Row] = field(default_factory=list)
    wall_s: float = 0.0


def record_contributions(sim: Simulator, log: list[Row]) -> None:
    """Wrap each peer's `contribute` to log τ, weight, HeLoCo's report and cos(Δ, m) per tensor.

    The cosines are taken on the uncorrected Δ against the momentum the peer holds after catch-up,
    i.e. what HeLoCo sees; logging them does not change what the peer sends.
    """
    for index, peer in enumerate(sim.peers):
        original = peer.contribute

        def logged(
            local: LocalRound,
            *,
            bandwidth_bps: float = 0.0,
            _p: Peer = peer,
            _i: int = index,
            _f: Callable = original,
        ) -> tuple[Any, ContributionInfo]:
            cosines = _tensor_cosines(local.delta, _p.state.momentum)
            contribution, info = _f(local, bandwidth_bps=bandwidth_bps)
            report = info.correction
            log.append(
                {
                    "record_index": len(sim.records),
                    "peer": _i,
                    "staleness": info.staleness,
                    "weight": info.weight,
                    "tokens": local.tokens,
                    "inner_steps": local.inner_steps,
                    "dropped": info.dropped,
                    "cos_mean": statistics.fmean(cosines) if cosines else math.nan,
                    "cos_min": min(cosines) if cosines else math.nan,
                    "momentum_to_delta_norm": _norm(_p.state.momentum) / max(_norm(local.delta), 1e-30),
                    "correction": None if report is None else asdict(report),
                }
            )
            return contribution, info

        peer.contribute = logged  # type: ignore[method-assign]


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _tensor_cosines(delta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> list[float]:
    out = []
    for d, m in zip(delta, momentum, strict=True):
        dn, mn = float(d.norm()), float(m.norm())
        if dn > 0 and mn > 0:
            out.append(float((d.double().flatten() @ m.double().flatten()) / (dn * mn)))
    return out


def run_scenario(
    s: Scenario, seed: int, corpus: Corpus, vocab_size: int, *, time_budget: float, bandwidth_mbps: float
) -> Run:
    """Run one scenario until its simulated time passes `time_budget`; keep what lies within it."""
    t0 = time.perf_counter()
    sim = Simulator(sim_config(s, seed, bandwidth_mbps), corpus, vocab_size=vocab_size)
    run = Run(
        scenario=s,
        seed=seed,
        initial_val_loss=initial_val_loss(sim),
        theta0=[t.detach().clone() for t in sim.peers[0].state.theta],
    )
    record_contributions(sim, run.contributions)

    def on_round(record: RoundRecord) -> None:
        if record.sim_time_s > time_budget:
            raise _BudgetReached
        # The most advanced peer holds the round's θ (every member holds it identically).
        leader = max(sim.peers, key=lambda p: p.state.round)
        run.thetas.append([t.detach().clone() for t in leader.state.theta])

    with contextlib.suppress(_BudgetReached):
        sim.run(on_round=on_round)
    run.records = sim.records[: len(run.thetas)]
    run.contributions[:] = [c for c in run.contributions if c["record_index"] < len(run.records)]
    if run.records and tensors_hash(run.thetas[-1]) != run.records[-1].theta_hash:
        raise AssertionError(f"{s.name}: the θ snapshot does not match the record's hash")
    run.wall_s = time.perf_counter() - t0
    return run


# --- summaries ------------------------------------------------------------------------------------


def point(run: Run, index: int, evaluator: Evaluator) -> Row:
    """The state after record `index` (−1: θ_0), with its losses on both evaluation sets."""
    theta = run.theta0 if index < 0 else run.thetas[index]
    full, domain = evaluator.losses(theta)
    rec = run.records[index] if index >= 0 else None
    return {
        "rounds": 0 if rec is None else index + 1,
        "tokens": 0 if rec is None else rec.tokens_total,
        "sim_time_s": 0.0 if rec is None else rec.sim_time_s,
        "val_loss": full,
        "domain_val_loss": domain,
    }


def last_index(run: Run, predicate: Callable[[RoundRecord], bool]) -> int:
    """Index of the last record satisfying `predicate` (records are in time order), −1 if none."""
    return max((i for i, r in enumerate(run.records) if predicate(r)), default=-1)


def contribution_stats(run: Run) -> Row:
    """Staleness, late contributions and what HeLoCo did to them, within the budget."""
    contribs = run.contributions
    late = [c for c in contribs if c["staleness"] > 0]
    reports = [c["correction"] for c in late if c["correction"] is not None]
    return {
        "contributions": len(contribs),
        "staleness_mean": _mean([c["staleness"] for c in contribs]),
        "staleness_mean_late": _mean([c["staleness"] for c in late]),
        "staleness_max": max((c["staleness"] for c in contribs), default=0),
        "late": len(late),
        "late_corrected": sum(r.late_corrected for r in run.records),
        "corrected_tensors": sum(r.corrected_tensors for r in run.records),
        "tensors_examined": sum(r["keep"] + r["shrink"] + r["rotate"] for r in reports),
        "late_cos_mean": _mean([c["cos_mean"] for c in late]),
        "late_cos_min": min((c["cos_min"] for c in late), default=math.nan),
        "late_m_over_delta": _mean([c["momentum_to_delta_norm"] for c in late]),
        "dropped": sum(r.late_dropped for r in run.records),
        "slow_peer_inner_steps": sorted({c["inner_steps"] for c in contribs if c["peer"] == SLOW_PEER}),
    }


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize_seed(runs: Sequence[Run], evaluator: Evaluator, time_budget: float) -> tuple[list[Row], int]:
    """Per-run summary rows for one seed, and that seed's common token budget B."""
    token_budget = min(r.records[-1].tokens_total if r.records else 0 for r in runs)
    rows = []
    for run in runs:
        at_t = point(run, len(run.records) - 1, evaluator)
        at_b = point(run, last_index(run, lambda r: r.tokens_total <= token_budget), evaluator)
        rows.append(
            {
                "scenario": run.scenario.name,
                "seed": run.seed,
                "initial_val_loss": run.initial_val_loss,
                "at_time_budget": at_t,
                "at_token_budget": at_b,
                "token_budget": token_budget,
                "time_budget_s": time_budget,
                "final_theta_hash": run.records[-1].theta_hash if run.records else None,
                "wall_s": run.wall_s,
                **contribution_stats(run),
            }
        )
    return rows, token_budget


def curve(run: Run, times: Sequence[float]) -> list[float]:
    """The simulator's per-round val loss at each time: the last record at or before it."""
    out = []
    for t in times:
        i = last_index(run, lambda r, t=t: r.sim_time_s <= t)
        out.append(run.initial_val_loss if i < 0 else run.records[i].val_loss)
    return out


# --- output ---------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def med(values: Sequence[float | None], fmt: str) -> str:
    """Median over seeds, followed by every seed's value when there is more than one."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "–"
    each = [format(v, fmt) for v in vals]
    head = format(statistics.median(vals), fmt)
    # Values every seed agrees on (round counts, tokens) are printed once.
    return head if len(set(each)) == 1 else f"{head} ({' / '.join(each)})"


def by_scenario(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(row["scenario"], []).append(row)
    return out


def gaps(rows: Sequence[Row], sync: Sequence[Row] | None, key: str) -> list[float]:
    """Val loss minus sync's at the same budget point, seed by seed."""
    return [r[key]["val_loss"] - s[key]["val_loss"] for r, s in zip(rows, sync or [], strict=False)]


def budget_table(rows: Sequence[Row]) -> str:
    headers = ["scenario", "rounds", "tokens", "sim s", "val@T", "domain val@T"]
    headers += ["val@B", "domain val@B", "rounds@B", "val@T − sync", "val@B − sync"]
    groups = by_scenario(rows)
    sync = groups.get("sync")
    table = []
    for name, rs in groups.items():
        t = [r["at_time_budget"] for r in rs]
        b = [r["at_token_budget"] for r in rs]
        gap_t = gaps(rs, sync, "at_time_budget")
        gap_b = gaps(rs, sync, "at_token_budget")
        table.append(
            [
                name,
                med([p["rounds"] for p in t], ".0f"),
                med([p["tokens"] for p in t], ",.0f"),
                med([p["sim_time_s"] for p in t], ".1f"),
                med([p["val_loss"] for p in t], ".4f"),
                med([p["domain_val_loss"] for p in t], ".4f"),
                med([p["val_loss"] for p in b], ".4f"),
                med([p["domain_val_loss"] for p in b], ".4f"),
                med([p["rounds"] for p in b], ".0f"),
                med(gap_t, "+.4f"),
                med(gap_b, "+.4f"),
            ]
        )
    return markdown_table(headers, table)


def staleness_table(rows: Sequence[Row]) -> str:
    headers = ["scenario", "contribs", "τ mean (all)", "τ mean (late)", "τ max", "late", "through HeLoCo"]
    headers += ["tensors changed / examined", "cos(Δ_late, m) mean", "min", "‖m‖/‖Δ_late‖", "dropped"]
    headers += ["slow peer H", "wall s"]
    table = []
    for name, rs in by_scenario(rows).items():
        table.append(
            [
                name,
                med([r["contributions"] for r in rs], ".0f"),
                med([r["staleness_mean"] for r in rs], ".2f"),
                med([r["staleness_mean_late"] for r in rs], ".2f"),
                med([r["staleness_max"] for r in rs], ".0f"),
                med([r["late"] for r in rs], ".0f"),
                med([r["late_corrected"] for r in rs], ".0f"),
                med([r["corrected_tensors"] for r in rs], ".0f")
                + " / "
                + med([r["tensors_examined"] for r in rs], ".0f"),
                med([r["late_cos_mean"] for r in rs], ".3f"),
                med([r["late_cos_min"] for r in rs], ".3f"),
                med([r["late_m_over_delta"] for r in rs], ".1f"),
                med([r["dropped"] for r in rs], ".0f"),
                ",".join(str(h) for h in rs[0]["slow_peer_inner_steps"]),
                med([r["wall_s"] for r in rs], ".0f"),
            ]
        )
    return markdown_table(headers, table)


def curve_table(curves: dict[str, list[list[float]]], times: Sequence[float]) -> str:
    headers = ["sim s", *curves]
    table = [
        [f"{t:.0f}", *(f"{statistics.median(c[k] for c in runs):.3f}" for runs in curves.values())]
        for k, t in enumerate(times)
    ]
    return markdown_table(headers, table)


def identical_final_states(rows: Sequence[Row]) -> list[str]:
    """Scenario pairs that ended with bit-identical θ in the same seed."""
    notes = []
    seeds = sorted({r["seed"] for r in rows})
    for seed in seeds:
        rs = [r for r in rows if r["seed"] == seed]
        for i, a in enumerate(rs):
            for b in rs[i + 1 :]:
                if a["final_theta_hash"] and a["final_theta_hash"] == b["final_theta_hash"]:
                    notes.append(f"seed {seed}: '{a['scenario']}' and '{b['scenario']}' end with identical θ")
    return notes


def report(results: Row) -> str:
    cfg = results["config"]
    full, domain = results["eval_windows"]
    head = (
        f"## Async HeLoCo vs sync DiLoCo ({PEERS} peers, slowdown {cfg['slowdown']}, non-IID;"
        f" seq_len {cfg['seq_len']}, b {cfg['batch_size']} fixed, H {cfg['inner_steps']}, K 1,"
        f" {cfg['bandwidth_mbps']:g} Mbps; seeds {cfg['seeds']}; T = {cfg['time_budget_s']:g} sim s,"
        f" B = {', '.join(f'{b:,}' for b in results['token_budgets'])} tokens)\n\n"
        f"val = full held-out set ({full} windows of {cfg['seq_len']} tokens); domain = the held-out"
        f" documents of the {len(results['slow_domain_groups'])} packages the slow peer trains on"
        f" ({domain} windows); @T and @B: last record at or before the budget; rounds = applied"
        " outer steps. Median over seeds (each seed's value in brackets).\n\n"
    )
    notes = identical_final_states(results["runs"])
    tail = "\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""
    return (
        head
        + budget_table(results["runs"])
        + "\n\n### Staleness and correction (within T)\n\n"
        + staleness_table(results["runs"])
        + tail
        + "\n\n### Val loss against simulated time (simulator's val set, median over seeds)\n\n"
        + curve_table(results["curves"], results["curve_times_s"])
    )


# --- entry point ----------------------------------------------------------------------------------


def run_seed(
    seed: int, scenarios: Sequence[Scenario], args: argparse.Namespace, times: Sequence[float]
) -> tuple[list[Row], int, dict[str, list[float]], list[str], tuple[int, int]]:
    corpus, tokenizer = load_data(train_config(scenarios[0], seed))
    evaluator, groups = make_evaluator(corpus, tokenizer.vocab_size, seed)
    runs = []
    for s in scenarios:
        run = run_scenario(
            s,
            seed,
            corpus,
            tokenizer.vocab_size,
            time_budget=args.time_budget,
            bandwidth_mbps=args.bandwidth_mbps,
        )
        print(f"[seed {seed}] {s.name}: {len(run.records)} rounds, {run.wall_s:.0f}s wall", flush=True)
        runs.append(run)
    rows, token_budget = summarize_seed(runs, evaluator, args.time_budget)
    for row, run in zip(rows, runs, strict=True):
        row["records"] = [{k: r[k] for k in RECORD_FIELDS} for r in records_as_dicts(run.records)]
        row["late_contributions"] = [c for c in run.contributions if c["staleness"] > 0]
    curves = {run.scenario.name: curve(run, times) for run in runs}
    return rows, token_budget, curves, groups, window_counts(evaluator)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (model init, sampling)")
    p.add_argument("--time-budget", type=float, default=12.0, help="simulated seconds per run (T)")
    p.add_argument("--bandwidth-mbps", type=float, default=20.0, help="each peer's modelled link")
    p.add_argument(
        "--scenarios", default=",".join(s.name for s in SCENARIOS), help="comma-separated scenario names"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the results as JSON")
    # torch's default of one thread per core oversubscribes a shared 2-core machine (bench/codecs.py).
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    known = {s.name: s for s in SCENARIOS}
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"--scenarios: unknown {unknown}; choose from {list(known)}")
    scenarios = [known[n] for n in names]
    t0 = time.perf_counter()
    times = [float(t) for t in range(0, math.floor(args.time_budget) + 1, 2)]
    rows: list[Row] = []
    budgets: list[int] = []
    curves: dict[str, list[list[float]]] = {s.name: [] for s in scenarios}
    groups: list[str] = []
    counts = (0, 0)
    for seed in range(args.seeds):
        seed_rows, budget, seed_curves, groups, counts = run_seed(seed, scenarios, args, times)
        rows += seed_rows
        budgets.append(budget)
        for name, c in seed_curves.items():
            curves[name].append(c)
    cfg = train_config(scenarios[0], 0)
    results: Row = {
        "config": {
            "peers": PEERS,
            "slowdown": list(SLOWDOWN),
            "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size,
            "inner_steps": cfg.inner_steps,
            "max_corpus_mb": cfg.max_corpus_mb,
            "bandwidth_mbps": args.bandwidth_mbps,
            "seeds": args.seeds,
            "time_budget_s": args.time_budget,
            "scenarios": [asdict(s) for s in scenarios],
            "heloco": asdict(cfg.heloco),
            "train": {k: v for k, v in asdict(replace(cfg, seed=0)).items() if not isinstance(v, dict)},
        },
        "token_budgets": budgets,
        "slow_domain_groups": groups,
        "eval_windows": counts,
        "curve_times_s": times,
        "curves": curves,
        "runs": rows,
        "torch_threads": torch.get_num_threads(),
    }
    print("\n" + report(results) + "\n", flush=True)
    results["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"total {results['wall_s']:.0f}s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
