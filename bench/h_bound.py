"""How large an H this scale tolerates (issue 27 §3): val loss at a fixed token budget against H.

`--inner-steps-policy hide_comm` lengthens the round until the exchange hides behind it, up to
`--max-inner-steps`. That cap was 500 (DiLoCo's own H, cited, for a 150M model on C4); this measures
the bound instead (the cap is now its result, 200) on what the simulator trains here: the same 4
peers, seq 64, batch 8, one instance, no batch test as bench/hide_comm.py, with the int8 codec, no
overlap and a fast link, so that only H changes. Every run stops at the same token budget; reported
per H: the outer steps it took and the val loss of the model that exists at the budget, median over
the seeds, and its ratio to H = 10's (today's default). The largest H within 2 % and within 5 % of
H = 10's loss are the bounds this scale tolerates at that budget.

    python bench/h_bound.py --seeds 0,1 --out bench/results/h_bound.json   # 39 min here
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from adloco.bench.simruns import run_sim, set_threads, sim_config
from adloco.node.training.runtime import load_data

COMMON = (
    *("--peers", "4", "--seq-len", "64", "--batch-size", "8", "--b-max", "8", "--instances", "1"),
    *("--batch-test", "none", "--overlap", "off", "--codec", "int8", "--bandwidth-mbps", "1000", "--quiet"),
)
STEPS = (10, 25, 50, 100, 200, 500)


def run(*, tokens: int, seeds: list[int], steps: list[int], out: Path | None) -> dict[str, Any]:
    set_threads(1)
    t0 = time.perf_counter()
    base = sim_config([*COMMON, "--inner-steps", "10"], seed=seeds[0])
    corpus, tokenizer = load_data(base.train)
    rows: list[dict[str, Any]] = []
    for h in steps:
        argv = [*COMMON, "--inner-steps", str(h), "--max-inner-steps", str(max(h, 10))]
        runs = []
        for seed in seeds:
            sim = run_sim(
                f"H={h}",
                sim_config(argv, seed=seed),
                corpus,
                tokenizer.vocab_size,
                stop=lambda records: records[-1].tokens_total >= tokens,
            )
            runs.append(
                {
                    "seed": seed,
                    "rounds": len(sim.records),
                    "tokens": sim.records[-1].tokens_total,
                    "val_loss": sim.val_at("tokens_total", tokens),
                    "final_val_loss": sim.records[-1].val_loss,
                    "wall_s": sim.wall_s,
                }
            )
        row = {
            "inner_steps": h,
            "argv": argv,
            "runs": runs,
            "val_loss_median": statistics.median(r["val_loss"] for r in runs),
            "rounds_median": statistics.median(r["rounds"] for r in runs),
        }
        rows.append(row)
        losses = ", ".join(f"{r['val_loss']:.4f}" for r in runs)
        print(
            f"H {h}: {row['rounds_median']:g} outer steps, val {row['val_loss_median']:.4f} at"
            f" {tokens:,} tokens (seeds: {losses})",
            flush=True,
        )
    reference = next(r["val_loss_median"] for r in rows if r["inner_steps"] == 10)
    for row in rows:
        row["ratio_to_h10"] = row["val_loss_median"] / reference
    bounds = {
        f"within_{pct}_percent": max(
            (r["inner_steps"] for r in rows if r["ratio_to_h10"] <= 1 + pct / 100), default=None
        )
        for pct in (2, 5)
    }
    for row in rows:
        print(f"H {row['inner_steps']}: {row['ratio_to_h10']:.3f} × H = 10's loss")
    print(
        f"largest H within 2 % of H = 10's loss: {bounds['within_2_percent']};"
        f" within 5 %: {bounds['within_5_percent']}"
    )
    result = {
        "rows": rows,
        "tokens": tokens,
        "seeds": seeds,
        "bounds": bounds,
        "common_argv": list(COMMON),
        "duration_s": time.perf_counter() - t0,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4 * 8 * 64 * 1000, help="the token budget of every run")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", default=",".join(map(str, STEPS)))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    run(
        tokens=args.tokens,
        seeds=[int(s) for s in args.seeds.split(",")],
        steps=[int(h) for h in args.steps.split(",")],
        out=args.out,
    )


if __name__ == "__main__":
    main()
