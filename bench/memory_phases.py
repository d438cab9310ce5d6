"""Where a node's resident memory peaks: VmRSS sampled every 2 ms, labelled by phase.

A debugging aid beside bench/memory.py (which measures the peak alone): it runs `adloco-node` in
this process with the round's phases wrapped (peer start-up, each round's training with its forward,
backward, norm-test statistics, clipping and AdamW step; contribute, average, apply, validation)
and prints, per phase, the largest and the last VmRSS seen in it, then VmHWM. The sampler is a
Python thread, so a peak shorter than a few ms can be missed; the VmHWM line never misses one.
Arguments are `adloco-node`'s, e.g. (from a folder holding the config and a 50257-token
tokenizer.json, as bench/memory.py makes them):

    python bench/memory_phases.py --offline --rounds 2 --model gpt2-124m.json \\
        --tokenizer tokenizer.json --seq-len 128 --batch-size 2 --inner-steps 2 --instances 1

Without --offline (a networked node: give it --run-id, --host-maddrs /ip4/127.0.0.1/tcp/0,
--control-port -1 as bench/memory.py does) the swarm loop's steps are labelled too; each thread
keeps its own labels, so a phase reads "main's phases | the averaging thread's" while both run
(under overlap the next round trains while the last one is averaged).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MAIN = threading.get_ident()
_stacks: dict[int, list[str]] = {_MAIN: ["start"]}  # each thread's labels
_stack = _stacks[_MAIN]
_peaks: dict[str, list[int]] = {}  # phase -> [largest, last]


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _sample() -> None:
    while True:
        rss = _rss()
        others = [stack for ident, stack in list(_stacks.items()) if ident != _MAIN and stack]
        phase = " | ".join(["/".join(_stack), *("/".join(stack) for stack in others)])
        seen = _peaks.setdefault(phase, [rss, rss])
        seen[0], seen[1] = max(seen[0], rss), rss
        time.sleep(0.002)


def _label(owner: Any, name: str, tag: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        stack = _stacks.setdefault(threading.get_ident(), [])
        stack.append(tag)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    setattr(owner, name, wrapped)


def _report() -> None:
    for phase, (largest, last) in _peaks.items():
        print(f"{phase:48s} peak {largest / 2**30:6.3f} GiB   last {last / 2**30:6.3f} GiB", file=sys.stderr)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            print(f"VmHWM {int(line.split()[1]) / 2**20:.3f} GiB", file=sys.stderr)


def main() -> int:
    threading.Thread(target=_sample, daemon=True).start()
    import torch
    from transformers import GPT2Model

    from adloco.node.cli.entry import main as node_main
    from adloco.node.solo import trainer
    from adloco.node.swarm import node as swarm_node
    from adloco.node.swarm.loop import RoundLoop
    from adloco.node.swarm.node import SwarmNode
    from adloco.node.swarm.offers import StateOffers
    from adloco.node.swarm.sync import SwarmSync
    from adloco.node.training import instances
    from adloco.node.training.instances import Instance
    from adloco.node.training.peer import Peer
    from adloco.node.training.replica import SpilledPayloads
    from adloco.protocol.algorithms import parts
    from adloco.protocol.transport.hivemind_averager import HivemindAverager
    from adloco.protocol.transport.state_transfer import StateServer

    for owner, name, tag in [
        (Peer, "__init__", "peer_init"),
        (Peer, "train_round", "train"),
        (Peer, "contribute", "contribute"),
        (Peer, "apply_round", "apply"),
        (Peer, "_check_update", "check"),
        (Peer, "_step_spans", "step"),
        (Instance, "settle_delta", "settle"),
        (Peer, "_trim_history", "keep"),
        (Peer, "rebase_instances", "rebase"),
        (Peer, "validation_loss", "val"),
        (Instance, "_chunk_stats", "stats"),
        (torch.optim.AdamW, "step", "adamw"),
        (torch.nn.utils, "clip_grad_norm_", "clip"),
        (torch.Tensor, "backward", "bwd"),
        (instances, "causal_lm_loss", "loss"),  # the body's forward ("fwd"), then the fused head
        (GPT2Model, "forward", "fwd"),
        (trainer.MemoryAverager, "average", "average"),
        (HivemindAverager, "average", "average"),
        (RoundLoop, "_wait_and_land", "wait_land"),
        (RoundLoop, "_land", "land"),
        (SwarmSync, "sync", "sync"),
        (SwarmSync, "publish", "publish"),
        (StateOffers, "publish", "offer"),
        (SwarmNode, "_build", "peer_build"),
        (SwarmNode, "_join", "join"),
        # What other threads run for the others (labelled where they run: "main's | theirs"): an
        # owner's reduction of a part, a state chunk or the kept updates served to a joiner.
        (parts, "reduce_part", "reduce"),
        (StateServer, "_answer", "serve_chunk"),
        (swarm_node, "updates_of", "serve_updates"),
        (SpilledPayloads, "__getitem__", "read_kept"),
    ]:
        _label(owner, name, tag)
    one_round = trainer._round
    rounds = 0

    def labelled_round(*args: Any, **kwargs: Any) -> Any:
        nonlocal rounds
        rounds += 1
        _stack[:] = [f"r{rounds}"]
        return one_round(*args, **kwargs)

    trainer._round = labelled_round  # type: ignore[assignment]
    one_local = RoundLoop._local_round

    def labelled_local(*args: Any, **kwargs: Any) -> Any:
        nonlocal rounds
        rounds += 1
        _stack[:] = [f"r{rounds}"]
        return one_local(*args, **kwargs)

    RoundLoop._local_round = labelled_local  # type: ignore[method-assign]
    try:
        return node_main(sys.argv[1:])
    finally:
        _report()


if __name__ == "__main__":
    sys.exit(main())
