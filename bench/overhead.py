"""Cost of the node (issue 11 §5): inner-step throughput against a bare PyTorch loop, and codec speed.

Part A, inner steps. The same model (the node's own `build_model`, same seed), the same batch and the
same data (the peer's own shard and sampler seed) train on the same device, two ways, alternating
rep by rep so drift hits both alike:

- bare: a plain loop a user would write around the same compute: zero_grad, the batch to the
  device, forward under the same autocast, the same loss function (`causal_lm_loss`), backward,
  `clip_grad_norm_(1.0)`, fused AdamW with the node's inner settings, no per-step host sync;
- node: a real `Peer` (one instance, fixed batch) running `train_round()` for H inner steps: what the
  node does per inner step (its sampler, its loss bookkeeping, the variance-test statistics of the
  first step while the batch is below its cap, Δ as a lazy view). No round is applied, so the batch
  stays b and every round takes the test. Two more node runs: with the batch at its cap (the test
  has nothing left to decide and gathers nothing: a grown swarm's steady state), and with the test
  off.

The figure is tokens per second of wall time around the H steps (CUDA synchronized at both ends).
The overhead is 1 − node / bare of each rep, the node's round and the bare one run side by side,
and its median over `--reps` reps after one warm-up round: this machine's speed drifts by 10 % and
more over a few minutes, which pairing cancels and independent medians of each mode do not (the
unpaired figure, from those medians, is reported too). Each node round's time outside its steps
(θ loaded into the model, Δ read out: host-device copies on a GPU) is reported apart. As a
reference, a bare loop through transformers' own loss (`model(input_ids, labels=...)`) is timed
too: the node's fused loss head is part of the node, so it can beat a naive loop.

Part B, codecs. Encode and decode of each codec on `--codec-mb` MB of float32 values with one CPU
thread, in GB/s of float32 values (input bytes for encode, output bytes for decode), against a
memcpy of the same bytes on the same thread (`torch.Tensor.copy_` into a preallocated buffer).

Run from the repository root:

    python bench/overhead.py                                  # tiny-llama on the CPU, ~1 min
    python bench/overhead.py --model gpt2-124m --device cuda --seq-len 1024 --batch-size 8
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from adloco.node.data.sampling import TokenSampler, shard_corpus
from adloco.node.model.devices import autocast
from adloco.node.model.loss import causal_lm_loss
from adloco.node.model.model import build_model, count_parameters, peak_flops, train_flops_per_token
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.codecs import decode, make_codec

try:  # imported by adloco-bench
    from .memory import GPT2_124M
except ImportError:  # run as a script: this folder is on sys.path
    from memory import GPT2_124M  # type: ignore[no-redef]

CODECS = ("fp16", "int8", "int4", "sparse:64/4096:2")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Runner = Callable[[int], tuple[int, float]]


def bare_steps(cfg: TrainConfig, corpus: Any, vocab: int, *, hf_loss: bool, compiled: bool = False) -> Runner:
    """A plain training loop on the peer's data; returns run(steps) -> (tokens, wall seconds).
    `compiled`: the whole model through `torch.compile`, as a user would write it."""
    device = torch.device(cfg.device)
    model = build_model(cfg.model, vocab_size=vocab, seed=cfg.seed, max_seq_len=max(1024, cfg.seq_len))
    model.to(device)
    model.train()
    forward = torch.compile(model) if compiled else model
    params = [p for p in model.parameters() if p.requires_grad]
    inner = cfg.inner
    opt = torch.optim.AdamW(
        params,
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        weight_decay=inner.weight_decay,
        fused=device.type in ("cpu", "cuda") or None,
    )
    shard = shard_corpus(
        corpus, peer_index=0, num_peers=1, instance_index=0, num_instances=1, non_iid=False, seed=cfg.seed
    )
    sampler = TokenSampler(shard, seq_len=cfg.seq_len, seed=cfg.seed * 1000)
    dtype = None if cfg.precision == "fp32" else torch.bfloat16
    batch_size = cfg.batch_size

    def run(steps: int) -> tuple[int, float]:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = sampler.next_batch(batch_size).to(device, non_blocking=True)
            with autocast(device, dtype):
                if hf_loss:
                    loss = forward(input_ids=batch, labels=batch).loss
                else:
                    loss = causal_lm_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
            opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return steps * batch_size * cfg.seq_len, time.perf_counter() - t0

    return run


def node_steps(cfg: TrainConfig, corpus: Any, vocab: int, outside: list[float] | None = None) -> Runner:
    """A real peer's local round; returns run(steps) -> (tokens, wall seconds) with H = steps.
    `outside` gets each round's seconds outside its steps (the round's wall time less the instance's
    compute time): loading θ into the model at the round's start and reading Δ out at its end, which
    on a GPU cross between host and device (`devices.Placement`)."""
    peer = Peer(peer_id="overhead", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=vocab)
    device = torch.device(cfg.device)

    def run(steps: int) -> tuple[int, float]:
        schedule = peer.state.schedule
        assert steps == schedule.inner_steps and schedule.batch == (cfg.batch_size,), schedule
        _sync(device)
        t0 = time.perf_counter()
        local = peer.train_round()
        _sync(device)
        wall = time.perf_counter() - t0
        if outside is not None:
            outside.append(wall - local.compute_s)
        # The round's Δ is dropped unapplied: θ stays where it was, as in a solo run between rounds.
        del local
        return cfg.batch_size * steps * cfg.seq_len, wall

    return run


def measure_inner_steps(
    cfg: TrainConfig,
    *,
    reps: int,
    vocab: int,
    compiled: bool = False,
    only: set[str] | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Tokens/s of the bare loops and the node, alternating, median over `reps` after a warm-up.
    `compiled`: also a bare loop through a compiled model and the node with its layers compiled."""
    corpus, _ = load_data(cfg)
    steps = cfg.inner_steps
    eager = replace(cfg, compile="off")
    at_cap = replace(cfg.schedule, batch_cap=cfg.batch_size)
    on = replace(cfg, compile="on")
    # Each node runner's seconds per round outside its steps (`node_steps`).
    outside: dict[str, list[float]] = {}

    def node(name: str, node_cfg: TrainConfig) -> Runner:
        return node_steps(node_cfg, corpus, vocab, outside.setdefault(name, []))

    # Built lazily: only the runners asked for (a 124M model's seeded build takes seconds).
    builders: dict[str, Callable[[], Runner]] = {
        "bare": lambda: bare_steps(cfg, corpus, vocab, hf_loss=False),
        "bare_hf_loss": lambda: bare_steps(cfg, corpus, vocab, hf_loss=True),
        "node": lambda: node("node", eager),
        "node_at_cap": lambda: node("node_at_cap", replace(eager, schedule=at_cap)),
        "node_batch_test_off": lambda: node(
            "node_batch_test_off", replace(eager, schedule=replace(cfg.schedule, test="none"))
        ),
    }
    if compiled:
        builders["bare_compiled"] = lambda: bare_steps(cfg, corpus, vocab, hf_loss=True, compiled=True)
        builders["node_compiled"] = lambda: node("node_compiled", on)
        builders["node_compiled_at_cap"] = lambda: node("node_compiled_at_cap", replace(on, schedule=at_cap))
    if only:
        unknown = only - builders.keys()
        if unknown:
            raise SystemExit(
                f"bench/overhead.py: --only: no runner {', '.join(sorted(unknown))}"
                f" (runners: {', '.join(builders)})"
            )
    runners = {name: build() for name, build in builders.items() if not only or name in only}
    # The warm-up round of each: kernels, allocator, AdamW state, and the compile where there is one
    # (the node's first round compiles both micro-batch sizes: the test's chunks and the plain step).
    warmup_s: dict[str, float] = {}
    for name, run in runners.items():
        warmup_s[name] = run(steps)[1]
        print(f"  {name}: warm-up round {warmup_s[name]:.1f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(reps):
        for name, run in runners.items():
            tokens, wall = run(steps)
            rates[name].append(tokens / wall)
        print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    med = {name: statistics.median(r) for name, r in rates.items()}
    # The node's rounds outside their steps (θ in, Δ out), median ms over the timed reps: taken
    # before the profiled rounds, which cProfile slows and which `node_steps` records too.
    outside_ms = {name: 1000.0 * statistics.median(spent[1:]) for name, spent in outside.items() if spent[1:]}
    host_profile = {name: _host_profile(run, steps) for name, run in runners.items()} if profile else None

    def overhead(name: str) -> tuple[float, list[float]]:
        """1 − node / bare of each rep (the two ran side by side) in %, and their median."""
        paired = [100.0 * (1.0 - n / b) for n, b in zip(rates[name], rates["bare"], strict=True)]
        return statistics.median(paired), paired

    result: dict[str, Any] = {
        "tokens_per_s": med,
        "tokens_per_s_runs": rates,
        "warmup_round_s": warmup_s,
        "spread_pct": {name: 100.0 * (max(r) - min(r)) / statistics.median(r) for name, r in rates.items()},
        "round_outside_steps_ms": outside_ms,
    }
    if host_profile is not None:
        result["host_profile"] = host_profile
    if {"bare", "node", "node_at_cap", "node_batch_test_off", "bare_hf_loss"} <= rates.keys():
        node, node_runs = overhead("node")
        result.update(
            overhead_pct=node,
            overhead_pct_runs=node_runs,
            overhead_at_cap_pct=overhead("node_at_cap")[0],
            overhead_batch_test_off_pct=overhead("node_batch_test_off")[0],
            overhead_unpaired_pct=100.0 * (1.0 - med["node"] / med["bare"]),
            node_vs_hf_loss_loop_pct=100.0 * (med["node"] / med["bare_hf_loss"] - 1.0),
        )
    if {"node_compiled", "bare_compiled"} <= rates.keys():
        paired = [n / b for n, b in zip(rates["node_compiled"], rates["bare_compiled"], strict=True)]
        result["node_compiled_vs_bare_compiled"] = statistics.median(paired)
        result["node_compiled_vs_bare_compiled_runs"] = paired
    return result


def _host_profile(run: Runner, steps: int, top: int = 15) -> dict[str, Any]:
    """One more round of `run` under cProfile: where the host's time went, by Python function and
    torch call (a call that waits for the device, such as a copy to the host, shows as its own
    time). The functions with the most time of their own, and the round's wall time under the
    profiler (which inflates the Python-heavy parts)."""
    profiler = cProfile.Profile()
    profiler.enable()
    _, wall = run(steps)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return {
        "wall_s": wall,
        "calls": stats.total_calls,  # type: ignore[attr-defined]
        "top_own_time": [
            {
                "function": f"{Path(file).name}:{line}({name})" if line else name,
                "calls": calls,
                "own_s": own,
                "cumulative_s": cumulative,
            }
            for (file, line, name), (_, calls, own, cumulative, _) in rows
        ],
    }


def codec_speed(*, megabytes: float, reps: int) -> dict[str, Any]:
    """Encode/decode GB/s of each codec on one thread against a memcpy of the same bytes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        numel = int(megabytes * 1e6 / 4)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=gen) * 1e-3
        nbytes = x.numel() * 4
        dst = torch.empty_like(x)
        dst.copy_(x)  # fault the pages in

        def timed(fn: Callable[[], object]) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        memcpy = nbytes / timed(lambda: dst.copy_(x)) / 1e9
        out: dict[str, Any] = {"memcpy_gb_per_s": memcpy, "bytes": nbytes, "codecs": {}}
        for name in CODECS:
            codec = make_codec(name)
            payload = codec.encode("x", x)
            enc = nbytes / timed(lambda codec=codec: codec.encode("x", x)) / 1e9
            dec = nbytes / timed(lambda p=payload: decode(p)) / 1e9
            out["codecs"][name] = {
                "encode_gb_per_s": enc,
                "decode_gb_per_s": dec,
                "encode_vs_memcpy": enc / memcpy,
                "decode_vs_memcpy": dec / memcpy,
            }
        return out
    finally:
        torch.set_num_threads(threads)


def run(
    *,
    model: str | None = None,
    device: str = "cpu",
    seq_len: int = 128,
    batch_size: int = 8,
    inner_steps: int = 10,
    reps: int = 5,
    precision: str = "fp32",
    codec_mb: float = 64.0,
    codec_reps: int = 5,
    compiled: bool = False,
    only: set[str] | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Both parts; the dict `adloco-bench` stores under `overhead`."""
    vocab = 256
    with tempfile.TemporaryDirectory(prefix="adloco-overhead-") as tmp:
        spec = model
        if model == "gpt2-124m":
            path = Path(tmp) / "gpt2-124m.json"
            path.write_text(json.dumps(GPT2_124M))
            spec, vocab = str(path), int(GPT2_124M["vocab_size"])
        cfg = TrainConfig(
            model=spec,
            seq_len=seq_len,
            batch_size=batch_size,
            instances=1,
            inner_steps=inner_steps,
            device=device,
            precision=precision,
            overlap="off",
            b_max=batch_size,
        )
        # The cap above b: every round takes the batch test (as a swarm's do until b has grown to
        # the cap); no round is applied, so b stays and the rounds are comparable.
        cfg = replace(cfg, schedule=replace(cfg.schedule, batch_cap=2 * batch_size))
        built = build_model(spec, vocab_size=vocab, max_seq_len=max(1024, seq_len))
        params, flops_per_token = count_parameters(built), train_flops_per_token(built, seq_len)
        inner_steps_result = measure_inner_steps(
            cfg, reps=reps, vocab=vocab, compiled=compiled, only=only, profile=profile
        )
    result: dict[str, Any] = {
        "model": model or "default",
        "params": params,
        "device": _device_name(device),
        "precision": precision,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "inner_steps": inner_steps,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "train_flops_per_token": flops_per_token,
        **inner_steps_result,
    }
    peak = peak_flops(torch.device(device))
    if peak is not None:  # model FLOPs utilization of each mode's median
        result["peak_flops"] = peak
        result["mfu"] = {k: v * flops_per_token / peak for k, v in result["tokens_per_s"].items()}
    if codec_mb > 0:
        result["codec"] = codec_speed(megabytes=codec_mb, reps=codec_reps)
    return result


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="preset, config path or gpt2-124m (default: tiny-llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codec-mb", type=float, default=64.0, help="0 skips part B")
    ap.add_argument("--compile", action="store_true", help="also a compiled bare loop and compiled node")
    ap.add_argument("--only", default=None, help="comma-separated runners to time (default: all)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed reps, one more round of each runner under cProfile (host time by function)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/overhead.py: --device cuda, but torch sees no CUDA device here")
    t0 = time.perf_counter()
    result = run(
        model=args.model,
        device=args.device,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        inner_steps=args.inner_steps,
        reps=args.reps,
        precision=args.precision,
        codec_mb=args.codec_mb,
        compiled=args.compile,
        only=set(args.only.split(",")) if args.only else None,
        profile=args.profile,
    )
    result["duration_s"] = time.perf_counter() - t0
    tps = result["tokens_per_s"]
    print(f"{result['model']} ({result['params'] / 1e6:.1f}M) on {result['device']}, {args.precision}:")
    print("  tokens/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in tps.items()))
    if "overhead_pct" in result:
        print(
            f"  node against bare: overhead {result['overhead_pct']:+.2f} %"
            f" (batch at its cap: {result['overhead_at_cap_pct']:+.2f} %;"
            f" batch test off: {result['overhead_batch_test_off_pct']:+.2f} %)"
        )
    if "node_compiled_vs_bare_compiled" in result:
        print(f"  compiled node against compiled bare: {result['node_compiled_vs_bare_compiled']:.3f}×")
    print("  warm-up rounds (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["warmup_round_s"].items()))
    if result["round_outside_steps_ms"]:
        print(
            "  node rounds outside their steps (θ in, Δ out; ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in result["round_outside_steps_ms"].items())
        )
    if "mfu" in result:
        print("  MFU: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in result["mfu"].items()))
    for name, prof in result.get("host_profile", {}).items():
        print(f"  host profile of one {name} round ({prof['wall_s']:.3f} s under the profiler):")
        for row in prof["top_own_time"][:8]:
            print(f"    {row['own_s']:8.4f} s own, {row['calls']:6d} calls  {row['function']}")
    for name, c in result.get("codec", {}).get("codecs", {}).items():
        print(
            f"  {name}: encode {c['encode_gb_per_s']:.2f} GB/s ({c['encode_vs_memcpy']:.3f}× memcpy),"
            f" decode {c['decode_gb_per_s']:.2f} GB/s; memcpy {result['codec']['memcpy_gb_per_s']:.2f} GB/s"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
