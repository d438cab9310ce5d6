"""Rounds that stay compute-bound (issue 27 §3): H chosen to hide the exchange, against a fixed H = 10.

The simulator's peers compute at a step time measured on a GPU (`--step-curve`, bench/step_curve.py:
GPT-2 124M or a 1.1B Llama on an H200, seq 1024) and exchange over links of 10, 100 and 1000 Mbit/s,
with overlap (`--overlap auto`: the next local round runs during the exchange when it fits) and the
adaptive codec. Two policies at the same token budget:
- fixed: H = 10, today's default;
- hide_comm: H set each round so that H·t_step ≥ 1.25 × the exchange (`report.hiding_inner_steps`),
  within [10, 500] (500: DiLoCo's own H), the codec chosen for the longest round allowed.

The trained model is the simulator's small one (its loss is what can be afforded here); the time
model is the measured model's: each simulated sequence takes the curve's step time at its batch, and
the link is slowed by the measured model's parameters over the small one's, so an exchange takes as
long as the measured model's payload would (bytes per token are reported at the measured model's
size the same way). Reported per row: the median H and the codecs used, utilization (compute over
simulated time), bytes per token, the simulated time to the token budget and the val loss there.
Utilization is given over the whole run, after its first round, and from its third round on (the
steady state: every run starts at H = 10, and hide_comm's first long round still waits for the
first exchange, which no round before it could hide).

    python bench/hide_comm.py --out bench/results/hide_comm.json            # ~15 min here
    python bench/hide_comm.py --quick                                       # a tiny budget
    python bench/hide_comm.py --rederive bench/results/hide_comm_124m.json  # add the steady state
    python bench/hide_comm.py --at-equal-time bench/results/hide_comm_124m_1204.json

The token budget favours the fixed H (the same tokens, more outer steps); hide_comm's point is
tokens per second. `at_equal_time` (stored in a new result, printed for a stored one with
`--at-equal-time`) sets each hide_comm run's val loss against the fixed run's at the same simulated
time: the fixed run's last round completed by the time hide_comm's run ended.

`--rederive` adds the steady-state figure to results written before it was reported: a round's
compute is H steps at the curve's batch-8 step time in these runs (batch 8, b_max 8, no batch test),
checked against the stored whole-run utilization before anything is written.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from adloco.bench.simruns import SimRun, run_sim, set_threads, sim_config
from adloco.node.model.model import build_model, count_parameters
from adloco.node.training.runtime import load_data

RESULTS = Path(__file__).resolve().parent / "results"
CURVES = {
    "gpt2-124m": (RESULTS / "step_curve_124m_h200_1204.json", 124_439_808),
    "llama-1b": (RESULTS / "step_curve_1b_h200_1204.json", 1_103_812_608),
}
BANDWIDTHS = (10.0, 100.0, 1000.0)
COMMON = (
    *("--peers", "4", "--seq-len", "64", "--batch-size", "8", "--b-max", "8", "--instances", "1"),
    *("--batch-test", "none", "--overlap", "auto", "--codec", "adaptive", "--quiet"),
)
POLICIES = {
    "fixed": ("--inner-steps", "10"),
    "hide_comm": ("--inner-steps", "10", "--inner-steps-policy", "hide_comm", "--min-inner-steps", "10"),
}


def run(*, tokens: int, seed: int, models: list[str], out: Path | None) -> dict[str, Any]:
    set_threads(1)
    t0 = time.perf_counter()
    base = sim_config([*COMMON, *POLICIES["fixed"]], seed=seed)
    corpus, tokenizer = load_data(base.train)
    small = count_parameters(build_model(base.train.model, vocab_size=tokenizer.vocab_size))
    rows: list[dict[str, Any]] = []
    for model in models:
        curve_path, params = CURVES[model]
        scale = params / small
        for mbps in BANDWIDTHS:
            # The small model's payload over a link `scale` times slower takes the measured model's time.
            link = ("--bandwidth-mbps", repr(mbps / scale), "--step-curve", str(curve_path))
            for policy, args in POLICIES.items():
                argv = [*COMMON, *args, *link]
                cfg = sim_config(argv, seed=seed)
                sim: SimRun = run_sim(
                    policy,
                    cfg,
                    corpus,
                    tokenizer.vocab_size,
                    stop=lambda records: records[-1].tokens_total >= tokens,
                )
                rows.append(_row(model, mbps, policy, sim, scale=scale, argv=argv))
                r = rows[-1]
                print(
                    f"{model} {mbps:g} Mbit/s {policy}: H {r['inner_steps_median']:g},"
                    f" {'/'.join(r['codecs'])}, utilization {100 * r['utilization']:.1f} %"
                    f" ({100 * r['utilization_after_first_round']:.1f} % after the first round),"
                    f" {r['bytes_per_token']:.3g} B/token, {r['sim_time_s']:.0f} s to"
                    f" {r['tokens']:,} tokens, val {r['val_loss']:.3f} ({r['wall_s']:.0f} s wall)",
                    flush=True,
                )
    result = {
        "rows": rows,
        "at_equal_time": at_equal_time(rows),
        "tokens": tokens,
        "seed": seed,
        "small_model_params": small,
        "setup": {"common_argv": list(COMMON), "policies": {k: list(v) for k, v in POLICIES.items()}},
        "sim": {k: v for k, v in asdict(base).items() if k not in ("train", "step_curve")},
        "duration_s": time.perf_counter() - t0,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


def _row(
    model: str, mbps: float, policy: str, sim: SimRun, *, scale: float, argv: list[str]
) -> dict[str, Any]:
    records = sim.records
    last = records[-1]
    sim_time = float(last.sim_time_s or 0.0)
    compute = sum(r.compute_s for r in records)
    # After the first round, which every run starts at H = 10 and the fixed codec's first choice.
    later = records[1:]
    later_time = sim_time - float(records[0].sim_time_s or 0.0)
    steady = records[2:]
    steady_time = sim_time - float(records[1].sim_time_s or 0.0) if len(records) > 2 else 0.0
    return {
        "model": model,
        "bandwidth_mbps": mbps,
        "policy": policy,
        "rounds": len(records),
        "inner_steps": [r.inner_steps for r in records],
        "inner_steps_median": statistics.median(r.inner_steps for r in records),
        "codecs": sorted({r.codec for r in records}),
        "utilization": compute / sim_time if sim_time else 0.0,
        "utilization_after_first_round": sum(r.compute_s for r in later) / later_time if later_time else 0.0,
        "utilization_from_third_round": sum(r.compute_s for r in steady) / steady_time
        if steady_time
        else None,
        "bytes_per_token": last.bytes_sent * scale / max(last.tokens_total, 1),
        "sim_time_s": sim_time,
        "tokens": last.tokens_total,
        "val_loss": last.val_loss,
        "wall_s": sim.wall_s,
        "argv": argv,
        "curve": [
            {"round": r.round, "tokens": r.tokens_total, "sim_time_s": r.sim_time_s, "val_loss": r.val_loss}
            for r in records
        ],
        "initial_val_loss": sim.initial_val_loss,
    }


def at_equal_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each model and link: hide_comm's val loss at the end of its run against the fixed run's
    at the same simulated time (its last round completed by then), from the rows' curves."""
    out = []
    for hide in (r for r in rows if r["policy"] == "hide_comm"):
        fixed = next(
            r
            for r in rows
            if r["policy"] == "fixed"
            and (r["model"], r["bandwidth_mbps"]) == (hide["model"], hide["bandwidth_mbps"])
        )
        done = [point for point in fixed["curve"] if point["sim_time_s"] <= hide["sim_time_s"]]
        out.append(
            {
                "model": hide["model"],
                "bandwidth_mbps": hide["bandwidth_mbps"],
                "sim_time_s": hide["sim_time_s"],
                "hide_comm_val_loss": hide["val_loss"],
                "hide_comm_tokens": hide["tokens"],
                "fixed_val_loss": done[-1]["val_loss"] if done else fixed["initial_val_loss"],
                "fixed_tokens": done[-1]["tokens"] if done else 0,
            }
        )
    return out


