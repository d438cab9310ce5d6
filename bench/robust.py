"""Hostile peers in the simulator against the owners' aggregation rules (issue 10 §3).

For each aggregation rule (`--aggregate`) and attack (`adloco-sim --attack`, sent by the last
`--hostile` of the peers), one `adloco-sim` run on the embedded corpus; prints the final validation
loss of θ (which every member holds, hostile ones included) and its gap to the clean run under
the plain mean, so both what each attack does and what each defence costs in a clean run show.
Every figure is measured when the script runs. From the repository root:

    python bench/robust.py                         # 16 peers, 3 hostile, 10 rounds: 15 runs
    python bench/robust.py --peers 4 --hostile 1 --rounds 20 --attacks none,random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simgrid import sim_curves

RESULTS = Path(__file__).resolve().parent / "results" / "robust.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--hostile", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--aggregates", default="mean,trimmed:0.2,clip:1")
    ap.add_argument("--attacks", default="none,flip1000,flip,random,constant")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    aggregates, attacks = args.aggregates.split(","), args.attacks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [(g, a, s) for g in aggregates for a in attacks for s in seeds]
    common = ["--peers", str(args.peers), "--rounds", str(args.rounds)]
    curves = sim_curves(
        [
            [*common, "--seed", str(s), "--aggregate", g]
            + (["--hostile", str(args.hostile), "--attack", a] if a != "none" else [])
            for g, a, s in runs
        ],
        jobs=args.jobs,
    )
    by_run = {f"{g}/{a}/{s}": c for (g, a, s), c in zip(runs, curves, strict=True)}
    final = {key: curve[-1] for key, curve in by_run.items()}
    summary: dict[str, dict[str, float]] = {}
    for s in seeds:
        clean = final[f"mean/none/{s}"]
        for g in aggregates:
            for a in attacks:
                loss = final[f"{g}/{a}/{s}"]
                summary[f"{g}/{a}/{s}"] = {"val_loss": loss, "gap_pct": 100 * (loss - clean) / clean}
                print(f"seed {s} {g:12s} {a:9s} final val {loss:.4f} ({100 * (loss - clean) / clean:+.1f} %"
                      " against the clean mean)", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = (
        f"adloco-sim --peers {args.peers} --rounds {args.rounds} --threads 1 --seed S --aggregate G"
        f" --hostile {args.hostile} --attack A"
    )
    args.out.write_text(
        json.dumps({"command": command, "summary": summary, "val_loss_by_run": by_run}) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
