"""`adloco-node`: the volunteer process.

    adloco-node --peers /ip4/1.2.3.4/tcp/31337/p2p/Qm... --run-id my-run

joins a swarm (`node/swarm/node.py`); with no --peers it starts a new swarm as its first peer and trains
alone until others join, printing the multiaddrs they can use. `--offline` trains alone without
any networking (`node/solo/trainer.py`). Bad input ends with one line naming the option and exit code 2.

Over 500 lines, one idea: the adloco-node command, its flag groups and how each becomes a setting or
a one-line refusal; split by flag group, a reader would follow one flag across several files.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import NetworkLost, UserError
from ...protocol.transport.admission import TOKEN_PREFIX, check, read_allowlist, read_credential
from ...protocol.transport.dht import NetworkConfig, parse_maddrs, peer_ids_of
from ...protocol.transport.identity import load_identity
from ...protocol.transport.manifest import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from ...protocol.transport.state_transfer import TransferSettings
from ...protocol.transport.wire import DEFAULT_CHUNK_BYTES as DEFAULT_EXCHANGE_CHUNK
from ...protocol.transport.wire import MAX_CHUNK_BYTES as MAX_EXCHANGE_CHUNK
from ...protocol.transport.wire import PART_FLOOR_S, REDUCE_FLOOR_S
from ...settings import EPILOG, add_config_argument, parse_settings
from ..operations import reachability
from ..operations.checkpoint import check_checkpoint_dir
from ..operations.control import ControlServer, check_bind
from ..operations.metrics import NodeMetrics
from ..solo.trainer import train_solo
from ..swarm.node import SwarmConfig, SwarmNode
from ..training.config import PUBLIC_AGGREGATE, TrainConfig
from ..training.rounds import format_round
from ..training.runtime import lean_allocator
from .options import add_train_arguments, finite_float, set_threads, train_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node",
        description="Decentralized volunteer training node (DiLoCo + AdLoCo + DiLoCoX + HeLoCo). Other"
        " commands, each with its own --help: `adloco-node ctl` (talk to a running node), `adloco-node"
        " tokenizer` (train a BPE tokenizer on the corpus), `adloco-node export` (a checkpoint as a"
        " Hugging Face folder), `adloco-node credential` (keys and credentials of a private run).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=EPILOG,
    )
    add_config_argument(p)
    add_run_arguments(p)
    add_operations_arguments(p)
    add_train_arguments(p)
    add_network_arguments(p)
    return p


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("run")
    run.add_argument("--rounds", type=int, default=0, help="rounds to train (0: until SIGTERM/Ctrl-C)")
    run.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all CPUs)")
    run.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.add_argument("--offline", action="store_true", help="train alone with no networking at all")
    run.add_argument("--status-file", type=Path, default=None, help="append one JSON line per event here")
    run.add_argument(
        "--host-allocator",
        choices=("default", "lean"),
        default="default",
        help="lean: freed blocks of 128 KiB or more go back to the system at once (glibc), not only at a"
        " round's boundary: less host memory for ~20%% slower CPU steps (docs/experiments.md)",
    )


def add_operations_arguments(p: argparse.ArgumentParser) -> None:
    ops = p.add_argument_group("operations")
    ops.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="write checkpoints here, and resume from them"
    )
    ops.add_argument(
        "--checkpoint-every", type=int, default=10, help="rounds between checkpoints (0: only at the end)"
    )
    ops.add_argument(
        "--control-port", type=int, default=7601, help="local gRPC control service (adloco-node ctl); -1: off"
    )
    ops.add_argument("--control-host", default="127.0.0.1", help="address the control service binds")
    ops.add_argument(
        "--control-allow-remote", action="store_true", help="allow a non-loopback --control-host (no auth!)"
    )
    ops.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    ops.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics endpoint listens on")


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    net = p.add_argument_group("swarm networking (hivemind)")
    net.add_argument(
        "--peers", nargs="*", default=[], help="multiaddrs of peers to join; none: start a swarm"
    )
    net.add_argument(
        "--trust-peers",
        nargs="*",
        default=None,
        help="peer ids whose state records a joining node believes first, with the peers they list as"
        " workers (default: the ids in --peers; none: weigh every live peer by its work)",
    )
    net.add_argument("--run-id", default="default", help="swarms with different run ids never mix")
    net.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], help="listen multiaddrs")
    net.add_argument("--announce-maddrs", nargs="*", default=[], help="public multiaddrs to announce")
    net.add_argument("--identity-path", default=None, help="private key file: same peer id across restarts")
    net.add_argument("--client-mode", action="store_true", help="accept no incoming connections (behind NAT)")
    net.add_argument("--no-relay", action="store_true", help="do not use libp2p circuit relays")
    net.add_argument("--use-auto-relay", action="store_true", help="look for relays to become reachable")
    net.add_argument(
        "--no-nat-port-map", action="store_true", help="do not ask the router for a port mapping"
    )
    net.add_argument("--window-s", type=float, default=3.0, help="matchmaking window per round (s)")
    add_exchange_arguments(p)
    net.add_argument("--data-shard", type=int, default=None, help="this node's data shard (default: random)")
    net.add_argument("--data-shards", type=int, default=16, help="number of data shards of the run")
    net.add_argument(
        "--simulate-slowdown", type=float, default=1.0, help="testing: make this node F× slower (idle time)"
    )
    add_state_transfer_arguments(p)
    add_private_run_arguments(p)


def add_private_run_arguments(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("private run (only admitted peers average, serve and are believed)")
    run.add_argument(
        "--run-owner",
        default=None,
        help="the run owner's id (adloco-node credential owner): admit peers holding its credential",
    )
    run.add_argument(
        "--credential", default=None, help="this node's credential (a file, or the token itself)"
    )
    run.add_argument(
        "--allow-peers", type=Path, default=None, help="a file of peer ids admitted outright, one per line"
    )


def private_run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The private-run fields of SwarmConfig, checked before anything starts: a credential that is
    not this node's (its --identity-path), not for this run, or expired stops the node here."""
    if args.run_owner is None and args.allow_peers is None:
        if args.credential is not None:
            raise UserError("--credential: only a private run takes one (give --run-owner)")
        return {}
    if args.identity_path is None or not Path(args.identity_path).is_file():
        raise UserError(
            "a private run admits peers by peer id: give --identity-path, an existing key file"
            " (adloco-node credential peer-id --identity-path FILE creates one and prints its id)"
        )
    try:
        me = load_identity(args.identity_path).peer_id
    except ValueError as e:
        raise UserError(f"--identity-path: {e}") from None
    fields: dict[str, Any] = {}
    if args.allow_peers is not None:
        try:
            fields["allowed_peers"] = read_allowlist(str(args.allow_peers))
        except ValueError as e:
            raise UserError(f"--allow-peers: {e}") from None
    if args.run_owner is not None:
        if args.credential is None:
            raise UserError("--run-owner: give --credential, issued by the run owner for this node's peer id")
        token = read_token(args.credential)
        try:
            credential = read_credential(token)
            check(credential, run_id=args.run_id, owner=args.run_owner)
        except ValueError as e:
            raise UserError(f"--credential: {e}") from None
        if credential.peer_id != me:
            raise UserError(
                f"--credential: it admits peer {credential.peer_id}; this node (--identity-path) is {me}"
            )
        fields.update(run_owner=args.run_owner, credential=token)
    elif args.credential is not None:
        raise UserError("--credential: an allowlist run takes none (give --run-owner to use credentials)")
    return fields


