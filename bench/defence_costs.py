"""What six Byzantine defences cost in a clean run (issue 25 §2, docs/issue-25-table.md "Defence →
cost in a clean run"), at the GPT-2 124M size, each as CPU time and bytes per round and as a share
of a 124M swarm round. Every figure is measured when the script runs (medians of `--repeats`); the
round they are set against is read from `--round-from` (default
bench/results/swarm_124m_2nodes_068_phases_lean.json: `median_round_s`, `median_round_wire_bytes_sent`,
two nodes training GPT-2 124M on this 2-core CPU machine, so a CPU machine's round: ~113 s, most of
it training). The round's wire bytes are its averaging streams' (DHT traffic is not in them).

1. `claims`: an owner checking one member's claim at its request header
   (`ClaimBounds.violation` of an honest claim, the bounds from `Peer.claim_bounds` of a GPT-2 124M
   peer), per claim and per round (the other members of a group of 4 and of 16), with building the
   bounds once per round. No bytes of its own: the weight and tokens it checks travel in every
   request for the average.
2. `screening`: the owner of a third of the GPT-2 124M tensors (`parts.assign_parts` over 3 owners)
   in a group of 4 contributors, int8 payloads made by the real codec from random tensors of the
   real shapes, screening on the norms the members committed to (`round_exchange.own_facts`), as a
   network owner does (`owner.reduce_owned`): its reduction (`parts.reduce_parts`) with
   `outlier_factor=None` (off) against the default factor (on), alternating, and the difference.
   Off still rejects non-finite payloads and still computes every payload's norm: the owner compares
   it with the committed one, and the members bound the answers by the committed norms
   (`verification`), so the norms are the verified reducers' cost, timed here apart
   (`norms_s`) for scale. The screening's own work, timed apart: the owner's decision
   (`screening_work` and `screen_norms` of each owned part) and a member's recomputation of it
   (`screened_out`, what `verify.expected_factors` runs for each answer it checks; here for every
   part, the most a member checks). No bytes of its own (the norms are in the commitments).
3. `reports`: per member and round, parsing the group's reports within their bounds
   (`report.parse_reports`) and the three references bounded against the median
   (`dylu_ratio`: `DYLU_MAX_SPEEDUP`; `overlap_byte_budget`: `BUDGET_MAX_SHORTFALL`;
   `hiding_inner_steps`: `HIDE_MAX_SPREAD`), for groups of 4 and 16 reports; the bound is one
   median and one max inside these functions, so their whole time is an upper bound of its cost.
   No bytes of its own (the reports carry these figures for the schedule anyway).
4. `trust`: the bytes the work lists add to a readiness record (`matchmaking.Matchmaker._register`'s
   tuple) and to a state record (`records.StateRecord`), both as hivemind stores them (msgpack), with
   empty lists against lists of 4 and 16 real peer ids; and the CPU of `WorkLedger.count` (a round
   of a group of 4 / 16, the window full), `WorkLedger.listed`, `accepted_work` and
   `eligible_owners` (once per group formed; `trust.core`, which it runs, also runs at each read of
   the registrations while a round is open). Per round: `accepted_work` + `count` + two `listed`
   (the readiness and the state record) + one `eligible_owners`; the readiness record is read by
   every registrant several times a round (its polls), so its bytes are given per record and per read
   of a group's records.
5. `evidence`: `EvidenceBoard.read` of an empty board over real hivemind DHTs on loopback
   (`--dht-peers` of them, real p2pd): wall time per read; the reader's TCP bytes (its p2pd's sockets,
   `ss -ti` bytes_sent + bytes_received, before and after); the CPU of its three processes (this
   one, its DHT process, its p2pd; /proc) over `--reads` reads; per round at the averager's read
   period (`HivemindAverager`'s `evidence_every_s` default).
6. `catchup`: a GPT-2 124M `Peer` (one instance, seq 128, batch 2, H 2, the 124M swarm's settings)
   replays 1 and 3 kept int8 updates (the real codec, random Δs of its shapes): `catchup.catch_up`
   (θ's hash worked out on copies by `Peer.replayed_hash`, checked, then `Peer.catch_up` applies
   them) against `Peer.catch_up` alone (the same updates applied without the check), and the check
   alone; wall time and the extra peak resident memory of each (VmHWM reset through
   /proc/self/clear_refs before the call, less the RSS before it), under the lean allocator the 124M
   swarm ran (`runtime.lean_allocator`, so freed blocks leave the process). The direct path's θ hash
   must equal the hash the check worked out. A catch-up happens when a peer lags, not every round:
   its share is of one round.

From the repository root (installed as the package `adloco`), ~4 min on 2 cores:

    python -m adloco.bench.defence_costs --repeats 5 --out bench/results/defence_costs.json
    python -m adloco.bench.defence_costs --quick
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from adloco.node.training.catchup import catch_up
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.replica import PeerState, Update
from adloco.node.training.runtime import lean_allocator, load_data
from adloco.protocol.algorithms import parts, report, trust
from adloco.protocol.algorithms.batchtest import GradStats
from adloco.protocol.algorithms.claims import ClaimBounds
from adloco.protocol.algorithms.codecs import make_codec
from adloco.protocol.algorithms.report import PeerReport
from adloco.protocol.transport import round_exchange
from adloco.protocol.transport.identity import create_identity
from adloco.protocol.transport.statements import Signer

from .allreduce import DHT_KWARGS, llama_shapes, num_params
from .verify_cost import _payloads, _timed, gpt2_shapes

ROOT = Path(__file__).resolve().parents[1]
ROUND_FROM = ROOT / "bench" / "results" / "swarm_124m_2nodes_068_phases_lean.json"
GROUPS = (4, 16)


def round_figures(path: Path) -> dict[str, Any]:
    """The 124M swarm round every cost is set against (module doc)."""
    data = json.loads(path.read_text())
    return {
        "from": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "params": data["params"],
        "nodes": data["nodes"],
        "median_round_s": data["median_round_s"],
        "median_round_wire_bytes_sent": data["median_round_wire_bytes_sent"],
        "contribution_bytes": data["contribution_bytes"],
    }


def _per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """The median over `repeats` of the mean seconds of one of `calls` calls of `fn`."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _share(value: float, whole: float) -> float:
    return value / whole


