"""`adloco-sim`: run N virtual peers in one process and write results.json and plots.

    adloco-sim --peers 4 --rounds 20 --out runs/sim
    adloco-sim --peers 5 --mode async --slowdown 1,1,1,1,5 --codec int4 --out runs/async

DIR/results.json is a list of per-round records (see `RoundRecord`); DIR/run.json holds the
configuration, the initial validation loss and timings; DIR/*.png plot validation loss against
tokens, simulated time and wire bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ...errors import UserError
from ..sim.compute import StepCurve
from ..sim.engine import ATTACKS, SimConfig, Simulator, records_as_dicts
from ..sim.plots import plot_runs
from ..training.rounds import RoundRecord, format_round
from ..training.runtime import load_data
from .options import (
    add_train_arguments,
    config_error,
    finite_float,
    set_threads,
    train_config_from_args,
)

logger = logging.getLogger("adloco.sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-sim",
        description="In-process simulator: N virtual peers running the real protocol in memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--peers", type=int, default=4, help="number of virtual peers")
    run.add_argument("--rounds", type=int, default=20, help="rounds to apply")
    run.add_argument("--out", type=Path, required=True, help="output folder for results.json and plots")
    run.add_argument("--mode", choices=("sync", "async"), default="sync", help="sync DiLoCo or async rounds")
    run.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all CPUs)")
    run.add_argument("--quiet", action="store_true", help="no per-round lines")

    add_train_arguments(p)

    sim = p.add_argument_group("simulated swarm: heterogeneity and links")
    sim.add_argument("--bandwidth-mbps", type=finite_float, default=20.0, help="each peer's link")
    sim.add_argument("--latency-s", type=finite_float, default=0.05, help="one-way latency per phase")
    sim.add_argument("--slowdown", default="1", help="comma-separated per-peer step-time factors, cycled")
    sim.add_argument("--sec-per-sample", type=finite_float, default=0.004, help="modelled compute per sample")
    sim.add_argument(
        "--step-curve",
        type=Path,
        default=None,
        help="a measured step time per batch size (bench/step_curve.py's JSON) instead of --sec-per-sample",
    )
    sim.add_argument(
        "--window-s", type=finite_float, default=None, help="async matchmaking window (sim seconds)"
    )
    hostile = p.add_argument_group("hostile peers")
    hostile.add_argument("--hostile", type=int, default=0, help="how many peers attack (the last ones)")
    hostile.add_argument(
        "--attack",
        choices=ATTACKS,
        default="none",
        help="what they send: -1000 Δ, -Δ claiming the most weight allowed, a random or a fixed direction;"
        " stall: earn the work to own parts, then take them and never answer (sync mode)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the typed config; invalid combinations raise UserError naming the option."""
    try:
        slowdown = tuple(finite_float(x) for x in args.slowdown.split(","))
    except argparse.ArgumentTypeError:
        raise UserError(f"--slowdown: expected comma-separated numbers, got {args.slowdown!r}") from None
    # SimConfig does not check these; negative times would make rounds close before anyone is ready.
    for flag, value in (
        ("--sec-per-sample", args.sec_per_sample),
        ("--latency-s", args.latency_s),
        ("--window-s", args.window_s),
    ):
        if value is not None and value < 0:
            raise UserError(f"{flag}: must be >= 0, got {value}")
    train = train_config_from_args(args)
    if args.mode == "async" and args.outer_lr is None:
        # Async DiLoCo: stale pseudo-gradients need a smaller outer lr (0.07 vs 0.7 in the DeepMind toy).
        train = replace(train, outer=replace(train.outer, lr=train.outer.lr / 2))
    try:
        return SimConfig(
            peers=args.peers,
            rounds=args.rounds,
            mode=args.mode,
            train=train,
            slowdown=slowdown,
            sec_per_sample=args.sec_per_sample,
            step_curve=None if args.step_curve is None else StepCurve.load(args.step_curve),
            bandwidth_mbps=args.bandwidth_mbps,
            latency_s=args.latency_s,
            window_s=args.window_s,
            hostile=args.hostile,
            attack=args.attack,
        )
    except ValueError as e:
        raise config_error(e, args) from None


def run(cfg: SimConfig, out: Path, *, quiet: bool = False) -> list[RoundRecord]:
    """Run the simulation and write results.json, run.json and the plots into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus, tokenizer = load_data(cfg.train)
    sim = Simulator(cfg, corpus, vocab_size=tokenizer.vocab_size)
    initial = sim.peers[0].validation_loss()
    if not quiet:
        print(
            f"[sim] {cfg.peers} peers, {cfg.mode}, corpus {corpus.num_train_tokens / 1e6:.1f}M train tokens,"
            f" b_max={sim.peers[0].b_max}, initial val loss {initial:.3f}",
            flush=True,
        )
    records = sim.run(on_round=None if quiet else lambda r: print(format_round("sim", r), flush=True))
    (out / "results.json").write_text(json.dumps(records_as_dicts(records), indent=1))
    summary = {
        "config": asdict(cfg),
        "initial_val_loss": initial,
        "final_val_loss": records[-1].val_loss,
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "wall_s": time.perf_counter() - t0,
        "tries_lost": sim.tries_lost,  # to stallers (`--attack stall`)
        "stalled_s": sim.stalled_s,
    }
    (out / "run.json").write_text(json.dumps(summary, indent=1, default=str))
    plot_runs({cfg.mode: records_as_dicts(records)}, out, initial_loss=initial)
    if not quiet:
        print(
            f"[sim] done: val loss {initial:.3f} -> {records[-1].val_loss:.3f} in {summary['wall_s']:.0f}s;"
            f" wrote {out / 'results.json'}",
            flush=True,
        )
    return records


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        set_threads(args.threads)
        run(config_from_args(args), args.out, quiet=args.quiet)
    except UserError as e:
        print(f"adloco-sim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adloco-sim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
