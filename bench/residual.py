"""The error-feedback residual's storage against the validation loss: simulator runs side by side.

For each codec, seed and residual dtype, one `adloco-sim` run (4 peers, 20 rounds, the embedded
corpus); prints the median final validation loss per (codec, dtype) over the seeds with its range,
and the difference of each dtype's median from bf16's (the default before int8 storage). Every
figure is measured when the script runs. From the repository root (~2 min a run on one core; runs
go two at a time):

    python bench/residual.py                                # int8, int4, lowrank:2 x bf16, int8 x 3 seeds
    python bench/residual.py --codecs int8 --dtypes float32,bfloat16,int8 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from simgrid import sim_curves

RESULTS = Path(__file__).resolve().parent / "results" / "residual.json"
SIM = ["--peers", "4", "--rounds", "20"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="int8,int4,lowrank:2")
    ap.add_argument("--dtypes", default="bfloat16,int8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    codecs, dtypes = args.codecs.split(","), args.dtypes.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [(c, d, s) for c in codecs for d in dtypes for s in seeds]
    curves = sim_curves(
        [[*SIM, "--codec", c, "--residual-dtype", d, "--seed", str(s)] for c, d, s in runs], jobs=args.jobs
    )
    by_run = {f"{c}-{d}-{s}": curve for (c, d, s), curve in zip(runs, curves, strict=True)}
    summary: dict[str, dict[str, object]] = {}
    for codec in codecs:
        for dtype in dtypes:
            final = [by_run[f"{codec}-{dtype}-{s}"][-1] for s in seeds]
            summary[f"{codec}/{dtype}"] = {"median": statistics.median(final), "final": final}
        base = summary[f"{codec}/{dtypes[0]}"]["median"]
        for dtype in dtypes:
            entry = summary[f"{codec}/{dtype}"]
            assert isinstance(base, float) and isinstance(entry["median"], float)
            entry["minus_first"] = entry["median"] - base
            final = entry["final"]
            assert isinstance(final, list)
            print(
                f"{codec:10s} {dtype:9s} final val {entry['median']:.4f} (median of {len(seeds)},"
                f" {min(final):.4f}-{max(final):.4f}); {entry['minus_first']:+.4f} against {dtypes[0]}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = f"adloco-sim {' '.join(SIM)} --threads 1 --codec C --residual-dtype D --seed S --out DIR"
    result = {"command": command, "summary": summary, "val_loss_by_run": by_run}
    args.out.write_text(json.dumps(result) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