def read_token(value: str) -> str:
    """A credential given as a file path or as the token itself."""
    path = Path(value)
    if not value.startswith(TOKEN_PREFIX + ".") and path.is_file():
        try:
            return path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--credential: cannot read {value}: {e}") from None
    return value.strip()


def add_exchange_arguments(p: argparse.ArgumentParser) -> None:
    ex = p.add_argument_group("averaging exchange (deadlines grow with the bytes of a round)")
    ex.add_argument(
        "--grace-s",
        type=finite_float,
        default=0.5,
        help="wait after a round's window before reading its group (s); raise it if rounds fail with"
        " 'group mismatch' (DHT latency or clock skew)",
    )
    ex.add_argument(
        "--part-timeout-s",
        type=finite_float,
        default=PART_FLOOR_S,
        help="floor of the part deadline: an owner waits at least this long for a silent member (s)",
    )
    ex.add_argument(
        "--reduce-timeout-s",
        type=finite_float,
        default=REDUCE_FLOOR_S,
        help="floor of the answer phase (s): the owners' reductions and answers; raise it if members"
        " give up with 'no answer from owner(s)' on a slow CPU",
    )
    ex.add_argument(
        "--exchange-bandwidth-mbps",
        type=finite_float,
        default=10.0,
        help="rate each peer is expected to move averaging bytes at, each way (Mbit/s); deadlines give"
        " a round's bytes 4x what they need at it; lower it if honest members on slow links get dropped",
    )
    ex.add_argument(
        "--exchange-chunk-mb",
        type=finite_float,
        default=DEFAULT_EXCHANGE_CHUNK / 2**20,
        help="payloads travel in frames of at most this size (MiB): what a stream's reader holds at once",
    )