# ---- 1. claim bounds -------------------------------------------------------------------------------


def claims_cost(peer: Peer, repeats: int, calls: int, rnd: dict[str, Any]) -> dict[str, Any]:
    """Part 1 of the module doc."""
    bounds = peer.claim_bounds()
    tokens = bounds.reference_tokens
    assert tokens is not None
    weight = tokens  # an honest fresh claim: its tokens at a staleness weight of 1
    assert bounds.violation(weight, tokens) is None
    check_s = _per_call(lambda: bounds.violation(weight, tokens), calls, repeats)
    build_s = _per_call(peer.claim_bounds, calls, repeats)
    per_round = {f"group_{n}": build_s + (n - 1) * check_s for n in GROUPS}
    return {
        "bounds": {"max_tokens": bounds.max_tokens, "max_weight_per_token": bounds.max_weight_per_token},
        "check_one_claim_s": check_s,
        "claim_bounds_s": build_s,
        "cpu_s_per_round": per_round,
        "share_of_round_time": {k: _share(v, rnd["median_round_s"]) for k, v in per_round.items()},
        "bytes_per_round": None,
        "bytes_note": "none of its own: it checks the weight and tokens each request carries for the average",
    }


# ---- 2. norm screening ----------------------------------------------------------------------------


def screening_cost(
    shapes: dict[str, tuple[int, ...]], bounds: ClaimBounds, repeats: int, rnd: dict[str, Any]
) -> dict[str, Any]:
    """Part 2 of the module doc."""
    contributors, owners = 4, 3
    codec = make_codec("int8")
    keys = list(shapes)
    owner_of = parts.assign_parts([codec.wire_bytes(shapes[k]) for k in keys], owners)
    mine = [k for k, o in zip(keys, owner_of, strict=True) if o == 0]
    owned = {k: shapes[k] for k in mine}
    payloads = [_payloads(owned, seed)[0] for seed in range(contributors)]
    assert all(len(payloads[0][k]) == codec.wire_bytes(shapes[k]) for k in mine)
    committed = [dict(zip(mine, round_exchange.own_facts(p)[1], strict=True)) for p in payloads]
    work_cap = bounds.reference_tokens
    assert work_cap is not None
    tokens = [work_cap] * contributors
    weights = list(tokens)
    ids = [f"member{i}" for i in range(contributors)]

    def reduce(factor: float | None) -> parts.ReducedParts:
        return parts.reduce_parts(
            mine,
            ids,
            lambda i, key: payloads[i][key],
            weights,
            tokens,
            codec,
            outlier_factor=factor,
            work_cap=work_cap,
            claimed_norms=lambda i, key: committed[i][key],
        )

    def decide() -> None:  # the owner's screening of its parts, on the committed norms
        work = parts.screening_work(tokens, work_cap)
        for k in mine:
            parts.screen_norms([c[k] for c in committed], parts.DEFAULT_OUTLIER_FACTOR, work)

    # a member's view of every part: committed norms (the owned parts' real ones, in turn)
    every = {k: [c[mine[j % len(mine)]] for c in committed] for j, k in enumerate(keys)}

    def recompute() -> None:  # a member recomputing the screening of every part it checks
        for k in keys:
            parts.screened_out(
                every[k],
                tokens,
                given={},
                outlier_factor=parts.DEFAULT_OUTLIER_FACTOR,
                work_cap=work_cap,
            )

    def norms() -> None:
        from adloco.protocol.algorithms.codecs import decode

        for p in payloads:
            for k in mine:
                parts.tensor_norm(decode(p[k]))

    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(repeats + 1):  # a warm-up of each first
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            seconds, reduced = _timed(
                partial(reduce, None if mode == "off" else parts.DEFAULT_OUTLIER_FACTOR)
            )
            assert not reduced.rejections, reduced.rejections  # a clean round rejects nothing
            if r:
                times[mode].append(seconds)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    norms_s = statistics.median(_timed(norms)[0] for _ in range(repeats))
    decide_s = _per_call(decide, 20, repeats)
    recompute_s = _per_call(recompute, 20, repeats)
    own = decide_s + recompute_s
    return {
        "contributors": contributors,
        "owners": owners,
        "parts_owned": len(mine),
        "params_owned": num_params(owned),
        "payload_bytes_owned_per_contributor": sum(len(p) for p in payloads[0].values()),
        "outlier_factor": parts.DEFAULT_OUTLIER_FACTOR,
        "reduce_s": {"off": times["off"], "on": times["on"]},
        "median_reduce_s": {"off": off, "on": on},
        "on_minus_off_s": on - off,
        "on_over_off": on / off,
        "owner_decision_s": decide_s,
        "member_recompute_all_parts_s": recompute_s,
        "norms_s": norms_s,
        "cpu_s_per_round": own,
        "share_of_round_time": _share(own, rnd["median_round_s"]),
        "reduction_difference_share_of_round_time": _share(on - off, rnd["median_round_s"]),
        "bytes_per_round": None,
        "bytes_note": "none of its own: the norms it runs on are in the members' commitments",
    }


