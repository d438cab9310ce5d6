"""Issue 11 §4, the averaging step against hivemind's own: our all-reduce and hivemind's
`DecentralizedAverager`, on the same three peers with the same payload, loopback and shaped.

Three peer processes, each on a host of its own (`netlan.Star`: a veth to a bridge, tbf-shaped on
both ends at `--rate-mbit`) or all three on one isolated loopback (`netlan.Loopback`). Every peer
runs both sides, each on its own DHT and p2pd: ours, `HivemindAverager` (our matchmaking through
DHT records, owner-sharded reduction, our stream framing) with the fp16 codec; and hivemind 1.1's
`DecentralizedAverager` (its matchmaking, its butterfly all-reduce) with `Float16Compression`, the
pairing hivemind's own benchmarks/benchmark_averaging.py uses, with its defaults otherwise,
`target_group_size = min_group_size = 3`. Both are given the same matchmaking window
(`min_matchmaking_time` = our `window_s`, 5 s: hivemind's default; hivemind's benchmark's
`request_timeout` of 1 s). The payload is a Llama-shaped tensor set (embedding, head, per layer
q/k/v/o, gate/up/down, norms) of P parameters, 2P bytes at fp16; each peer's tensors are random,
and every result is checked against the mean of the three peers' inputs.

Rounds alternate ours / hivemind, a warm-up round of each first (connections are dialled there; it
is reported, not counted). The orchestrator starts every round at one wall-clock instant on all
peers, and measures:
- seconds per all-reduce, matchmaking excluded: from the first member of the group knowing its
  group to the last member holding the averaged tensors. Ours: the "grouped" stage (our
  matchmaking returned, after window and grace) to `average` returned and the result decoded
  into the tensors, plus the fp16 encoding done before the call (so ours is never flattered by
  encoding during the window); hivemind: its `StepControl.stage` turning `RUNNING_ALLREDUCE`
  (set by the averager process right after matchmaking, read from shared memory, polled every
  millisecond) to `step`'s result in the caller (its tensors already updated in place). Also the
  whole step from the call, matchmaking included (ours waits its whole window; hivemind starts as
  soon as its group is full), and ours split into encode, exchange (`Traffic.exchange_s`: group
  formed to last answer; `parts_in_s`, its first phase: group formed to the last owner holding
  every member's parts) and decode.
- a round counts only if every member's result is within `ATOL` of the true mean: hivemind can
  return a partial average (a part whose reducer failed stays unaveraged, with only a "received
  N% results" warning); such rounds are listed as `rounds_off_the_mean`, not timed.
- wire bytes per member: each host's link counters (`ip -s link`) across the round, everything
  the peer's processes (python and p2pd) put on the link: payload, libp2p encryption and
  multiplexing, matchmaking and DHT traffic, retransmissions. Reported as TCP payload (headers
  subtracted per packet, `netlan.TCP_HEADER_BYTES`) and as raw link bytes; on loopback, `lo`'s total
  over n. Ours also from the transport's own stream counters (`Traffic.wire_sent`, our framing
  included, libp2p's not). The bound is 2(n−1)/n × 2P per member (its parts up, the averages of its
  share down to the others); ours assigns whole tensors to owners, so the mean member meets it and
  the busiest exceeds it by its share's imbalance (reported as the max).

Without root (no namespaces) the peers run on the machine's loopback and only ours' stream bytes
are measured. `run(quick, seeds, out)` is what `adloco-bench` calls.

    python -m adloco.bench.allreduce --out /tmp/allreduce            # loopback and 100 Mbit/s
    python -m adloco.bench.allreduce --quick --out /tmp/allreduce    # tiny, loopback only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import netlan

N_PEERS = 3
WINDOW_S = 5.0  # hivemind's default min_matchmaking_time, given to both sides
REQUEST_TIMEOUT_S = 1.0  # hivemind's benchmark_averaging.py: below the window, as hivemind advises
RATE_MBIT = 100.0
CHECK_ELEMENTS = 4096  # per tensor: the slice every result is checked on against the true mean
ATOL = 2e-2  # fp16 out and fp16 back, values ~N(0, 1): both sides land well within this
OURS, HIVEMIND = "ours", "hivemind"
TABLE_BYTES = (
    "bytes_per_member",
    "bytes_per_member_max",
    "bytes_over_bound",
    "link_bytes_per_member",
    "stream_bytes_per_member",
    "stream_bytes_over_bound",
)
CODECS = {OURS: "fp16 (adloco codecs.Fp16Codec)", HIVEMIND: "hivemind.compression.Float16Compression"}
DHT_KWARGS: dict[str, Any] = {
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
    "use_auto_relay": False,
}


def llama_shapes(d: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of an untied Llama with MLP width 4d (as node/model/model.py)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"l{i}.{name}"] = (d, d)
        shapes[f"l{i}.gate"] = (4 * d, d)
        shapes[f"l{i}.up"] = (4 * d, d)
        shapes[f"l{i}.down"] = (d, 4 * d)
        shapes[f"l{i}.norm1"] = (d,)
        shapes[f"l{i}.norm2"] = (d,)
    shapes["norm"] = (d,)
    shapes["head"] = (vocab, d)
    return shapes


FULL_SHAPES = llama_shapes(512, 2, 8192)  # 16.8M parameters, 33.6 MB at fp16
QUICK_SHAPES = llama_shapes(64, 1, 256)  # 82k parameters


def num_params(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ---- one peer (a process of its own, in its host's namespace) --------------------------------------


def _tensors(shapes: dict[str, tuple[int, ...]], seed: int, peer: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + peer)
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _check_slices(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: t.reshape(-1)[:CHECK_ELEMENTS].clone() for k, t in tensors.items()}


class Peer:
    """Both averagers of one peer, driven by commands on stdin (JSON lines), answering on stdout."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        # torch's thread defaults left alone: hivemind's averager process and ours get the same.
        self.index = args.index
        self.shapes = {k: tuple(v) for k, v in json.loads(args.shapes).items()}
        self.own = _tensors(self.shapes, args.seed, self.index)
        self.result = {k: torch.empty_like(t) for k, t in self.own.items()}
        inputs = (
            self.own if p == self.index else _tensors(self.shapes, args.seed, p) for p in range(args.peers)
        )
        slices = [_check_slices(tensors) for tensors in inputs]
        self.expected = {k: sum(s[k] for s in slices) / args.peers for k in self.shapes}
        self.maddrs = [f"/ip4/{args.addr}/tcp/0"]
        self.grouped: dict[int, float] = {}
        self.reducing: dict[int, float] = {}  # as an owner: every member's parts in, before it reduces
        self._build_hivemind(args)
        self._build_ours(args)

    def _build_hivemind(self, args: argparse.Namespace) -> None:
        import hivemind
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Float16Compression

        self.hm_dht = hivemind.DHT(
            start=True, host_maddrs=self.maddrs, initial_peers=json.loads(args.hm_peers), **DHT_KWARGS
        )
        self.hm_tensors = [t.clone() for t in self.own.values()]
        self.hm = DecentralizedAverager(
            self.hm_tensors,
            self.hm_dht,
            start=True,
            prefix="adloco_bench_allreduce",
            target_group_size=args.peers,
            min_group_size=args.peers,
            min_matchmaking_time=args.window_s,
            request_timeout=args.request_timeout_s,
            compression=Float16Compression(),
        )

    def _build_ours(self, args: argparse.Namespace) -> None:
        from adloco.protocol.algorithms.codecs import make_codec
        from adloco.protocol.transport.hivemind_averager import HivemindAverager
        from adloco.protocol.transport.identity import NodeDHT

        peers = json.loads(args.ours_peers)
        self.dht = NodeDHT(start=True, host_maddrs=self.maddrs, initial_peers=peers, **DHT_KWARGS)
        self.codec = make_codec("fp16")
        self.ours = HivemindAverager(
            self.dht, prefix="adloco-bench-allreduce", window_s=args.window_s, on_stage=self._on_stage
        )

    def _on_stage(self, stage: str, round: int) -> None:
        if stage == "grouped":
            self.grouped[round] = time.time()
        elif stage == "reducing":
            self.reducing[round] = time.time()

    def hello(self) -> dict[str, Any]:
        return {
            "ready": True,
            "ours_maddrs": [str(m) for m in self.dht.get_visible_maddrs()],
            "hm_maddrs": [str(m) for m in self.hm_dht.get_visible_maddrs()],
            "pid": os.getpid(),
        }

    def _error(self, result: dict[str, Any]) -> float:
        return max(
            float((result[k].reshape(-1)[:CHECK_ELEMENTS] - e).abs().max()) for k, e in self.expected.items()
        )

    def round_ours(self, round: int, at: float) -> dict[str, Any]:
        from adloco.protocol.algorithms.allreduce import Contribution
        from adloco.protocol.algorithms.codecs import encode_tensors
        from adloco.protocol.algorithms.report import PeerReport

        t0 = time.perf_counter()
        payloads = encode_tensors(self.codec, self.own)
        encode_s = time.perf_counter() - t0
        report = PeerReport(
            peer_id=self.ours.peer_id, slot_stats=(None,), b_max=4, tokens=1, base_round=round
        )
        contribution = Contribution(
            self.ours.peer_id, payloads, weight=1.0, tokens=1.0, metadata=report.encode()
        )
        timeout = self.ours.call_timeout_s(sum(len(p) for p in payloads.values()))
        _sleep_until(at)
        called = time.time()
        result = self.ours.average(contribution, round=round, codec=self.codec, timeout=timeout)
        if result is None:
            return {"ok": False, "called": called, "done": time.time(), "why": "average returned None"}
        returned = time.time()
        averaged = result.decoded()
        for key, tensor in self.result.items():  # into tensors, as hivemind updates its own in place
            tensor.copy_(averaged[key])
        done = time.time()
        t = result.traffic
        return {
            "ok": True,
            "members": len(result.members),
            "called": called,
            "start": self.grouped[round],
            "reducing": self.reducing.get(round),
            "done": done,
            "encode_s": encode_s,
            "decode_s": done - returned,
            "max_err": self._error(self.result),
            "wire_sent": t.wire_sent,
            "wire_received": t.wire_received,
            "payload_sent": t.payload_sent,
            "exchange_s": t.exchange_s,
        }

    def round_hivemind(self, at: float) -> dict[str, Any]:
        from hivemind.averaging.control import AveragingStage

        with self.hm.get_tensors() as tensors:  # each round averages the peers' own inputs again
            for mine, tensor in zip(self.own.values(), tensors, strict=True):
                tensor.copy_(mine)
        _sleep_until(at)
        called = time.time()
        control = self.hm.step(weight=1.0, timeout=120.0, wait=False)
        while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
            time.sleep(0.001)
        start = time.time()
        seen = not control.done()
        try:
            gathered = control.result(timeout=300.0)
        except Exception as e:  # hivemind raises what its all-reduce raised
            return {"ok": False, "called": called, "done": time.time(), "why": repr(e)}
        done = time.time()
        if gathered is None:
            return {"ok": False, "called": called, "done": done, "why": "step returned None"}
        with self.hm.get_tensors() as tensors:
            err = self._error(dict(zip(self.own, tensors, strict=True)))
        return {
            "ok": True,
            "members": len(gathered),
            "called": called,
            "start": start,
            "done": done,
            "stage_seen": seen,
            "max_err": err,
        }

    def shutdown(self) -> None:
        for stop in (self.hm.shutdown, self.hm_dht.shutdown, self.ours.shutdown, self.dht.shutdown):
            with contextlib.suppress(Exception):
                stop()


