"""A hostile node for bench/robust_swarm.py: it joins a run exactly as `adloco-node` does (the same
flags, its own identity, real p2pd), trains, and then sends a forged pseudo-gradient instead of its
own in every round (`--attack`: flip1000, flip, random, constant; `node.sim.engine.forge`, the
simulator's attacks). It applies whatever the group's owners return, as an honest node does.

    python bench/hostile_node.py --attack flip --peers ... --run-id r [node flags]
"""

from __future__ import annotations

import sys
from typing import Any

from adloco.node.cli.node import (
    build_parser,
    network_from_args,
    parse_settings,
    swarm_from_args,
    train_config_from_args,
)
from adloco.node.sim.engine import ATTACKS, forge
from adloco.node.swarm.node import SwarmNode


def main(argv: list[str]) -> int:
    attack = "flip"
    if "--attack" in argv:
        at = argv.index("--attack")
        attack, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    if attack not in ATTACKS[1:]:
        raise SystemExit(f"--attack: one of {', '.join(ATTACKS[1:])}")
    args = parse_settings(build_parser(), argv)
    node = SwarmNode(train_config_from_args(args), network_from_args(args), swarm_from_args(args))
    honest = node.peer.contribute
    calls = 0

    def hostile(local: Any, **kwargs: Any) -> Any:
        nonlocal calls
        contribution, info = honest(local, **kwargs)
        if contribution is None:
            return contribution, info
        calls += 1
        forged = forge(contribution, attack, seed=calls << 20, bounds=node.peer.claim_bounds())
        return forged, info

    node.peer.contribute = hostile
    try:
        node.run()
    finally:
        node.shutdown()
    print(f"hostile node: sent {calls} forged contributions ({attack})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