# ---- 3. report bounds -----------------------------------------------------------------------------


def _reports(n: int) -> tuple[list[str], list[bytes]]:
    """n honest reports as peers send them: one slot's batch-test statistics, a step time, a link."""
    members = [f"12D3KooWpeer{i:04d}" + "x" * 36 for i in range(n)]
    raw = []
    for i, peer in enumerate(members):
        stats = GradStats(
            num_grads=2,
            samples_per_grad=2,
            sq_dev_sum=1.5 + 0.01 * i,
            mean_sq_norm=0.3 + 0.001 * i,
            ip_dev_sum=0.02,
            ortho_dev_sum=1.2,
        )
        raw.append(
            PeerReport(
                peer_id=peer,
                slot_stats=(stats,),
                b_max=8,
                tokens=512,
                step_time_s=5.0 + 0.1 * i,
                base_round=10,
                bandwidth_bps=1e9 * (1 + 0.05 * i),
                round_compute_s=10.0 + 0.2 * i,
            ).encode()
        )
    return members, raw


def reports_cost(repeats: int, calls: int, payload_bytes: int, rnd: dict[str, Any]) -> dict[str, Any]:
    """Part 3 of the module doc."""
    out: dict[str, Any] = {}
    for n in GROUPS:
        members, raw = _reports(n)
        parsed, dropped = report.parse_reports(members, raw)
        assert len(parsed) == n and not dropped
        me = members[0]
        parse_s = _per_call(partial(report.parse_reports, members, raw), calls, repeats)
        bounded: dict[str, Callable[[], Any]] = {
            "dylu_ratio": partial(report.dylu_ratio, parsed, me),
            "overlap_byte_budget": partial(report.overlap_byte_budget, parsed, group_size=n),
            "hiding_inner_steps": partial(
                report.hiding_inner_steps,
                parsed,
                payload_bytes=payload_bytes,
                group_size=n,
                min_steps=1,
                max_steps=500,
            ),
        }
        seconds = {name: _per_call(fn, calls, repeats) for name, fn in bounded.items()}
        total = parse_s + sum(seconds.values())
        out[f"group_{n}"] = {
            "parse_reports_s": parse_s,
            "bounded_references_s": seconds,
            "report_bytes": statistics.median(len(r) for r in raw),
            "cpu_s_per_round": total,
            "share_of_round_time": _share(total, rnd["median_round_s"]),
        }
    out["bytes_per_round"] = None
    out["bytes_note"] = "none of its own: the reports carry these figures for the schedule anyway"
    out["bounds"] = {
        "DYLU_MAX_SPEEDUP": report.DYLU_MAX_SPEEDUP,
        "BUDGET_MAX_SHORTFALL": report.BUDGET_MAX_SHORTFALL,
        "HIDE_MAX_SPREAD": report.HIDE_MAX_SPREAD,
    }
    return out


