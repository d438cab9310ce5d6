"""GPU benchmark: tokens/s, peak device memory and the probed b_max of one instance on CUDA.

For the GPT-2 124M config and a ~1.1B Llama config (hidden 2048, 16 layers, GQA 32/8 heads, MLP
8192, vocabulary 32000, untied embeddings), each as one MIT instance of a real `Peer` on the first
CUDA device, with bf16 autocast and, optionally, activation checkpointing:

- b_max: what the peer's own probe finds (binary search over real steps, OOM as "does not fit"),
  and beside it the memory estimate's that decides when to shard the layers (`bmax.fitting_rows`
  on the same instance, run eager: record 084, "When the layers are sharded");
- tokens/s: training tokens of the measured rounds over their compute time (the instances' inner
  steps; the outer step, codec and evaluation are not in it), after one warm-up round;
- peak device memory: `torch.cuda.max_memory_allocated` over the measured rounds (what the caching
  allocator handed out; `nvidia-smi` shows more: the cache and the CUDA context);
- peak host memory: the process's VmHWM so far (θ, the outer momentum, Δ and the residual live
  there); it only grows, so run one model per call for a per-model figure.

The batch is fixed (no adaptive batch test) so rounds are comparable. From the repository root, on a
machine with CUDA (it exits with a message elsewhere):

    python bench/gpu.py                                   # both models, checkpointing off and on
    python bench/gpu.py --models gpt2-124m --checkpointing off --seq-len 512 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# Run as `python bench/gpu.py`, this folder is on sys.path: the 124M config is memory.py's own.
from memory import GPT2_124M

from adloco.node.model import bmax
from adloco.node.model.model import count_parameters
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import reduce_group

MODELS: dict[str, dict[str, Any]] = {
    "gpt2-124m": GPT2_124M,
    "llama-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 2048,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
}
RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"


def host_peak_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def one_round(peer: Peer) -> tuple[int, float]:
    """A solo round (train, contribute, outer step); its training tokens and compute seconds."""
    local = peer.train_round()
    contribution = peer.contribute(local)[0]
    assert contribution is not None
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))
    return local.tokens, local.compute_s


def measure(name: str, cfg: TrainConfig, corpus: Any, *, rounds: int) -> dict[str, Any]:
    """Build the peer (which probes b_max), warm up one round, measure `rounds` rounds."""
    vocab = int(MODELS[name]["vocab_size"])
    device = torch.device(cfg.device)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    peer = Peer(peer_id=name, index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=vocab)
    build_s = time.perf_counter() - t0
    # What the memory estimate that decides sharding (`bmax.fitting_rows`, record 084) says for the
    # same instance, against the search's b_max: eager (no compile within this part's time limit),
    # so its rows are fewer than a compiled model's.
    t0 = time.perf_counter()
    with torch.compiler.set_stance("force_eager"):
        rows = bmax.fitting_rows(
            peer.home_model,
            seq_len=cfg.seq_len,
            vocab_size=vocab,
            budget_bytes=bmax.memory_budget(device),
            state_on_device=False,
            autocast_dtype=peer.autocast_dtype,
        )
    estimate_s = time.perf_counter() - t0
    one_round(peer)  # warm-up: kernels chosen, AdamW state allocated
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens, compute_s = 0, 0.0
    for _ in range(rounds):
        t, s = one_round(peer)
        tokens, compute_s = tokens + t, compute_s + s
    params = count_parameters(peer.instances[0].model)
    peak = torch.cuda.max_memory_allocated(device)
    result = {
        "model": name,
        "params": params,
        "precision": cfg.precision,
        "autocast": str(peer.autocast_dtype),
        "activation_checkpointing": cfg.activation_checkpointing,
        "compiled": peer.compiled,
        "b_max": peer.b_max,
        "b_max_estimated_eager": bmax.b_max_of(rows),
        "estimate_s": estimate_s,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "inner_steps": cfg.inner_steps,
        "rounds": rounds,
        "tokens_per_s": tokens / compute_s,
        "peak_device_bytes": peak,
        "peak_device_bytes_per_param": peak / params,
        "peak_host_bytes": host_peak_bytes(),
        "build_and_probe_s": build_s,
        "theta_hash": peer.state.theta_hash(),
    }
    del peer
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--checkpointing", choices=("off", "on", "both"), default="both")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="bf16")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8, help="per instance, fixed")
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds, after one warm-up")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench/gpu.py: no CUDA device on this machine (torch.cuda.is_available() is False);"
            " run it on a machine with an NVIDIA GPU"
        )
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        sys.exit(f"bench/gpu.py: --models: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    checkpointing = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    base = TrainConfig(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        instances=1,
        inner_steps=args.inner_steps,
        device="cuda:0",
        precision=args.precision,
        overlap="off",
        codec="int8",
        compile=args.compile,
    )
    base = replace(base, schedule=replace(base.schedule, test="none"))
    corpus, _ = load_data(base)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="adloco-gpu-") as tmp:
        for name in models:
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(MODELS[name]))
            for ckpt in checkpointing:
                cfg = replace(base, model=str(path), activation_checkpointing=ckpt)
                r = measure(name, cfg, corpus, rounds=args.rounds)
                results.append(r)
                _write(args.out, results)  # after every run: a run cut short keeps what it measured
                print(
                    f"{name} ({r['params'] / 1e6:.0f}M) {r['autocast']} checkpointing={ckpt}"
                    f" compiled={r['compiled']}:"
                    f" b_max={r['b_max']} (estimated eager {r['b_max_estimated_eager']}),"
                    f" {r['tokens_per_s']:,.0f} tokens/s,"
                    f" peak device {r['peak_device_bytes'] / 2**30:.2f} GiB"
                    f" ({r['peak_device_bytes_per_param']:.1f} B/param),"
                    f" peak host {r['peak_host_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )
    _write(args.out, results)
    print(f"wrote {args.out}")


def _write(path: Path, results: list[dict[str, Any]]) -> None:
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
