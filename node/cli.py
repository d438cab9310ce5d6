"""`adloco-node`: the volunteer process.

Until the swarm transport lands (issue 3) a node trains alone: the full AdLoCo round (MIT instances,
adaptive batch, switch mode, compression with error feedback, outer Nesterov) in a group of one.
Bad input ends with one line naming the option and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from adloco.node.errors import UserError
from adloco.node.options import add_train_arguments, set_threads, train_config_from_args
from adloco.node.trainer import SoloRound, train_solo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node",
        description="Decentralized volunteer training node (DiLoCo + AdLoCo + DiLoCoX + HeLoCo).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--rounds", type=int, default=0, help="rounds to train (0: until SIGTERM/Ctrl-C)")
    run.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all CPUs)")
    run.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add_train_arguments(p)
    return p


def format_round(r: SoloRound) -> str:
    return (
        f"[local round={r.round}] val {r.val_loss:.3f} inner {r.inner_loss:.3f} {r.tokens_per_s:.0f} tok/s"
        f" b={list(r.batch_sizes)} a={r.accum_steps} K={r.instances} {r.codec} {r.wire_bytes / 1e6:.2f}MB"
        f" {r.round_s:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.rounds < 0:
            raise UserError(f"--rounds: must be >= 0 (0 trains until stopped), got {args.rounds}")
        set_threads(args.threads)
        cfg = train_config_from_args(args)
        train_solo(
            cfg,
            rounds=args.rounds,
            on_round=lambda r: print(format_round(r), flush=True),
            should_stop=stop.is_set,
        )
    except UserError as e:
        print(f"adloco-node: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adloco-node: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