# ---- 4. trust by work -----------------------------------------------------------------------------


def trust_cost(repeats: int, calls: int, rnd: dict[str, Any]) -> dict[str, Any]:
    """Part 4 of the module doc."""
    from hivemind.utils.serializer import MSGPackSerializer

    from adloco.protocol.transport.matchmaking import MAX_PATIENCE_S, expectation
    from adloco.protocol.transport.records import StateRecord

    most = max(GROUPS)
    with tempfile.TemporaryDirectory() as folder:
        ids = [Signer(create_identity(f"{folder}/k{i}")).peer_id for i in range(most + 1)]
    me, others = ids[0], ids[1:]
    schedule = json.dumps({"batch": [2], "inner_steps": 2, "instances": 1, "codec": "int8"}, sort_keys=True)

    def readiness(workers: list[str]) -> bytes:  # Matchmaker._register's value, as the DHT stores it
        value: tuple[Any, ...] = (
            time.time(),
            me,
            expectation(ids[:4]),
            min(MAX_PATIENCE_S, 6.0),
            [],
            workers,
        )
        return bytes(MSGPackSerializer.dumps(value))

    def state(workers: list[str]) -> bytes:
        record = StateRecord(
            peer_id=me,
            round=1234,
            theta_hash="ab" * 32,
            schedule=schedule,
            manifest_hash="cd" * 32,
            manifest_bytes=9000,
            workers=workers,
        )
        return bytes(MSGPackSerializer.dumps(record.dict()))

    sizes: dict[str, Any] = {"readiness_empty": len(readiness([])), "state_empty": len(state([]))}
    bytes_out: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    wire = rnd["median_round_wire_bytes_sent"]
    for n in GROUPS:
        listed = others[:n]
        extra_ready = len(readiness(listed)) - sizes["readiness_empty"]
        extra_state = len(state(listed)) - sizes["state_empty"]
        bytes_out[f"lists_of_{n}"] = {
            "readiness_record_bytes": len(readiness(listed)),
            "readiness_added_bytes": extra_ready,
            "state_record_bytes": len(state(listed)),
            "state_added_bytes": extra_state,
            # a read of a group of n registrations carries n such lists
            "added_bytes_per_read_of_n_registrations": n * extra_ready,
            "share_of_round_bytes_per_read": _share(n * extra_ready, wire),
            "share_of_round_bytes_one_store_each": _share(extra_ready + extra_state, wire),
        }
        members = [me, *others[: n - 1]]
        ledger = trust.WorkLedger()
        work = dict.fromkeys(members, 512.0)
        for _ in range(2 * trust.WORK_ROUNDS):  # the window full, every member listed
            ledger.count(work, me=me)
        assert len(ledger.listed()) == n - 1
        lists = {m: [p for p in members if p != m] for m in members}
        seed = b"s" * 16
        timed = {
            "accepted_work_s": _per_call(partial(trust.accepted_work, work, {}, 148), calls, repeats),
            "ledger_count_s": _per_call(partial(ledger.count, work, me=me), calls, repeats),
            "ledger_listed_s": _per_call(ledger.listed, calls, repeats),
            "eligible_owners_s": _per_call(
                partial(trust.eligible_owners, members, lists, seed=seed),
                calls,
                repeats,
            ),
        }
        per_round = (
            timed["accepted_work_s"]
            + timed["ledger_count_s"]
            + 2 * timed["ledger_listed_s"]
            + timed["eligible_owners_s"]
        )
        cpu[f"group_{n}"] = timed | {
            "cpu_s_per_round": per_round,
            "share_of_round_time": _share(per_round, rnd["median_round_s"]),
        }
    return {
        "empty": sizes,
        "bytes": bytes_out,
        "cpu": cpu,
        "window": {"WORK_ROUNDS": trust.WORK_ROUNDS, "MAX_WORKERS": trust.MAX_WORKERS},
    }