def add_state_transfer_arguments(p: argparse.ArgumentParser) -> None:
    state = p.add_argument_group("state download (joiners and far-behind nodes)")
    state.add_argument(
        "--state-chunk-mb",
        type=finite_float,
        default=DEFAULT_CHUNK_BYTES / 2**20,
        help="chunk size (MiB); keep the run's default: donors that chunk alike share one manifest",
    )
    state.add_argument(
        "--state-bandwidth-mbps",
        type=finite_float,
        default=10.0,
        help="download rate to expect before a donor is measured (Mbit/s); lower it on a slow link",
    )
    state.add_argument(
        "--state-timeout-floor-s",
        type=finite_float,
        default=10.0,
        help="no state request times out sooner (s); raise it if busy donors get dropped",
    )
    state.add_argument("--state-donors", type=int, default=4, help="donors a download uses at once")


def network_from_args(args: argparse.Namespace) -> NetworkConfig:
    try:
        return NetworkConfig(
            peers=parse_maddrs(args.peers, option="--peers"),
            host_maddrs=parse_maddrs(args.host_maddrs, option="--host-maddrs"),
            announce_maddrs=parse_maddrs(args.announce_maddrs, option="--announce-maddrs"),
            identity_path=args.identity_path,
            client_mode=args.client_mode,
            use_relay=not args.no_relay,
            use_auto_relay=args.use_auto_relay,
            nat_port_map=not args.no_nat_port_map,
        )
    except ValueError as e:
        raise UserError(str(e)) from None