def _sleep_until(at: float) -> None:
    delay = at - time.time()
    if delay > 0:
        time.sleep(delay)


def peer_main(args: argparse.Namespace) -> None:
    # Answers go on a private copy of stdout; everything else (hivemind's logs, p2pd) on stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")

    peer = Peer(args)
    try:
        say(peer.hello())
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["side"] == "quit":
                break
            if cmd["side"] == OURS:
                say({"side": OURS, **peer.round_ours(cmd["round"], cmd["at"])})
            else:
                say({"side": HIVEMIND, **peer.round_hivemind(cmd["at"])})
    finally:
        peer.shutdown()


# ---- the orchestrator ------------------------------------------------------------------------------


@dataclass
class Worker:
    """One peer process and a thread reading its answers."""

    proc: subprocess.Popen[str]
    answers: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.answers.put(json.loads(line))
        self.answers.put(None)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float, log: Path) -> dict[str, Any]:
        try:
            got = self.answers.get(timeout=timeout)
        except queue.Empty:
            got = None
        if got is None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(
                f"peer process {self.proc.pid} gave no answer (exit {self.proc.poll()}):\n{tail}"
            )
        return got


class Peers:
    """The peer processes of one setting; `close()` kills every process group they lead."""

    def __init__(self, lan: netlan.Lan | None, logs: Path) -> None:
        self.lan = lan
        self.logs = logs
        self.workers: list[Worker] = []

    def start(self, index: int, argv: Sequence[str]) -> Worker:
        command = list(argv) if self.lan is None else self.lan.exec_argv(index, argv)
        log = open(self.logs / f"peer{index}.log", "w")  # noqa: SIM115  # closed with the process
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        log.close()  # the child holds its own copy
        worker = Worker(proc)
        self.workers.append(worker)
        return worker

    def answer(self, index: int, timeout: float) -> dict[str, Any]:
        return self.workers[index].answer(timeout, self.logs / f"peer{index}.log")

    def close(self) -> list[int]:
        """Ask every peer to shut down, then SIGKILL each group; returns pids that outlived it."""
        from adloco.node.cli.processes import group_members

        for worker in self.workers:
            with contextlib.suppress(OSError, ValueError):
                worker.send({"side": "quit"})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(0.1)
        for worker in self.workers:  # p2pd and hivemind's child processes share the group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        leftover = [p for w in self.workers for p in group_members(w.proc.pid)]
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = [p for w in self.workers for p in group_members(w.proc.pid)]
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)
        return leftover