# ---- 5. evidence board ----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tcp_bytes(pid: int) -> dict[tuple[str, str], int]:
    """bytes_sent + bytes_received of each established TCP socket of process `pid` (`ss -tinp`)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, str], int] = {}
    lines = out.splitlines()
    for head, info in zip(lines[::2], lines[1::2], strict=False):
        if f"pid={pid}," not in head:
            continue
        cols = head.split()
        sent = re.search(r"bytes_sent:(\d+)", info)
        received = re.search(r"bytes_received:(\d+)", info)
        found[(cols[3], cols[4])] = int(sent.group(1) if sent else 0) + int(
            received.group(1) if received else 0
        )
    return found


def evidence_cost(peers: int, reads: int, repeats: int, rnd: dict[str, Any]) -> dict[str, Any]:
    """Part 5 of the module doc."""
    from adloco.protocol.transport.evidence import EvidenceBoard
    from adloco.protocol.transport.hivemind_averager import HivemindAverager
    from adloco.protocol.transport.identity import NodeDHT

    period = inspect.signature(HivemindAverager.__init__).parameters["evidence_every_s"].default
    local = ["/ip4/127.0.0.1/tcp/0"]
    dhts = [NodeDHT(start=True, host_maddrs=local, **DHT_KWARGS)]
    first = dhts[0].get_visible_maddrs()
    dhts += [
        NodeDHT(initial_peers=first, start=True, host_maddrs=local, **DHT_KWARGS) for _ in range(peers - 1)
    ]
    reader = dhts[-1]
    try:
        (p2pd,) = [c for c in _children(reader.pid) if Path(f"/proc/{c}/comm").read_text().strip() == "p2pd"]
        board = EvidenceBoard(reader, prefix="defence-costs", ttl_s=600.0)
        procs = [os.getpid(), reader.pid, p2pd]

        async def batch() -> list[float]:
            walls = []
            for _ in range(reads):
                t0 = time.perf_counter()
                assert await board.read() == []
                walls.append(time.perf_counter() - t0)
            return walls

        asyncio.run(batch())  # warm-up: connections made, routing tables filled
        wall: list[float] = []
        per_read_bytes: list[float] = []
        per_read_cpu: list[float] = []
        for _ in range(repeats):
            before_bytes, before_cpu = _tcp_bytes(p2pd), [_cpu_s(p) for p in procs]
            wall += asyncio.run(batch())
            after_bytes, after_cpu = _tcp_bytes(p2pd), [_cpu_s(p) for p in procs]
            moved = sum(v - before_bytes.get(k, 0) for k, v in after_bytes.items())
            per_read_bytes.append(moved / reads)
            per_read_cpu.append(sum(a - b for a, b in zip(after_cpu, before_cpu, strict=True)) / reads)
    finally:
        for d in reversed(dhts):
            d.shutdown()
    per_round_reads = rnd["median_round_s"] / period
    read_bytes, read_cpu = statistics.median(per_read_bytes), statistics.median(per_read_cpu)
    return {
        "dht_peers": peers,
        "reads_per_repeat": reads,
        "read_period_s": period,
        "reads_per_round": per_round_reads,
        "median_read_wall_s": statistics.median(wall),
        "bytes_per_read": read_bytes,
        "cpu_s_per_read": read_cpu,
        "cpu_s_per_read_samples": per_read_cpu,
        "bytes_per_read_samples": per_read_bytes,
        "bytes_per_round": read_bytes * per_round_reads,
        "cpu_s_per_round": read_cpu * per_round_reads,
        "share_of_round_bytes": _share(read_bytes * per_round_reads, rnd["median_round_wire_bytes_sent"]),
        "share_of_round_time": _share(read_cpu * per_round_reads, rnd["median_round_s"]),
    }


# ---- 6. catch-up replay checked on copies ---------------------------------------------------------


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def _peak(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """Seconds, and the peak resident bytes above those before, of `fn()` (VmHWM reset first)."""
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, _status_bytes("VmHWM") - before, out


class _Kept:
    """A holder's kept updates, in this process (the swarm reaches one over the network)."""

    def __init__(self, kept: list[Update]) -> None:
        self.kept = kept

    def updates(self, from_round: int) -> list[Update]:
        return [u for u in self.kept if u.round >= from_round]

    def state(self) -> PeerState:
        raise RuntimeError("the replay must reach the hash: no download here")


