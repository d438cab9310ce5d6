"""The inner AdamW step at GPT-2 124M: PyTorch's CPU default against its fused kernel.

Per setting, in a fresh process: the GPT-2 124M config's parameters with random gradients, one
warm-up step (it allocates the two moments), then `--steps` timed steps; it prints the median step
time and the resident memory the steps add above the state (VmRSS sampled every millisecond by a
thread, against the level before the first timed step). Settings alternate process by process. From
the repository root (about 1 min):

    python bench/adamw.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "adamw.json"
SETTINGS = {"default": {}, "fused": {"fused": True}}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(setting: str, steps: int) -> None:
    import torch

    from adloco.node.model.model import build_model

    sys.path.insert(0, str(HERE))
    from memory import GPT2_124M

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        model = build_model(str(config), vocab_size=GPT2_124M["vocab_size"])
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, **SETTINGS[setting])
    optimizer.step()
    base, peak, done = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    done.set()
    sampler.join()
    print(json.dumps({"step_s": statistics.median(times), "extra_mib": peak[0] - base}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name in SETTINGS:
            cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    summary = {}
    for name, results in runs.items():
        step_ms = statistics.median(r["step_s"] for r in results) * 1e3
        extra = statistics.median(r["extra_mib"] for r in results)
        summary[name] = {"median_step_ms": step_ms, "median_extra_mib": extra}
        n = len(results)
        print(f"{name:8s} step {step_ms:7.1f} ms (median of {n})   above the state {extra:6.1f} MiB")
    ratio = summary["default"]["median_step_ms"] / summary["fused"]["median_step_ms"]
    print(f"fused is {ratio:.1f}x faster")
    config = "GPT-2 124M, fp32, OMP_NUM_THREADS=" + env["OMP_NUM_THREADS"]
    doc = {"config": config, "runs": runs, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
