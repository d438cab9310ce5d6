"""A 124M node's MIT instances on one device or on two (issue 27 §2), measured on this machine's CPU.

    python bench/multidevice.py [--rounds 3] [--out bench/results/multidevice_124m.json]
    python bench/multidevice.py --data-parallel [--rounds 3]   # bench/results/dataparallel_124m.json
    python bench/multidevice.py --data-parallel --shard        # bench/results/dataparallel_sharded_124m.json

Runs `adloco-node --offline` with the GPT-2 124M config and two MIT instances kept apart (no
merge), seq 128, batch 2, 2 inner steps, in three ways:
- `--device cpu --threads 2`: both instances in the node, in turn, on both cores (today's node);
- `--device cpu --threads 1`: the same on one core;
- `--device cpu,cpu --threads 1`: the second instance in a worker process, the "second device",
  each process on one core.
No GPU here, so the CPU stands in for two devices, and the two-process run shows what the
cross-process path costs and gains at this size (θ into the worker at each round start and Δ back
at its end, 0.5 GB each way through shared memory), not a GPU's speed. Reported per run: the θ
hash of every round (one device and two, with one thread per process, must agree bit for bit: the
same instances on the same data and kernels), the median round time and tokens/s over the
instances' compute time from the node's own round lines, and the peak resident memory (VmHWM) of
the node and of its worker.

With `--data-parallel`: one instance (batch 4), so that on `cpu,cpu` the worker's device holds a
replica and each device trains two of every step's four rows, the gradients summed through gloo
before the step (`training.parallel`). Its θ is one device's up to float rounding, not bit for bit
(each step's rows are split between two matrix products). With `--shard` also: the same two devices
with the layers sharded over them (`--data-parallel shard`, record 084), and no two-thread run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memory import GPT2_124M, make_tokenizer

RESULTS = Path(__file__).resolve().parent / "results" / "multidevice_124m.json"
ROUND = re.compile(r"\[local round=(\d+)\].* (\d+) tok/s .* (\d+(?:\.\d+)?)s \(waited .*θ=([0-9a-f]+)")
RUNS = {
    "one device, 2 threads": ["--device", "cpu", "--threads", "2"],
    "one device, 1 thread": ["--device", "cpu", "--threads", "1"],
    "two devices (cpu,cpu), 1 thread each": ["--device", "cpu,cpu", "--threads", "1"],
}
SHARDED = "two devices (cpu,cpu), 1 thread each, layers sharded"


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _workers(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    except OSError:
        return []


def run(
    flags: list[str], *, config: Path, tokenizer: Path, rounds: int, cwd: Path, instances: int = 2
) -> dict[str, object]:
    batch = "2" if instances == 2 else "4"
    cmd = [
        sys.executable, "-m", "adloco.node.cli.node", "--offline", "--model", str(config),
        "--tokenizer", str(tokenizer), "--seq-len", "128", "--batch-size", batch, "--inner-steps", "2",
        "--instances", str(instances), "--min-instances", str(instances), "--rounds", str(rounds), *flags,
    ]  # fmt: skip
    t0 = time.monotonic()
    node = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    peaks: dict[int, int] = {}
    while node.poll() is None:
        for pid in [node.pid, *_workers(node.pid)]:
            peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
        time.sleep(0.2)
    out, err = node.communicate()
    if node.returncode != 0:
        raise SystemExit(f"{' '.join(flags)}: exit {node.returncode}\n{err[-2000:]}")
    lines = [ROUND.search(line) for line in out.splitlines()]
    found = [m for m in lines if m is not None]
    node_peak = peaks.pop(node.pid, 0)
    return {
        "flags": flags,
        "wall_s": round(time.monotonic() - t0, 1),
        "round_s": [float(m.group(3)) for m in found],
        "median_round_s": statistics.median(float(m.group(3)) for m in found),
        # Tokens over the instances' compute time (the busiest device's), without evaluation.
        "median_tokens_per_s": statistics.median(int(m.group(2)) for m in found),
        "theta": [m.group(4) for m in found],
        "node_peak_gib": round(node_peak / 2**30, 3),
        "worker_peak_gib": [round(v / 2**30, 3) for v in peaks.values()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--data-parallel", action="store_true", help="one instance, a replica on cpu,cpu")
    ap.add_argument("--shard", action="store_true", help="with --data-parallel: also the layers sharded")
    args = ap.parse_args()
    instances = 1 if args.data_parallel else 2
    out = args.out or (RESULTS.with_name("dataparallel_124m.json") if args.data_parallel else RESULTS)
    runs_to_time = dict(RUNS)
    if args.data_parallel and args.shard:
        out = args.out or RESULTS.with_name("dataparallel_sharded_124m.json")
        del runs_to_time["one device, 2 threads"]
        runs_to_time[SHARDED] = [*RUNS["two devices (cpu,cpu), 1 thread each"], "--data-parallel", "shard"]
    with tempfile.TemporaryDirectory(prefix="adloco-multidevice-") as tmp:
        work = Path(tmp)
        config = work / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        tokenizer = make_tokenizer(work)
        runs = {}
        for name, flags in runs_to_time.items():
            runs[name] = run(
                flags, config=config, tokenizer=tokenizer, rounds=args.rounds, cwd=work, instances=instances
            )
            print(f"{name}: {json.dumps(runs[name])}", flush=True)
    # One thread per process in both: the same kernels, so the same θ bit for bit (two threads
    # split the reductions otherwise, and their θ differs in the last bits).
    one, two = runs["one device, 1 thread"], runs["two devices (cpu,cpu), 1 thread each"]
    agree = one["theta"] == two["theta"]
    result = {
        "rounds": args.rounds,
        "instances": instances,
        "runs": runs,
        "theta_agree_one_and_two_devices": agree,
    }
    print(f"θ of one device and of two, one thread each, agrees in every round: {agree}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