def catchup_cost(peer: Peer, repeats: int, rnd: dict[str, Any]) -> dict[str, Any]:
    """Part 6 of the module doc."""
    lean = lean_allocator()
    shapes = {n: tuple(t.shape) for n, t in zip(peer.names, peer.state.theta, strict=True)}
    start = peer.state.round
    updates = [
        Update(
            round=start + i, averaged=_payloads(shapes, 100 + i)[0], schedule=peer.state.schedule, merge=None
        )
        for i in range(3)
    ]
    saved_theta = [t.clone() for t in peer.state.theta]
    saved_momentum = [m.clone() for m in peer.state.momentum]
    saved_schedule, saved_history = peer.state.schedule, list(peer.state.history)

    def reset() -> None:
        with torch.no_grad():
            for t, s in zip(peer.state.theta, saved_theta, strict=True):
                t.copy_(s)
            for m, s in zip(peer.state.momentum, saved_momentum, strict=True):
                m.copy_(s)
        peer.state.round, peer.state.schedule, peer.state.history = start, saved_schedule, list(saved_history)

    out: dict[str, Any] = {"lean_allocator": lean, "params": sum(t.numel() for t in peer.state.theta)}
    # A warm-up of each path first (the first calls at 124M took twice as long in the quick run)
    reset()
    warm = peer.replayed_hash(updates[:1])
    reset()
    catch_up(peer, _Kept(updates[:1]), expected_hash=warm)
    reset()
    peer.catch_up(updates[:1])
    for count in (1, 3):
        kept = updates[:count]
        reset()
        expected = peer.replayed_hash(kept)
        samples: dict[str, list[tuple[float, int]]] = {"checked": [], "direct": [], "check_only": []}
        for r in range(repeats):
            order = ("checked", "direct", "check_only") if r % 2 == 0 else ("direct", "checked", "check_only")
            for mode in order:
                reset()
                if mode == "checked":
                    seconds, extra, done = _peak(partial(catch_up, peer, _Kept(kept), expected_hash=expected))
                    assert done.how == "replay" and done.rounds == count
                elif mode == "direct":
                    seconds, extra, applied = _peak(partial(peer.catch_up, kept))
                    assert applied == count
                else:
                    seconds, extra, digest = _peak(partial(peer.replayed_hash, kept))
                    assert digest == expected
                if mode != "check_only":
                    assert peer.state.round == start + count and peer.state.theta_hash() == expected
                samples[mode].append((seconds, extra))
        medians = {
            m: {
                "seconds": statistics.median(s for s, _ in v),
                "extra_peak_bytes": statistics.median(b for _, b in v),
            }
            for m, v in samples.items()
        }
        added = medians["checked"]["seconds"] - medians["direct"]["seconds"]
        out[f"updates_{count}"] = {
            "update_bytes": sum(u.num_bytes for u in kept),
            "samples": {m: [{"seconds": s, "extra_peak_bytes": b} for s, b in v] for m, v in samples.items()},
            "median": medians,
            "check_added_s": added,
            "check_added_peak_bytes": medians["checked"]["extra_peak_bytes"]
            - medians["direct"]["extra_peak_bytes"],
            "check_share_of_one_round_time": _share(added, rnd["median_round_s"]),
            "check_only_share_of_one_round_time": _share(
                medians["check_only"]["seconds"], rnd["median_round_s"]
            ),
        }
    reset()
    return out