@dataclass
class Setting:
    name: str
    rate_mbit: float | None  # None: loopback
    shapes: dict[str, tuple[int, ...]]
    rounds: int  # measured rounds per side, after one warm-up round each
    window_s: float
    request_timeout_s: float


def _peer_argv(
    index: int, addr: str, setting: Setting, seed: int, ours: list[str], hm: list[str]
) -> list[str]:
    return [
        sys.executable, "-m", "adloco.bench.allreduce", "--peer", "--index", str(index), "--addr", addr,
        "--peers", str(N_PEERS), "--shapes", json.dumps(setting.shapes), "--seed", str(seed),
        "--window-s", str(setting.window_s), "--request-timeout-s", str(setting.request_timeout_s),
        "--ours-peers", json.dumps(ours), "--hm-peers", json.dumps(hm),
    ]  # fmt: skip


def _start_peers(peers: Peers, addrs: list[str], setting: Setting, seed: int) -> None:
    peers.start(0, _peer_argv(0, addrs[0], setting, seed, [], []))
    hello = peers.answer(0, timeout=180)
    ours, hm = hello["ours_maddrs"], hello["hm_maddrs"]
    for i in range(1, N_PEERS):
        peers.start(i, _peer_argv(i, addrs[i], setting, seed, ours, hm))
    for i in range(1, N_PEERS):
        peers.answer(i, timeout=180)


