"""What a member of a data-parallel group holds, its layers sharded (FSDP2, record 084) or the whole
model replicated (record 064): GPT-2 124M by default, two processes over gloo on this CPU.

Each mode runs in two fresh processes: the model built, the group joined (sharded or not), `--steps`
steps of one micro-batch of `--rows` rows (a row per member), and each member reports the values it
holds in the trained model (parameters, AdamW moments), its resident memory (VmRSS, also with glibc's
free pages handed back) and peak (VmHWM, the libraries and the model's build included), and its
median step time. Rank 0 is the group's primary: sharded, it trains a sharded copy and keeps the
instance's whole weights beside it, as in a node (record 084). The step times are one run's.

    python bench/sharding.py --out bench/results/sharding_124m.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
from torch._C._distributed_c10d import TCPStore

from adloco.node.data.sampling import TokenSampler
from adloco.node.model.model import build_model
from adloco.node.training import parallel, sharding
from adloco.node.training.instances import InnerConfig, Instance
from adloco.node.training.runtime import give_back_free_memory


def _status_gib(field: str) -> float:
    """A memory figure of this process from /proc (VmHWM: the peak resident; VmRSS: now), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 2**20, 3)
    return float("nan")


def _member(rank: int, port: int, args: argparse.Namespace, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    model = build_model(args.model, vocab_size=50257, seed=0, max_seq_len=1024)
    tokens = torch.randint(0, 50257, (200_000,), generator=torch.Generator().manual_seed(5))
    inst = Instance(
        slot=0,
        model=model,
        sampler=TokenSampler([tokens], seq_len=args.seq_len, seed=3),
        inner=InnerConfig(),
        batch_stats="sums",
    )
    inst.join(parallel.GroupSpec(port, f"{mode}/", rank, 2, sharded=mode == "sharded"))
    assert inst.group is not None
    # The primary of a sharded group trains a sharded copy and keeps its whole weights (record 084).
    member: parallel.Member = inst.trainer if inst.trainer is not None else inst
    gc.collect()
    give_back_free_memory()
    joined = {"peak_rss_gib_built_and_joined": _status_gib("VmHWM"), "rss_gib_joined": _status_gib("VmRSS")}
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        parallel._step(
            member,
            inst.group,
            micro=args.rows,
            accum=1,
            cols=args.seq_len,
            stats="sums",
            draw=inst.sampler.next_batch if rank == 0 else None,
        )
        times.append(time.perf_counter() - t0)
    held = sum(sharding.local(p).numel() for p in member.params)
    moments = sum(
        sharding.local(t).numel()
        for state in member.optimizer.state.values()
        for name, t in state.items()
        if name != "step"
    )
    report: dict[str, Any] = {
        "rank": rank,
        "parameters": sum(p.numel() for p in inst.params),
        "held_parameter_values": held,
        "whole_weights_kept": inst.trainer is not None,
        "held_moment_values": moments,
        **joined,
        "peak_rss_gib": _status_gib("VmHWM"),
        "rss_gib_after_steps": _status_gib("VmRSS"),
        "rss_gib_after_steps_trimmed": (gc.collect(), give_back_free_memory(), _status_gib("VmRSS"))[2],
        "median_step_s": round(statistics.median(times[1:] or times), 3),
    }
    inst.leave()
    Path(f"{out}.{rank}").write_text(json.dumps(report))


def run(args: argparse.Namespace, mode: str, scratch: Path) -> list[dict[str, Any]]:
    store = TCPStore("127.0.0.1", 0, None, True, timeout=parallel.TIMEOUT, wait_for_workers=False)
    ctx = torch.multiprocessing.get_context("spawn")
    out = str(scratch / mode)
    members = [ctx.Process(target=_member, args=(rank, store.port, args, mode, out)) for rank in range(2)]
    for m in members:
        m.start()
    for m in members:
        m.join()
    if any(m.exitcode for m in members):
        raise SystemExit(f"{mode}: a member failed (exit codes {[m.exitcode for m in members]})")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="rows of the step's batch (one per member)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="sharding-"))
    results = {mode: run(args, mode, scratch) for mode in ("replicated", "sharded")}
    summary = {
        "model": args.model,
        "seq_len": args.seq_len,
        "rows": args.rows,
        "steps": args.steps,
        "torch": torch.__version__,
        "modes": results,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