def swarm_from_args(args: argparse.Namespace) -> SwarmConfig:
    if args.window_s < 0 or args.part_timeout_s <= 0:
        raise UserError("--window-s must be >= 0 and --part-timeout-s > 0")
    if args.grace_s < 0 or args.reduce_timeout_s <= 0:
        raise UserError("--grace-s must be >= 0 and --reduce-timeout-s > 0")
    if not args.exchange_bandwidth_mbps > 0:
        raise UserError(f"--exchange-bandwidth-mbps: must be > 0, got {args.exchange_bandwidth_mbps:g}")
    exchange_chunk = round(args.exchange_chunk_mb * 2**20)
    if not MIN_CHUNK_BYTES <= exchange_chunk <= MAX_EXCHANGE_CHUNK:
        raise UserError(
            f"--exchange-chunk-mb: must be in [{MIN_CHUNK_BYTES / 2**20:g}, {MAX_EXCHANGE_CHUNK / 2**20:g}],"
            f" got {args.exchange_chunk_mb:g}"
        )
    if not 1.0 <= args.simulate_slowdown < 1000:
        raise UserError(f"--simulate-slowdown: must be in [1, 1000), got {args.simulate_slowdown}")
    if args.data_shards < 1 or (args.data_shard is not None and not 0 <= args.data_shard < args.data_shards):
        raise UserError(f"--data-shard: must be in [0, --data-shards={args.data_shards})")
    check_checkpoint_args(args)
    return SwarmConfig(
        state_transfer=transfer_from_args(args),
        run_id=args.run_id,
        rounds=args.rounds,
        window_s=args.window_s,
        grace_s=args.grace_s,
        part_timeout_s=args.part_timeout_s,
        reduce_timeout_s=args.reduce_timeout_s,
        exchange_bandwidth_bps=args.exchange_bandwidth_mbps * 1e6 / 8,
        exchange_chunk_bytes=exchange_chunk,
        status_file=args.status_file,
        data_shard=args.data_shard,
        data_shards=args.data_shards,
        simulate_slowdown=args.simulate_slowdown,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        trusted_peers=trusted_peers_from_args(args),
        **private_run_from_args(args),
    )