def _round(
    peers: Peers, side: str, round: int, counts: Callable[[], list[netlan.LinkCount]] | None
) -> dict[str, Any]:
    before = counts() if counts else None
    at = time.time() + 0.5
    for worker in peers.workers:
        worker.send({"side": side, "round": round, "at": at})
    answers = [peers.answer(i, timeout=600) for i in range(len(peers.workers))]
    time.sleep(0.3)  # the last ACKs
    after = counts() if counts else None
    ok = all(a["ok"] and a["members"] == N_PEERS for a in answers)
    record: dict[str, Any] = {"side": side, "round": round, "ok": ok, "answers": answers}
    if not ok:
        return record
    # A result off the true mean (a part some member kept unaveraged) fails the round.
    record["max_err"] = max(a["max_err"] for a in answers)
    record["ok"] = record["max_err"] <= ATOL
    encode_s = max(a.get("encode_s", 0.0) for a in answers)
    span_s = max(a["done"] for a in answers) - min(a["start"] for a in answers)
    record.update(
        allreduce_s=span_s + encode_s,
        member_s=statistics.median(a["done"] - a["start"] for a in answers),
        step_s=max(a["done"] for a in answers) - min(a["called"] for a in answers),
    )
    if side == OURS:  # where ours spends it: encode, group formed -> last answer, decode
        record["encode_s"] = encode_s
        record["exchange_s"] = max(a["exchange_s"] for a in answers)
        record["decode_s"] = max(a["decode_s"] for a in answers)
        if all(a.get("reducing") for a in answers):  # the exchange's first phase: parts to owners
            record["parts_in_s"] = max(a["reducing"] for a in answers) - min(a["start"] for a in answers)
    if before is not None and after is not None:
        deltas = [b - a for a, b in zip(before, after, strict=True)]
        record["link_tx_payload"] = [d.tx_payload for d in deltas]
        record["link_tx_bytes"] = [d.tx_bytes for d in deltas]
        record["link_rx_payload"] = [d.rx_payload for d in deltas]
    if side == OURS:
        record["stream_sent"] = [a["wire_sent"] for a in answers]
        record["payload_sent"] = [a["payload_sent"] for a in answers]
    return record


