"""Step time against batch size (issue 27 §3): the compute model the simulator takes from a device.

One instance's inner step as the node runs it (the model's layers compiled unless `--compile off`,
the fused loss head `causal_lm_loss`, backward, `clip_grad_norm_`, fused AdamW, bf16 autocast on a
GPU), on random tokens, for each batch size in `--batch-sizes` from the smallest up, one model for
all: after two warm-up steps at each size (the compile of a new shape included), `--steps` steps
are timed with the device synchronized at both ends. A size that runs out of device memory ends the
curve. A GPU's step time grows far less than linearly in the batch until the device is full; a
CPU's nearly linearly: the simulator's compute model reads this curve instead of assuming either.

    python bench/step_curve.py --model gpt2-124m --device cuda --out bench/results/step_curve_124m.json
    python bench/step_curve.py --model tiny-llama --seq-len 128 --batch-sizes 1,2,4,8   # CPU, ~1 min
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from adloco.node.model.devices import adamw, autocast
from adloco.node.model.loss import causal_lm_loss
from adloco.node.model.model import (
    build_model,
    compile_layers,
    count_parameters,
    peak_flops,
    train_flops_per_token,
)
from adloco.node.training.config import InnerConfig

try:  # imported by adloco-bench
    from .gpu import MODELS
except ImportError:  # run as a script: this folder is on sys.path
    from gpu import MODELS  # type: ignore[no-redef]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def curve(
    model_spec: str | None,
    *,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype | None,
    seq_len: int,
    batch_sizes: list[int],
    steps: int,
    compiled: bool,
) -> dict[str, Any]:
    """Seconds per inner step at each batch size (see the module docstring)."""
    model = build_model(model_spec, vocab_size=vocab, seed=0, max_seq_len=max(1024, seq_len))
    flops_per_token = train_flops_per_token(model, seq_len)
    params = count_parameters(model)
    model.to(device)
    model.train()
    if compiled:
        compile_layers(model)
    weights = [p for p in model.parameters() if p.requires_grad]
    inner = InnerConfig()
    opt = adamw(weights, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))
    gen = torch.Generator().manual_seed(0)

    def step(b: int) -> None:
        opt.zero_grad(set_to_none=True)
        batch = torch.randint(0, vocab, (b, seq_len), generator=gen).to(device, non_blocking=True)
        with autocast(device, dtype):
            loss = causal_lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, inner.grad_clip)
        opt.step()

    points: list[dict[str, Any]] = []
    for b in sorted(batch_sizes):
        try:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(2):
                step(b)
            _sync(device)
            warmup = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(steps):
                step(b)
            _sync(device)
            per_step = (time.perf_counter() - t0) / steps
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            print(f"  batch {b}: out of device memory, curve ends")
            break
        point = {
            "batch": b,
            "step_s": per_step,
            "tokens_per_s": b * seq_len / per_step,
            "warmup_s": warmup,
        }
        peak = peak_flops(device)
        if peak is not None:
            point["mfu"] = point["tokens_per_s"] * flops_per_token / peak
        if device.type == "cuda":
            point["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        points.append(point)
        print(
            f"  batch {b}: {1e3 * per_step:.1f} ms/step, {point['tokens_per_s']:,.0f} tok/s"
            + (f", MFU {100 * point['mfu']:.1f} %" if "mfu" in point else "")
            + f" (warm-up {warmup:.1f} s)",
            flush=True,
        )
    return {"params": params, "train_flops_per_token": flops_per_token, "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help=f"{', '.join(MODELS)} or a preset/config path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", choices=("on", "off"), default="on")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/step_curve.py: --device cuda, but torch sees no CUDA device here")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        sys.exit(f"bench/step_curve.py: --batch-sizes: comma-separated integers, got {args.batch_sizes!r}")
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    with tempfile.TemporaryDirectory(prefix="adloco-curve-") as tmp:
        spec, vocab = args.model, 256
        if args.model in MODELS:
            path = Path(tmp) / f"{args.model}.json"
            path.write_text(json.dumps(MODELS[args.model]))
            spec, vocab = str(path), int(MODELS[args.model]["vocab_size"])
        print(f"{args.model} on {args.device}, seq {args.seq_len}, compile {args.compile}:", flush=True)
        result = curve(
            spec,
            vocab=vocab,
            device=device,
            dtype=torch.bfloat16 if bf16 else None,
            seq_len=args.seq_len,
            batch_sizes=sizes,
            steps=args.steps,
            compiled=args.compile == "on",
        )
    result.update(
        model=args.model,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        precision="bf16" if bf16 else "fp32",
        seq_len=args.seq_len,
        compile=args.compile,
        torch=torch.__version__,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