def check_checkpoint_args(args: argparse.Namespace) -> None:
    """--checkpoint-every and --checkpoint-dir, checked before anything trains (both modes)."""
    if args.checkpoint_every < 0:
        raise UserError(f"--checkpoint-every: must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_dir is not None:
        check_checkpoint_dir(args.checkpoint_dir)


OFFLINE_REFUSED_GROUPS = ("swarm networking", "private run", "averaging exchange", "state download")
"""The flag groups of a networked node (by the start of their titles): an --offline node has none of
it, so a flag of theirs given with --offline is refused rather than ignored."""
OFFLINE_REFUSED = {
    "--status-file": None,
    "--control-port": None,
    "--control-host": None,
    "--control-allow-remote": None,
    "--metrics-port": None,
    "--metrics-host": None,
    "--overlap": "off",  # alone there is no transfer to overlap with
    "--replay-mb": 0.0,  # nor a laggard to replay the updates
}
"""Other flags an --offline node cannot honour, and the one value it does (None: only the default)."""


def offline_refusal(args: argparse.Namespace) -> None:
    """UserError naming the first flag given with --offline that training alone cannot honour (a
    networked node's flag, or one of `OFFLINE_REFUSED` at another value than the default or the one
    it honours): it would be ignored, and a user would believe it in force."""
    parser = build_parser()
    for group in parser._action_groups:
        networked = (group.title or "").startswith(OFFLINE_REFUSED_GROUPS)
        for action in group._group_actions:
            flag = action.option_strings[0] if action.option_strings else ""
            if not (networked or flag in OFFLINE_REFUSED):
                continue
            value = getattr(args, action.dest)
            if value != action.default and (networked or value != OFFLINE_REFUSED[flag]):
                raise UserError(
                    f"{flag}: an --offline node trains alone, with no network; it cannot honour this"
                )


def trusted_peers_from_args(args: argparse.Namespace) -> frozenset[str]:
    """--trust-peers, checked; by default the peer ids the --peers multiaddrs name (the peers the
    operator chose to join through)."""
    if args.trust_peers is None:
        return frozenset(peer_ids_of(args.peers))
    for value in args.trust_peers:
        if not value.isalnum() or not 30 <= len(value) <= 64:
            raise UserError(f"--trust-peers: {value[:70]!r} is not a peer id")
    return frozenset(args.trust_peers)


def transfer_from_args(args: argparse.Namespace) -> TransferSettings:
    chunk = round(args.state_chunk_mb * 2**20)
    if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        raise UserError(
            f"--state-chunk-mb: must be in [{MIN_CHUNK_BYTES / 2**20:g}, {MAX_CHUNK_BYTES / 2**20:g}], "
            f"got {args.state_chunk_mb:g}"
        )
    if not args.state_bandwidth_mbps > 0:
        raise UserError(f"--state-bandwidth-mbps: must be > 0, got {args.state_bandwidth_mbps:g}")
    if not args.state_timeout_floor_s > 0:
        raise UserError(f"--state-timeout-floor-s: must be > 0, got {args.state_timeout_floor_s:g}")
    if args.state_donors < 1:
        raise UserError(f"--state-donors: must be >= 1, got {args.state_donors}")
    return TransferSettings(
        chunk_bytes=chunk,
        bandwidth_bps=args.state_bandwidth_mbps * 1e6 / 8,
        timeout_floor_s=args.state_timeout_floor_s,
        donors=args.state_donors,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_settings(build_parser(), argv)
    except UserError as e:
        return usage_error(e)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    dump_stacks_on_sigusr1()
    try:
        run(args)
    except UserError as e:
        return usage_error(e)
    except NetworkLost as e:
        print(f"adloco-node: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("adloco-node: interrupted", file=sys.stderr)
        return 130
    return 0


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to the process's stderr: what a node that seems
    stuck is doing. Skipped where that stderr is no file (the node's main called in-process)."""
    stderr = sys.__stderr__
    try:
        if stderr is not None:
            faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
    except (OSError, ValueError):  # io.UnsupportedOperation is both: a stream with no descriptor
        pass


def usage_error(e: UserError) -> int:
    """Bad input: one line naming the option, exit code 2."""
    print(f"adloco-node: error: {e}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> None:
    """Check the flags, then train alone (--offline) or in the swarm until the rounds are done or stopped."""
    if args.rounds < 0:
        raise UserError(f"--rounds: must be >= 0 (0 trains until stopped), got {args.rounds}")
    set_threads(args.threads)
    if args.host_allocator == "lean":
        lean_allocator()
    cfg = train_config_from_args(args)
    if not args.offline:
        cfg = swarm_train_config(cfg, args)
    stop = threading.Event()
    if args.offline:
        offline_refusal(args)
        check_checkpoint_args(args)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        train_solo(
            cfg,
            rounds=args.rounds,
            on_round=lambda r: print(format_round("local", r), flush=True),
            should_stop=stop.is_set,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
        )
    else:
        swarm = swarm_from_args(args)
        check_control(args)
        metrics = metrics_from_args(args)
        run_swarm_node(cfg, network_from_args(args), swarm, stop, metrics, args)


def swarm_train_config(cfg: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """`cfg` as a swarm node runs it: every answer checked (`TrainConfig.checked_answers`), and in a
    public run (no --run-owner, no --allow-peers) without --aggregate, `PUBLIC_AGGREGATE`: a public
    run's defaults defend it. A public run refuses the trimmed mean, the one rule whose answers no
    member can check beyond their norm; a private run, whose peers its owner admits, may take it."""
    public = args.run_owner is None and args.allow_peers is None
    rule = PUBLIC_AGGREGATE if args.aggregate is None and public else cfg.aggregate
    if public and rule.startswith("trimmed"):
        raise UserError(
            f"--aggregate {rule}: members can check a trimmed mean's answers only against a norm bound, so"
            f" in a public run one hostile owner could answer anything that small; use mean or clip:c (the"
            f" default, {PUBLIC_AGGREGATE}), or run privately (--run-owner or --allow-peers)"
        )
    try:
        checked = replace(cfg, aggregate=rule, checked_answers=True)
    except ValueError as e:
        default = (
            f" (a public run's default --aggregate is {PUBLIC_AGGREGATE})" if rule != cfg.aggregate else ""
        )
        raise UserError(f"--downlink: {e}{default}") from None
    return _checked_codecs(checked) if public else checked


def _checked_codecs(cfg: TrainConfig) -> TrainConfig:
    """A public run's codecs: those whose answers a member checks beyond their norm. A low-rank
    answer, or a sparse one re-encoded (under a robust rule), bounds no error of its own
    (`codecs.error_bound`): members could check it against a norm bound only, as the trimmed mean.
    The adaptive codec chooses among the others; one given outright is refused."""

    def checkable(spec: str) -> bool:
        return not spec.startswith(("lowrank", "sparse")) or cfg.downlink_of(spec) == "gather"

    if cfg.codec == "adaptive":
        return replace(cfg, codec_candidates=tuple(s for s in cfg.codec_candidates if checkable(s)))
    if not checkable(cfg.codec):
        raise UserError(
            f"--codec {cfg.codec}: members can check an owner's answer of this codec only against a norm"
            " bound (it bounds no error of its own), so in a public run one hostile owner could answer"
            " anything that small; use int8 (the default), int4, fp16 or none, a sparse codec with"
            " --aggregate mean (its contributions gathered, checked exactly), or run privately"
            " (--run-owner or --allow-peers)"
        )
    return cfg


def check_control(args: argparse.Namespace) -> None:
    """The control service's flags, checked before any networking starts (-1: no service)."""
    if args.control_port != -1:
        check_bind(args.control_host, args.control_port, allow_remote=args.control_allow_remote)


def metrics_from_args(args: argparse.Namespace) -> NodeMetrics:
    """The node's metrics, served on --metrics-port if given (checked before any networking starts)."""
    metrics = NodeMetrics()
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port < 65536:
            raise UserError(f"--metrics-port: must be in [0, 65535], got {args.metrics_port}")
        metrics.serve(args.metrics_port, args.metrics_host)
    return metrics


def run_swarm_node(
    cfg: TrainConfig,
    net: NetworkConfig,
    swarm: SwarmConfig,
    stop: threading.Event,
    metrics: NodeMetrics,
    args: argparse.Namespace,
) -> None:
    """Join (or start) the swarm and train until the rounds are done, a drain, or SIGTERM/SIGINT."""
    try:
        node = SwarmNode(cfg, net, swarm, metrics)
    except ValueError as e:  # networking failures (port in use, unreachable peers) name the option
        raise UserError(str(e)) from None
    # Only now: the DHT process has forked and must not inherit these handlers (see dht_bootstrap).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    control = None
    try:
        announce(node, net)
        control = start_control(node, args)
        node.on_round = lambda record: print(format_round(node.peer_id[-6:], record), flush=True)
        node.run(should_stop=stop.is_set)
    finally:
        node.shutdown()
        if control is not None:
            control.stop(grace=1.0)


def announce(node: SwarmNode, net: NetworkConfig) -> None:
    """Print how others can join this node and whether they can dial it (also in the status file)."""
    print("adloco-node: joined as " + node.peer_id + "; others can join with:", flush=True)
    print("  --peers " + " ".join(node.maddrs), flush=True)
    reach = reachability.check(node.maddrs, client_mode=net.client_mode)
    print("adloco-node: " + reach.message(port_map=net.nat_port_map, relay=net.use_relay), flush=True)
    node.status.write("reachability", reachable=reach.reachable, public=list(reach.public))


def start_control(node: SwarmNode, args: argparse.Namespace) -> ControlServer | None:
    """The node's control service, serving (None with --control-port -1)."""
    if args.control_port == -1:
        return None
    # After the DHT forked: gRPC's threads and fork do not mix.
    control = ControlServer(
        status=node.ops.node_status,
        drain=node.ops.request_drain,
        checkpoint=node.ops.request_checkpoint,
        host=args.control_host,
        port=args.control_port,
        allow_remote=args.control_allow_remote,
    )
    control.start()
    print(f"adloco-node: control service on {control.address} (adloco-node ctl status)", flush=True)
    return control


if __name__ == "__main__":
    sys.exit(main())