def _per_member(record: dict[str, Any], key: str) -> tuple[float, float] | None:
    """(mean, max) bytes per member of a round; one count for all members (loopback) gives the mean."""
    values = record.get(key)
    if values is None:
        return None
    if len(values) == 1:
        return values[0] / N_PEERS, math.nan
    return statistics.fmean(values), max(values)


def _summary(records: list[dict[str, Any]], side: str, bound: float) -> dict[str, Any]:
    mine = [r for r in records if r["side"] == side and not r["warmup"]]
    good = [r for r in mine if r["ok"]]
    out: dict[str, Any] = {"side": side, "codec": CODECS[side], "rounds": len(mine), "rounds_ok": len(good)}
    wrong = [r["round"] for r in records if r["side"] == side and not r["ok"] and "max_err" in r]
    out["rounds_off_the_mean"] = wrong  # warm-up included
    if not good:
        return out
    for key in ("allreduce_s", "member_s", "step_s", "encode_s", "exchange_s", "decode_s", "parts_in_s"):
        values = [r[key] for r in good if key in r]
        if not values:
            continue
        out[f"{key}_median"] = statistics.median(values)
        out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    out["max_abs_err"] = max(r["max_err"] for r in good)
    for key, name in (
        ("link_tx_payload", "bytes"),
        ("link_tx_bytes", "link_bytes"),
        ("stream_sent", "stream_bytes"),
    ):
        pairs = [p for r in good if (p := _per_member(r, key)) is not None]
        if pairs:
            out[f"{name}_per_member"] = statistics.median(p[0] for p in pairs)
            busiest = [p[1] for p in pairs if not math.isnan(p[1])]
            out[f"{name}_per_member_max"] = statistics.median(busiest) if busiest else None
            out[f"{name}_over_bound"] = out[f"{name}_per_member"] / bound
    return out


