"""What θ and the outer momentum in mapped files cost a round (record 082): GPT-2 124M's shapes.

A networked node keeps θ and m in unnamed files mapped into memory (`Peer.keep_state_on_disk`) and
hands their pages back to the system after every inner step and every tensor of an outer step.
This times, side by side on the same shapes (148 tensors, 124.4M values, float32), median of
`--repeats` alternating runs of each:

- `outer step`: the round's outer step (Nesterov, tensor by tensor) with θ and m in memory, and
  mapped with each tensor released after its step (the pages come back from the page cache);
- `read θ`: Δ = θ − w of every tensor (a round's end reads θ), in memory and mapped;
- `release, idle`: one `release` of both mappings when nothing was touched (what every inner step
  pays);

and the bytes the mapped outer step dirtied from clean pages (the kernel's write accounting for
this process, /proc/self/io, after a flush as the system's writeback does in rounds longer than its
30 s expiry): what goes to the disk once a round. From the repository root:

    python -m adloco.bench.mapped_state [--repeats 5] [--dir FOLDER] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adloco.node.data.spill import MappedTensors
from adloco.protocol.algorithms.outer import OuterConfig, outer_step

from .verify_cost import gpt2_shapes

RESULTS = Path(__file__).resolve().parent / "results" / "mapped_state.json"


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="the folder of the mapped files (default: temporary)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = list(gpt2_shapes().values())
    g = torch.Generator().manual_seed(0)
    theta = [torch.randn(*s, generator=g) for s in shapes]
    momentum = [torch.zeros(*s) for s in shapes]
    delta = [torch.randn(*s, generator=g) * 1e-3 for s in shapes]
    weights = [t.clone() for t in theta]
    mapped_theta, mapped_m = list(theta), list(momentum)
    stores = [MappedTensors(mapped_theta, args.dir), MappedTensors(mapped_m, args.dir)]
    for store, tensors in zip(stores, (mapped_theta, mapped_m), strict=True):
        store.take(tensors)
    cfg = OuterConfig()

    def outer(th: list[torch.Tensor], m: list[torch.Tensor], release: bool) -> None:
        for i, (t, mm, d) in enumerate(zip(th, m, delta, strict=True)):
            outer_step([t], [mm], [d], cfg)
            if release:
                for store in stores:
                    store.release(i)

    def read(th: list[torch.Tensor], release: bool) -> None:
        for t, w in zip(th, weights, strict=True):
            del_ = t - w
            del del_
        if release:
            stores[0].release()

    def idle() -> None:
        for store in stores:
            store.release()

    times: dict[str, dict[str, list[float]]] = {
        "outer step": {"memory": [], "mapped": []},
        "read θ": {"memory": [], "mapped": []},
        "release, idle": {"mapped": []},
    }
    dirtied = []
    for _ in range(args.repeats):
        times["outer step"]["memory"].append(_timed(lambda: outer(theta, momentum, False)))
        for store in stores:
            store.flush()  # as the system's writeback does between rounds longer than its expiry
        before = _written()
        times["outer step"]["mapped"].append(_timed(lambda: outer(mapped_theta, mapped_m, True)))
        dirtied.append(_written() - before)
        times["read θ"]["memory"].append(_timed(lambda: read(theta, False)))
        times["read θ"]["mapped"].append(_timed(lambda: read(mapped_theta, True)))
        times["release, idle"]["mapped"].append(_timed(idle))
    values = sum(t.numel() for t in theta)
    summary = {
        what: {where: statistics.median(runs) for where, runs in by.items()} for what, by in times.items()
    }
    for what, by in summary.items():
        line = ", ".join(f"{where} {s * 1e3:.1f} ms" for where, s in by.items())
        if "memory" in by:
            line += f" (mapped / memory {by['mapped'] / by['memory']:.2f})"
        print(f"{what:14s} {line}")
    mib, per_value = statistics.median(dirtied) / 2**20, statistics.median(dirtied) / values
    print(f"dirtied by a mapped outer step: {mib:.0f} MiB ({per_value:.1f} B/param)")
    result = {
        "command": f"python -m adloco.bench.mapped_state --repeats {args.repeats}",
        "values": values,
        "repeats": args.repeats,
        "median_s": summary,
        "runs_s": times,
        "dirtied_bytes": dirtied,
        "torch_threads": 1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
