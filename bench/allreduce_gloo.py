"""What averaging a model's gradients between two processes costs on this CPU, through gloo.

    python bench/allreduce_gloo.py [--params 124439808] [--repeats 5]

A probe for issue 27 §2's next step (record 063): an instance trained data parallel over several
devices averages its gradients in a torch.distributed group after every inner step; on the CPU,
where the tests run it, the group is gloo over loopback. Two spawned processes, one thread each,
all-reduce one fp32 tensor of `--params` elements (GPT-2 124M's count by default) and of 1M; the
median of `--repeats` timed calls after one warm-up, each started behind a barrier.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, world: int, port: int, numel: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tensor = torch.full((numel,), float(rank + 1))
    dist.all_reduce(tensor)  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        size, median_ms = numel * 4 / 2**20, statistics.median(times) * 1e3
        print(f"gloo all_reduce of {size:.0f} MiB fp32, {world} processes: median {median_ms:.0f} ms")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=124_439_808)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for numel in (1 << 20, args.params):
        mp.spawn(_run, args=(2, _free_port(), numel, args.repeats), nprocs=2)


if __name__ == "__main__":
    main()
