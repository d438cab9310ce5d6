"""Allocator settings against memory and speed: a 124M training step's time and a solo node's peak.

glibc keeps freed heap blocks resident (3.6 B/param at GPT-2 124M, docs/experiments.md); mapping every
block of 128 KiB or more instead returns them but faults each one in afresh (38 % slower steps).
This benchmark runs, per setting of the environment, in fresh processes:

- step: the GPT-2 124M config, batch 3 x 128 tokens, forward + backward + clip + AdamW, one warm-up
  step then `--steps` timed ones (median), settings interleaved run by run so that a busy machine
  slows them alike;
- peak: `bench/memory.py --modes solo` (the node, 2 rounds) with the same environment.

From the repository root (about 2 min per setting and repeat):

    python bench/allocator.py --repeats 2
    python bench/allocator.py --settings default,thp --repeats 3 --no-peak
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "allocator.json"
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
    "mmap128k+thp": {"MALLOC_MMAP_THRESHOLD_": "131072", "THP_MEM_ALLOC_ENABLE": "1"},
    "mmap128k+hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=131072"},
    "arena1": {"MALLOC_ARENA_MAX": "1"},
}
# Variables that change how memory is allocated, cleared from the inherited environment.
ALLOCATOR_VARS = ("MALLOC_", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")


def child_step(steps: int) -> None:
    """Time training steps of the 124M config in this process; print one JSON line."""
    import torch

    from adloco.node.model.model import build_model

    sys.path.insert(0, str(HERE))
    from memory import GPT2_124M

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        model = build_model(str(config), vocab_size=GPT2_124M["vocab_size"])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, GPT2_124M["vocab_size"], (3, 128))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": times[1:]}))


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ALLOCATOR_VARS)}
    env.setdefault("OMP_NUM_THREADS", "2")
    return {**env, **SETTINGS[setting]}


def step_times(setting: str, steps: int) -> list[float]:
    cmd = [sys.executable, __file__, "--child-step", str(steps)]
    out = subprocess.run(cmd, env=_env(setting), check=True, capture_output=True, text=True).stdout
    times: list[float] = json.loads(out.strip().splitlines()[-1])["step_s"]
    return times


def solo_peak(setting: str) -> float:
    """Bytes per parameter at the peak of one solo node run (bench/memory.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory.json"
        cmd = [sys.executable, str(HERE / "memory.py"), "--modes", "solo", "--out", str(out)]
        subprocess.run(cmd, env=_env(setting), check=True, capture_output=True, text=True)
        bpp: float = json.loads(out.read_text())["solo"]["bytes_per_param"]
    return bpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of {list(SETTINGS)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per process")
    ap.add_argument("--no-peak", action="store_true", help="time steps only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child-step", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_step is not None:
        child_step(args.child_step)
        return
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        ap.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    steps: dict[str, list[float]] = {s: [] for s in settings}
    peaks: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.repeats):
        for s in settings:  # interleaved: a slower stretch of the machine hits every setting
            run = step_times(s, args.steps)
            steps[s].append(statistics.median(run))
            if not args.no_peak:
                peaks[s].append(solo_peak(s))
            print(f"repeat {r}: {s}: step {steps[s][-1]:.2f} s" + (
                f", solo peak {peaks[s][-1]:.1f} B/param" if peaks[s] else ""), flush=True)  # fmt: skip
    base = statistics.median(steps[settings[0]])
    result = {
        "settings": {s: SETTINGS[s] for s in settings},
        "step": "GPT-2 124M config, batch 3x128, fwd (transformers' own loss)+bwd+clip+AdamW, fp32,"
        " OMP_NUM_THREADS=2",
        "step_s": steps,
        "solo_peak_bytes_per_param": peaks,
    }
    print(f"\n{'setting':<18} {'step (median)':>14} {'vs ' + settings[0]:>12} {'solo peak B/param':>18}")
    for s in settings:
        step = statistics.median(steps[s])
        peak = f"{statistics.median(peaks[s]):.1f}" if peaks[s] else "-"
        print(f"{s:<18} {step:>12.2f} s {step / base:>11.2f}x {peak:>18}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
