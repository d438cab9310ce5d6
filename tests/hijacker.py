"""A hostile peer for tests/test_swarm.py, issue 10's round hijack: it joins a run as a node does (the
same flags), then sets its state to random weights at a far-ahead round, publishes that state's
record, signed with its own key as every node's is, and serves it to whoever asks, republishing
until it is stopped. Honest nodes that believed it would download its state and adopt its θ."""

from __future__ import annotations

import sys
import threading

import torch

from adloco.node.cli.node import build_parser, network_from_args, swarm_from_args
from adloco.node.cli.options import train_config_from_args
from adloco.node.swarm.node import SwarmNode
from adloco.settings import parse_settings

HIJACK_ROUND = 10**6


def main(argv: list[str]) -> int:
    args = parse_settings(build_parser(), argv)
    node = SwarmNode(train_config_from_args(args), network_from_args(args), swarm_from_args(args))
    stop = threading.Event()
    try:
        with node.lock, torch.no_grad():
            generator = torch.Generator().manual_seed(666)
            for t in node.peer.state.theta:
                t.copy_(torch.randn(t.shape, generator=generator))
            node.peer.state.round = HIJACK_ROUND
        while not stop.wait(2.0):
            node.sync.publish()
            print(f"published round {HIJACK_ROUND} as {node.peer_id}", flush=True)
    finally:
        node.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