def run_setting(setting: Setting, seed: int, logs: Path) -> dict[str, Any]:
    """One layout (loopback or shaped), fresh peers, alternating rounds; every process and
    namespace it made is gone when it returns or raises."""
    logs.mkdir(parents=True, exist_ok=True)
    why = netlan.available()
    lan: netlan.Lan | None = None
    if why is None:
        netlan.remove_stale()
        lan = (
            netlan.Loopback(N_PEERS)
            if setting.rate_mbit is None
            else netlan.Star(N_PEERS, rate_mbit=setting.rate_mbit)
        )
    elif setting.rate_mbit is not None:
        return {"setting": setting.name, "skipped": why}
    peers = Peers(lan, logs)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        addrs = lan.addrs if lan is not None else ["127.0.0.1"] * N_PEERS
        _start_peers(peers, addrs, setting, seed)
        counts = lan.counts if lan is not None else None
        idle = _idle_bytes(counts, 3.0)
        for i in range(setting.rounds + 1):
            for side in (OURS, HIVEMIND) if i % 2 == 0 else (HIVEMIND, OURS):
                record = _round(peers, side, i + 1, counts)
                record["warmup"] = i == 0
                records.append(record)
                print(f"allreduce: {setting.name} {_line(record)}", flush=True)
    finally:
        leftover = peers.close()
        if lan is not None:
            lan.close()
        if leftover:
            raise RuntimeError(f"processes outlived their group's SIGKILL: {leftover}")
    payload = 2 * num_params(setting.shapes)
    bound = 2 * (N_PEERS - 1) / N_PEERS * payload
    sides = {side: _summary(records, side, bound) for side in (OURS, HIVEMIND)}
    return {
        "setting": setting.name,
        "rate_mbit": setting.rate_mbit,
        "params": num_params(setting.shapes),
        "payload_bytes": payload,
        "bound_bytes_per_member": bound,
        "window_s": setting.window_s,
        "idle_bytes_per_s_per_member": idle,
        "ours": sides[OURS],
        "hivemind": sides[HIVEMIND],
        "wall_s": time.perf_counter() - t0,
        "rounds": [{k: v for k, v in r.items() if k != "answers"} for r in records],
        "failures": [r["answers"] for r in records if not r["ok"]],
    }


def _idle_bytes(counts: Callable[[], list[netlan.LinkCount]] | None, seconds: float) -> float | None:
    """What the peers' DHTs send per second and member while nobody averages (background traffic)."""
    if counts is None:
        return None
    before = counts()
    time.sleep(seconds)
    deltas = [b - a for a, b in zip(before, counts(), strict=True)]
    members = N_PEERS if len(deltas) == 1 else 1
    return statistics.fmean(d.tx_bytes for d in deltas) / members / seconds


def _line(record: dict[str, Any]) -> str:
    head = f"{record['side']:8s} round {record['round']}{' (warm-up)' if record['warmup'] else ''}: "
    if "max_err" in record and record["max_err"] > ATOL:
        return head + f"FAILED: a result is {record['max_err']:.2f} off the mean (tolerance {ATOL})"
    if not record["ok"]:
        return head + "FAILED " + "; ".join(str(a.get("why", a.get("members"))) for a in record["answers"])
    sent = record.get("link_tx_payload") or record.get("stream_sent")
    return head + (
        f"all-reduce {record['allreduce_s']:.2f} s, step {record['step_s']:.2f} s, "
        f"sent {sent} B, max err {record['max_err']:.1e}"
    )