def print_at_equal_time(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"{r['model']} {r['bandwidth_mbps']:g} Mbit/s, at {r['sim_time_s']:.0f} s: hide_comm val"
            f" {r['hide_comm_val_loss']:.3f} ({r['hide_comm_tokens']:,} tokens), fixed H = 10 val"
            f" {r['fixed_val_loss']:.3f} ({r['fixed_tokens']:,} tokens)"
        )


def rederive(path: Path) -> None:
    """Add `utilization_from_third_round` to the rows of a stored result (see the module's doc)."""
    result = json.loads(path.read_text())
    for row in result["rows"]:
        # The curve the run itself was timed with (its argv), not today's default for the model.
        argv = row["argv"] if isinstance(row["argv"], list) else ast.literal_eval(row["argv"])
        named = Path(argv[argv.index("--step-curve") + 1])
        curve = json.loads((RESULTS / named.name if not named.exists() else named).read_text())
        step_s = next(p["step_s"] for p in curve["points"] if p["batch"] == 8)
        compute = [h * step_s for h in row["inner_steps"]]
        ends = [0.0] + [float(r["sim_time_s"]) for r in row["curve"]]
        whole = sum(compute) / ends[-1]
        if abs(whole - row["utilization"]) > 1e-9 * max(1.0, whole):
            raise SystemExit(
                f"{row['model']} {row['bandwidth_mbps']} {row['policy']}: {whole} != {row['utilization']}"
            )
        steady = sum(compute[2:]) / (ends[-1] - ends[2]) if len(compute) > 2 else None
        row["utilization_from_third_round"] = steady
        print(
            f"{row['model']} {row['bandwidth_mbps']:g} Mbit/s {row['policy']}: utilization"
            f" {100 * whole:.1f} % (stored {100 * row['utilization']:.1f} %), from the third round"
            f" {'-' if steady is None else f'{100 * steady:.2f} %'}"
        )
    path.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny token budget")
    ap.add_argument("--tokens", type=int, default=4 * 8 * 64 * 1500, help="the token budget of every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="gpt2-124m,llama-1b")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rederive", type=Path, default=None, help="add the steady state to a stored result")
    ap.add_argument(
        "--at-equal-time", type=Path, default=None, help="print a stored result's comparison at equal time"
    )
    args = ap.parse_args()
    if args.rederive is not None:
        rederive(args.rederive)
        return
    if args.at_equal_time is not None:
        print_at_equal_time(at_equal_time(json.loads(args.at_equal_time.read_text())["rows"]))
        return
    tokens = 4 * 8 * 64 * 40 if args.quick else args.tokens
    print_at_equal_time(
        run(tokens=tokens, seed=args.seed, models=args.models.split(","), out=args.out)["at_equal_time"]
    )


if __name__ == "__main__":
    main()
