"""Hostile peers in the simulator against the owners' aggregation rules (issue 10 §3).

For each aggregation rule (`--aggregate`), contribution scoring (`--score`) and attack
(`adloco-sim --attack`, sent by the last `--hostile` of the peers), one `adloco-sim` run on the
embedded corpus; prints the final validation loss of θ (which every member holds, hostile ones
included) and its gap to the clean run under the plain mean without scoring, so both what each
attack does and what each defence costs in a clean run show. Runs with scoring are keyed
`rule+score/attack/seed`. With scoring on, the compute it costs is measured too: one clean
in-process run of `--cost-rounds` rounds counts the sequences the scorer ran forward against those
trained (each a forward and a backward pass), and times both. Every figure is measured when the
script runs. From the repository root:

    python bench/robust.py                         # 16 peers, 3 hostile, 10 rounds: 15 runs
    python bench/robust.py --aggregates mean,trimmed:0.2 --scores off,loss --jobs 1 \
        --out bench/results/robust_score.json      # 20 runs, and the scorer's cost
    python bench/robust.py --peers 4 --hostile 1 --rounds 20 --attacks none,random
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from simgrid import sim_curves

from adloco.node.cli.sim import build_parser, config_from_args
from adloco.node.sim.engine import Simulator
from adloco.node.training.runtime import load_data

RESULTS = Path(__file__).resolve().parent / "results" / "robust.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--hostile", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--aggregates", default="mean,trimmed:0.2,clip:1")
    ap.add_argument("--scores", default="off", help="comma-separated --score values (off, loss, loss:k)")
    ap.add_argument("--attacks", default="none,flip1000,flip,random,constant")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cost-rounds", type=int, default=3, help="rounds of the scorer's cost run (0: none)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    aggregates, scores = args.aggregates.split(","), args.scores.split(",")
    attacks, seeds = args.attacks.split(","), [int(s) for s in args.seeds.split(",")]
    rules = [(g, sc) for g in aggregates for sc in scores]
    runs = [(g, sc, a, s) for g, sc in rules for a in attacks for s in seeds]
    # Every gap is against the clean mean without scoring: run it if the grid lacks it.
    runs += [("mean", "off", "none", s) for s in seeds if ("mean", "off", "none", s) not in runs]
    common = ["--peers", str(args.peers), "--rounds", str(args.rounds)]
    curves = sim_curves(
        [
            [*common, "--seed", str(s), "--aggregate", g, "--score", sc]
            + (["--hostile", str(args.hostile), "--attack", a] if a != "none" else [])
            for g, sc, a, s in runs
        ],
        jobs=args.jobs,
    )
    by_run = {_key(g, sc, a, s): c for (g, sc, a, s), c in zip(runs, curves, strict=True)}
    final = {key: curve[-1] for key, curve in by_run.items()}
    summary: dict[str, dict[str, float]] = {}
    for g, sc, a, s in runs:
        key, clean = _key(g, sc, a, s), final[f"mean/none/{s}"]
        gap = 100 * (final[key] - clean) / clean
        summary[key] = {"val_loss": final[key], "gap_pct": gap}
        print(f"seed {s} {key.split('/')[0]:18s} {a:9s} final val {final[key]:.4f} ({gap:+.1f} %"
              " against the clean mean)", flush=True)  # fmt: skip
    payload: dict[str, Any] = {"command": _command(args), "summary": summary, "val_loss_by_run": by_run}
    scored = [sc for sc in scores if sc != "off"]
    if scored and args.cost_rounds > 0:
        payload["score_cost"] = score_cost(scored[0], peers=args.peers, rounds=args.cost_rounds)
        print("scoring cost:", json.dumps(payload["score_cost"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload) + "\n")
    print(f"wrote {args.out}")


def _key(aggregate: str, score: str, attack: str, seed: int) -> str:
    """The run's key: `rule/attack/seed` as before scoring existed, `rule+score/...` with it."""
    return f"{aggregate if score == 'off' else f'{aggregate}+{score}'}/{attack}/{seed}"


def _command(args: argparse.Namespace) -> str:
    return (
        f"adloco-sim --peers {args.peers} --rounds {args.rounds} --threads 1 --seed S --aggregate G"
        f" --score SC --hostile {args.hostile} --attack A"
    )


def score_cost(score: str, *, peers: int, rounds: int) -> dict[str, float]:
    """A clean in-process run of `rounds` rounds with `score` on (the grid's settings, one thread):
    the sequences the scorer ran forward and its wall time, against the sequences the peers trained
    on and the run's wall time."""
    torch.set_num_threads(1)
    # --out is required by the parser; this run writes nothing.
    argv = ["--peers", str(peers), "--rounds", str(rounds), "--score", score, "--out", "unused"]
    cfg = config_from_args(build_parser().parse_args(argv))
    corpus, tokenizer = load_data(cfg.train)
    sim = Simulator(cfg, corpus, vocab_size=tokenizer.vocab_size)
    started = time.perf_counter()
    records = sim.run()
    wall = time.perf_counter() - started
    trained = sum(r.tokens for r in records) / cfg.train.seq_len
    assert sim.scorer is not None  # --score is on
    stats = sim.scorer.stats
    return {
        "rounds": rounds,
        "contributions_judged": stats.judged,
        "contributions_excluded": stats.excluded,
        "scored_sequences_per_round": stats.sequences / rounds,
        "trained_sequences_per_round": trained / rounds,
        "score_s_per_round": stats.seconds / rounds,
        "round_wall_s": wall / rounds,
        "score_share_of_wall": stats.seconds / wall,
    }


if __name__ == "__main__":
    main()