def run(
    quick: bool, seeds: list[int], out: Path, *, rate_mbit: float = RATE_MBIT, rounds: int | None = None
) -> dict[str, Any]:
    """Loopback (and, unless quick, shaped at `rate_mbit`): ours vs hivemind's DecentralizedAverager.

    Timings are medians over rounds (`rounds` per side, default 6; quick 2) of one run with tensors
    from seeds[0]: the payload's values do not change either side's work.
    """
    seed = seeds[0]
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    rounds = rounds or (2 if quick else 6)
    window, request = (2.0, REQUEST_TIMEOUT_S) if quick else (WINDOW_S, REQUEST_TIMEOUT_S)
    settings = [Setting("loopback", None, shapes, rounds, window, request)]
    if not quick:
        settings.append(Setting(f"shaped {rate_mbit:g} Mbit/s", rate_mbit, shapes, rounds, window, request))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for i, setting in enumerate(settings):  # the peers' logs stay, next to the figures
        results.append(run_setting(setting, seed, out / "allreduce-logs" / f"setting{i}"))
    result = _headline(results)
    result["wall_s"] = time.perf_counter() - t0
    (out / "allreduce.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _headline(results: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [
        r
        for r in results
        if "skipped" not in r and r["ours"].get("rounds_ok") and r["hivemind"].get("rounds_ok")
    ]
    main = next(
        (r for r in reversed(measured) if r["rate_mbit"] is not None), measured[0] if measured else None
    )
    table = []
    for r in results:
        if "skipped" in r:
            table.append({"setting": r["setting"], "skipped": r["skipped"]})
            continue
        for side in (OURS, HIVEMIND):
            s = r[side]
            row = {"setting": r["setting"], "side": side, "codec": s["codec"]}
            row["rounds_ok"] = f"{s['rounds_ok']}/{s['rounds']}"
            row["allreduce_s"] = s.get("allreduce_s_median")
            row["allreduce_s_range"] = [s.get("allreduce_s_min"), s.get("allreduce_s_max")]
            row["step_s"] = s.get("step_s_median")
            for key in ("encode_s", "parts_in_s", "exchange_s", "decode_s"):  # ours only
                row[key] = s.get(f"{key}_median")
            row["rounds_off_the_mean"] = s.get("rounds_off_the_mean")
            for key in TABLE_BYTES:
                row[key] = s.get(key)
            row["bound_bytes_per_member"] = r["bound_bytes_per_member"]
            row["max_abs_err"] = s.get("max_abs_err")
            table.append(row)
    out: dict[str, Any] = {"settings": results, "table": table, "n_peers": N_PEERS, "codecs": CODECS}
    if main is None:
        why = "no setting had a correct round of both sides (allreduce.json: failures, rounds_off_the_mean)"
        out["allreduce_s_vs_hivemind_ratio"] = None
        out["skipped"] = {"allreduce_s_vs_hivemind_ratio": why}
        return out
    ours, hm = main["ours"], main["hivemind"]
    out["ratio_by_setting"] = {
        r["setting"]: r["ours"]["allreduce_s_median"] / r["hivemind"]["allreduce_s_median"] for r in measured
    }
    out.update(
        setting=main["setting"],
        allreduce_s_vs_hivemind_ratio=ours["allreduce_s_median"] / hm["allreduce_s_median"],
        ours_s=ours["allreduce_s_median"],
        hivemind_s=hm["allreduce_s_median"],
        ours_step_s=ours["step_s_median"],
        hivemind_step_s=hm["step_s_median"],
        ours_bytes_per_member=ours.get("bytes_per_member", ours.get("stream_bytes_per_member")),
        hivemind_bytes_per_member=hm.get("bytes_per_member"),
        ours_stream_bytes_per_member=ours.get("stream_bytes_per_member"),
        bound_bytes_per_member=main["bound_bytes_per_member"],
        payload_bytes=main["payload_bytes"],
        params=main["params"],
    )
    out["ours_bytes_over_bound"] = out["ours_bytes_per_member"] / out["bound_bytes_per_member"]
    hm_bytes = out["hivemind_bytes_per_member"]
    out["hivemind_bytes_over_bound"] = hm_bytes / out["bound_bytes_per_member"] if hm_bytes else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per side (default 6; quick 2)")
    ap.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    ap.add_argument("--out", type=Path)
    # One peer process (started by the orchestrator, not by hand).
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    for name in ("--index", "--peers"):
        ap.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--addr", "--shapes", "--ours-peers", "--hm-peers"):
        ap.add_argument(name, default="", help=argparse.SUPPRESS)
    for name in ("--window-s", "--request-timeout-s"):
        ap.add_argument(name, type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        peer_main(args)
        return
    if args.out is None:
        ap.error("--out is required")
    t0 = time.perf_counter()
    result = run(args.quick, [args.seed], args.out, rate_mbit=args.rate_mbit, rounds=args.rounds)
    print(json.dumps({k: v for k, v in result.items() if k not in ("settings",)}, indent=1))
    print(f"allreduce: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