# ---- the run --------------------------------------------------------------------------------------


def _tree() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def build_peer(quick: bool) -> Peer:
    """A peer of the 124M swarm's settings (module doc); tiny-llama with --quick."""
    cfg = TrainConfig(
        model="tiny-llama" if quick else "gpt2",
        seq_len=128,
        batch_size=2,
        inner_steps=2,
        instances=1,
        max_corpus_mb=1,
        device="cpu",
    )
    corpus, _ = load_data(cfg)
    vocab = 256 if quick else 50257
    return Peer(peer_id="defence-costs", index=0, num_peers=2, cfg=cfg, corpus=corpus, vocab_size=vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and model, 2 repeats, few reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing of the small functions")
    parser.add_argument(
        "--dht-peers", type=int, default=3, help="DHT peers on loopback, the reader one of them"
    )
    parser.add_argument("--reads", type=int, default=40, help="evidence board reads per repeat")
    parser.add_argument("--round-from", type=Path, default=ROUND_FROM)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    repeats = 2 if args.quick else args.repeats
    calls = 50 if args.quick else args.calls
    rnd = round_figures(args.round_from.resolve())
    shapes = llama_shapes(64, 1, 256) if args.quick else gpt2_shapes()
    t0 = time.perf_counter()
    peer = build_peer(args.quick)
    print(f"peer built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    result: dict[str, Any] = {
        "tree": _tree(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "command": " ".join(["python -m adloco.bench.defence_costs", *sys.argv[1:]]),
        "quick": args.quick,
        "repeats": repeats,
        "params": num_params(shapes),
        "round": rnd,
    }
    sections: dict[str, Callable[[], Any]] = {
        "claims": lambda: claims_cost(peer, repeats, calls, rnd),
        "screening": lambda: screening_cost(shapes, peer.claim_bounds(), repeats, rnd),
        "reports": lambda: reports_cost(repeats, calls, rnd["contribution_bytes"], rnd),
        "trust": lambda: trust_cost(repeats, calls, rnd),
        "evidence": lambda: evidence_cost(args.dht_peers, 5 if args.quick else args.reads, repeats, rnd),
        "catchup": lambda: catchup_cost(peer, repeats, rnd),  # last: it sets the lean allocator
    }
    for name, run in sections.items():
        t0 = time.perf_counter()
        result[name] = run()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
