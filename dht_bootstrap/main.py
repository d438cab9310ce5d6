"""`adloco-bootstrap`: a long-lived bootstrap peer with a persistent identity.

    adloco-bootstrap --identity-path bootstrap.id --host-maddrs /ip4/0.0.0.0/tcp/31337 \
        --announce-maddrs /ip4/203.0.113.7/tcp/31337

It prints the multiaddrs to pass to nodes as --peers, keeps the DHT up until SIGTERM/SIGINT, and
restarts with the same peer id from the same identity file. With --metrics-port it exports the
swarm-wide figures of run --run-id, read from the beacons nodes publish in the DHT after every round
(`swarm_metrics.SwarmMetrics`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ..errors import UserError
from ..protocol.transport.dht import NetworkConfig, parse_maddrs, start_dht, visible_maddrs
from ..settings import EPILOG, add_config_argument, parse_settings
from .swarm_metrics import SwarmMetrics

logger = logging.getLogger("adloco.bootstrap")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-bootstrap",
        description="Bootstrap peer for an adloco swarm: prints the --peers multiaddrs for nodes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=EPILOG,
    )
    add_config_argument(p)
    p.add_argument("--identity-path", default="bootstrap.id", help="private key file (created if missing)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], help="listen multiaddrs")
    p.add_argument("--announce-maddrs", nargs="*", default=[], help="public multiaddrs to announce")
    p.add_argument("--peers", nargs="*", default=[], help="other bootstrap peers to connect to")
    p.add_argument("--no-nat-port-map", action="store_true", help="do not ask the router for a port mapping")
    p.add_argument("--maddrs-file", type=Path, default=None, help="also write the multiaddrs here (JSON)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    m = p.add_argument_group("swarm metrics (Prometheus)")
    m.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    m.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics endpoint listens on")
    m.add_argument("--run-id", default="default", help="the run whose nodes the metrics describe")
    m.add_argument("--poll-s", type=float, default=10.0, help="seconds between two reads of the DHT")
    m.add_argument(
        "--alive-s", type=float, default=300.0, help="a node is alive if it reported within this (s)"
    )
    return p


def network_from_args(args: argparse.Namespace) -> NetworkConfig:
    identity = Path(args.identity_path)
    try:
        identity.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--identity-path: cannot create {identity.parent}: {e.strerror}") from None
    if identity.exists() and not os.access(identity, os.R_OK):
        raise ValueError(f"--identity-path: {identity} is not readable")
    return NetworkConfig(
        peers=parse_maddrs(args.peers, option="--peers"),
        host_maddrs=parse_maddrs(args.host_maddrs, option="--host-maddrs"),
        announce_maddrs=parse_maddrs(args.announce_maddrs, option="--announce-maddrs"),
        identity_path=str(identity),
        nat_port_map=not args.no_nat_port_map,
    )


def write_maddrs(path: Path, maddrs: list[str]) -> None:
    """Atomically write the multiaddrs, so a reader never sees a partial file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(maddrs))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_settings(build_parser(), argv)
    except UserError as e:
        print(f"adloco-bootstrap: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metrics = None
        if args.metrics_port is not None:
            if args.poll_s <= 0 or args.alive_s <= 0:
                raise ValueError("--poll-s and --alive-s must be > 0")
            metrics = SwarmMetrics(args.run_id, alive_s=args.alive_s)
            metrics.serve(args.metrics_port, args.metrics_host)
        dht = start_dht(network_from_args(args))
    except ValueError as e:
        print(f"adloco-bootstrap: error: {e}", file=sys.stderr)
        return 2
    # Handlers go in only after the DHT process has forked: a child that inherited them would
    # swallow the SIGTERM hivemind sends it when a graceful shutdown times out, and hang forever.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        maddrs = visible_maddrs(dht)
        print("adloco-bootstrap: running; start nodes with:", flush=True)
        print("  --peers " + " ".join(maddrs), flush=True)
        if args.maddrs_file is not None:
            write_maddrs(args.maddrs_file, maddrs)
        if metrics is None:
            stop.wait()
        else:
            metrics.attach(dht)
            while not stop.wait(args.poll_s):
                metrics.poll(dht)
        logger.info("shutting down")
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
