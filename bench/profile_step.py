"""Where an inner step's time goes (issue 27 §1): ms per step of the step's variants, and a profile.

Variants, each on its own copy of the same model, random tokens, bf16 autocast, fused AdamW and
`clip_grad_norm_` as the node's step, after warm-up steps (the compile included):
- node: the model's layers compiled (`compile_layers`), the fused loss head (`causal_lm_loss`);
- node_hf_loss: the layers compiled, transformers' own loss (`model(labels=...)`);
- whole_compiled: `torch.compile(model)` with transformers' loss (a user's compiled loop);
- eager: nothing compiled, the fused loss head.
Then `torch.profiler` over a few steps of the node variant: the top operators by device time and by
host time, to stdout.

    python bench/profile_step.py --model gpt2-124m --batch-size 8        # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adloco.node.model.devices import adamw, autocast
from adloco.node.model.loss import causal_lm_loss
from adloco.node.model.model import build_model, compile_layers

try:  # imported by adloco-bench
    from .gpu import MODELS
except ImportError:  # run as a script: this folder is on sys.path
    from gpu import MODELS  # type: ignore[no-redef]


def make_step(
    model: torch.nn.Module, variant: str, vocab: int, device: torch.device, seq_len: int
) -> Callable[[int], None]:
    """One inner step of `variant` on `model` (see the module docstring)."""
    forward: Any = model
    if variant in ("node", "node_hf_loss"):
        compile_layers(model)
    elif variant == "whole_compiled":
        forward = torch.compile(model)
    weights = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(weights, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    hf_loss = variant in ("node_hf_loss", "whole_compiled")

    def step(b: int) -> None:
        opt.zero_grad(set_to_none=True)
        x = torch.randint(0, vocab, (b, seq_len), generator=gen).to(device, non_blocking=True)
        with autocast(device, torch.bfloat16 if device.type == "cuda" else None):
            loss = forward(input_ids=x, labels=x).loss if hf_loss else causal_lm_loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="node,node_hf_loss,whole_compiled,eager")
    ap.add_argument("--profile-steps", type=int, default=3, help="0: no profile")
    ap.add_argument("--profile-variant", default="node")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        spec, vocab = args.model, 256
        if args.model in MODELS:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(MODELS[args.model]))
            spec, vocab = str(path), int(MODELS[args.model]["vocab_size"])
        base = build_model(spec, vocab_size=vocab, seed=0, max_seq_len=max(1024, args.seq_len))
    import copy

    steps: dict[str, Callable[[int], None]] = {}
    for variant in args.variants.split(","):
        model = copy.deepcopy(base).to(device).train()
        steps[variant] = make_step(model, variant, vocab, device, args.seq_len)
        t0 = time.perf_counter()
        for _ in range(3):
            steps[variant](args.batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{variant}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.reps):
        for variant, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(args.batch_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[variant].append(1e3 * (time.perf_counter() - t0) / args.steps)
    med = {v: statistics.median(t) for v, t in times.items()}
    for v, ms in med.items():
        print(f"{v}: {ms:.1f} ms/step, {args.batch_size * args.seq_len / ms * 1e3:,.0f} tok/s", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"batch": args.batch_size, "ms_per_step": med, "runs": times}, indent=1)
        )
    profiled = args.profile_variant
    if args.profile_steps and profiled in steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                steps[profiled](args.batch_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
        avg = prof.key_averages()
        key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        print(avg.table(sort_by=key, row_limit=30, max_name_column_width=60), flush=True)
        print(avg.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
