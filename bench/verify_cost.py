"""What checking the owners' answers costs a member (issue 25 §1): CPU per round at GPT-2 124M, and
round time and bytes side by side with the checks skipped, over the real p2pd.

1. `components`: the GPT-2 124M parameter shapes (148 tensors, 124.4M values), int8, three
   members. Per member and round, timed on this machine (median of `--repeats`):
   - the checks: the digests and norms it commits to (`round_exchange.own_facts`), its
     projections (`verification.own_projections`), and checking the answers of the parts it did not
     reduce (`verification.check_part`: decode, norm bound, projection; two thirds of the model);
   - beside them, the round's work without them: encoding its contribution (int8), reducing the
     third it owns over three contributions (`parts.reduce_part`), decoding every averaged part (the
     outer step's input);
   - the statements' bytes: its commitment (sent to each other owner), an owner's statement and the
     commitments relayed with it, its reveal and projections (sent to each other member), against
     the payload bytes it moves.
   Under `--aggregate clip:c` the owner's reduction is CenteredClip's, the member also computes the
   inner products of its payloads with the answers (`verification.own_dots`) and checks each answer's
   clip factors (`verify.check_clip`, with the others' inner products worked out beforehand).
2. `rounds`: three `HivemindAverager`s on loopback (one process, real DHTs and p2pd) average a
   Llama-shaped contribution of `--params` values (int8) for `--rounds` rounds with the checks and
   as many with `verify_round` replaced by a no-op (the commitments and signed statements stay),
   alternating; the median call time of each, their ratio, and the wire bytes per member.

    python -m adloco.bench.verify_cost --out bench/results/verify_cost.json
    python -m adloco.bench.verify_cost --aggregate clip:0.5 --out bench/results/verify_cost_clip.json
    python -m adloco.bench.verify_cost --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adloco.protocol.algorithms import verify
from adloco.protocol.algorithms.allreduce import Contribution
from adloco.protocol.algorithms.codecs import decode, encode_tensors, make_codec
from adloco.protocol.algorithms.parts import Aggregate, Clip, assign_parts, reduce_part
from adloco.protocol.algorithms.report import PeerReport
from adloco.protocol.transport import round_exchange, verification
from adloco.protocol.transport.identity import create_identity
from adloco.protocol.transport.statements import AnswerStatement, Commitment, Projections, Reveal, Signer

from .allreduce import DHT_KWARGS, llama_shapes, num_params


def gpt2_shapes(
    vocab: int = 50257, d: int = 768, layers: int = 12, positions: int = 1024
) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of transformers' GPT-2 (head tied to the embedding)."""
    shapes: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (positions, d)}
    for i in range(layers):
        shapes |= {
            f"h{i}.ln_1.w": (d,),
            f"h{i}.ln_1.b": (d,),
            f"h{i}.attn.c_attn.w": (d, 3 * d),
            f"h{i}.attn.c_attn.b": (3 * d,),
            f"h{i}.attn.c_proj.w": (d, d),
            f"h{i}.attn.c_proj.b": (d,),
            f"h{i}.ln_2.w": (d,),
            f"h{i}.ln_2.b": (d,),
            f"h{i}.mlp.c_fc.w": (d, 4 * d),
            f"h{i}.mlp.c_fc.b": (4 * d,),
            f"h{i}.mlp.c_proj.w": (4 * d, d),
            f"h{i}.mlp.c_proj.b": (d,),
        }
    return shapes | {"ln_f.w": (d,), "ln_f.b": (d,)}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _payloads(shapes: dict[str, tuple[int, ...]], seed: int) -> tuple[dict[str, bytes], float]:
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(*s, generator=g) * 1e-3 for k, s in shapes.items()}
    seconds, payloads = _timed(lambda: encode_tensors(make_codec("int8"), tensors))
    return payloads, seconds


def components(shapes: dict[str, tuple[int, ...]], repeats: int, aggregate: Aggregate) -> dict[str, Any]:
    """Part 1 of the module doc."""
    n = 3
    members = [_payloads(shapes, seed) for seed in range(n)]
    payloads = [p for p, _ in members]
    keys = list(shapes)
    owner_of = assign_parts([len(payloads[0][k]) for k in keys], n)
    mine = [k for k, o in zip(keys, owner_of, strict=True) if o == 0]  # member 0's parts
    others = [k for k in keys if k not in mine]
    seed = b"\x01" * 32
    times: dict[str, list[float]] = {}
    answers: dict[str, bytes] = {}
    clips: dict[str, Clip | None] = {}
    claims: dict[str, list[verify.Claim]] = {}
    facts = [round_exchange.own_facts(p) for p in payloads]
    for k in keys:
        at = keys.index(k)
        claims[k] = [verify.Claim(100.0, 100.0, facts[j][1][at], facts[j][0][at]) for j in range(n)]
    _reduce(others, payloads, claims, aggregate, answers, clips)  # the other owners' answers
    for _ in range(repeats):
        for name, fn in {
            "commit (digests, norms)": lambda: round_exchange.own_facts(payloads[0]),
            "own projections": lambda: verification.own_projections(payloads[0], keys, seed),
            "encode (int8)": lambda: _payloads(shapes, 0)[1],
            "reduce owned third": lambda: _reduce(mine, payloads, claims, aggregate, answers, clips),
            "decode averaged (apply)": lambda: [decode(answers[k]) for k in keys],
        }.items():
            seconds, out = _timed(fn)
            times.setdefault(name, []).append(out if name == "encode (int8)" else seconds)
        if aggregate.rule == "clip":
            seconds, _ = _timed(lambda: verification.own_dots(payloads[0], keys, answers))
            times.setdefault("own inner products (clip)", []).append(seconds)
        dots = {
            k: {j: verify.inner(decode(payloads[j][k]), decode(answers[k])) for j in range(n)}
            for k in others
            if clips.get(k) is not None
        }
        times.setdefault("check answers (2/3 of the parts)", []).append(
            _timed(
                lambda dots=dots: _check_answers(others, answers, claims, n, seed, aggregate, clips, dots)
            )[0]
        )
    medians = {name: statistics.median(v) for name, v in times.items()}
    checks = ["commit (digests, norms)", "own projections", "check answers (2/3 of the parts)"]
    checks += ["own inner products (clip)"] if aggregate.rule == "clip" else []
    work = ["encode (int8)", "reduce owned third", "decode averaged (apply)"]
    return {
        "aggregate": str(aggregate),
        "params": num_params(shapes),
        "tensors": len(shapes),
        "repeats": repeats,
        "seconds": medians,
        "checks_s": sum(medians[c] for c in checks),
        "round_work_s": sum(medians[w] for w in work),
        "bytes": statement_bytes(shapes, payloads, answers, n),
    }


def _reduce(
    keys: list[str],
    payloads: list[dict[str, bytes]],
    claims: dict[str, list[verify.Claim]],
    aggregate: Aggregate,
    answers: dict[str, bytes],
    clips: dict[str, Clip | None],
) -> None:
    """The owner's reduction of every part in `keys` over the members' payloads (100 tokens each)."""
    n = len(payloads)
    for k in keys:
        part = reduce_part(
            [p[k] for p in payloads],
            [100.0] * n,
            make_codec("int8"),
            k,
            tokens=[100.0] * n,
            aggregate=aggregate,
            claimed_norms=[c.norm for c in claims[k]],
        )
        answers[k], clips[k] = part.payload, part.clip


def _check_answers(
    keys: list[str],
    answers: dict[str, bytes],
    claims: dict[str, list[verify.Claim]],
    n: int,
    seed: bytes,
    aggregate: Aggregate,
    clips: dict[str, Clip | None],
    dots: dict[str, dict[int, float]],
) -> None:
    settings = verification.Settings(aggregate, 10.0, None)
    for k in keys:
        mean = [(j, 1 / n) for j in range(n)]
        factors = verify.stated_factors(clips.get(k), mean, aggregate)
        part = verification.Part(
            k, "owner", answers[k], claims[k], ["a", "b", "c"], factors, clips.get(k), mean, aggregate.param
        )
        checked = verification.check_part(part, seed, settings)
        clip = clips.get(k)
        if clip is not None and checked.tolerance is not None:
            verify.check_clip(
                clip,
                claims[k],
                mean,
                aggregate.param,
                answer_norm=checked.norm,
                rounding=checked.rounding,
                dots=dict(dots[k]),
            )


def statement_bytes(
    shapes: dict[str, tuple[int, ...]], payloads: list[dict[str, bytes]], answers: dict[str, bytes], n: int
) -> dict[str, int]:
    """The statements one member sends and receives in a round of n, and the payload bytes it moves."""
    keys = list(shapes)
    with tempfile.TemporaryDirectory() as folder:
        signers = [Signer(create_identity(f"{folder}/k{i}")) for i in range(n)]
    group = b"g" * 16
    report = PeerReport(peer_id=signers[0].peer_id, slot_stats=(None,), b_max=8, tokens=100).encode()
    commits = [
        Commitment.make(
            s,
            round=0,
            group_id=group,
            weight=100.0,
            tokens=100.0,
            digests=[verify.payload_digest(p[k]) for k in keys],
            norms=[1.0] * len(keys),
            report=report,
            secret=b"s" * 32,
        )
        for s, p in zip(signers, payloads, strict=True)
    ]
    owned = keys[: len(keys) // n]
    answer = AnswerStatement.make(
        signers[1],
        round=0,
        group_id=group,
        keys=owned,
        payloads=[answers[k] for k in owned],
        contributors=[s.peer_id for s in signers],
        commitments=[c.signed.digest for c in commits],
        codes=[{} for _ in owned],
        rule="mean",
        outlier_factor=10.0,
        work_cap=1e6,
        reports=b"r" * 32,
    )
    reveal = Reveal.make(signers[0], round=0, group_id=group, answers=[answer.signed] * n, secret=b"s" * 32)
    projected = Projections.make(
        signers[0],
        round=0,
        group_id=group,
        seed=b"z" * 32,
        values=[0.1] * len(keys),
        secrets=[[s.peer_id, b"s" * 32] for s in signers],
    )
    commit, statement = commits[0].signed.size, answer.signed.size
    each = reveal.signed.size + projected.signed.size
    sent = (n - 1) * commit + (n - 1) * (statement + n * commit) + (n - 1) * each  # as an owner too
    received = (n - 1) * (statement + n * commit) + (n - 1) * commit + (n - 1) * each
    payload = sum(len(p) for p in payloads[0].values())
    moved = 2 * payload * (n - 1) // n  # its parts up, its share's averages down, each way
    return {
        "commitment": commit,
        "answer_statement": statement,
        "reveal": reveal.signed.size,
        "projections": projected.signed.size,
        "statements_sent": sent,
        "statements_received": received,
        "payload_moved_each_way": moved,
    }


def rounds(shapes: dict[str, tuple[int, ...]], count: int, aggregate: Aggregate) -> dict[str, Any]:
    """Part 2 of the module doc."""
    from adloco.protocol.transport.hivemind_averager import HivemindAverager
    from adloco.protocol.transport.identity import NodeDHT

    local = ["/ip4/127.0.0.1/tcp/0"]
    dhts = [NodeDHT(start=True, host_maddrs=local, **DHT_KWARGS)]
    peers = dhts[0].get_visible_maddrs()
    dhts += [NodeDHT(initial_peers=peers, start=True, host_maddrs=local, **DHT_KWARGS) for _ in range(2)]
    averagers = [
        HivemindAverager(
            d,
            prefix="verify-cost",
            window_s=1.0,
            grace_s=0.3,
            part_timeout_s=20.0,
            reduce_timeout_s=20.0,
            aggregate=aggregate,
        )
        for d in dhts
    ]
    real = round_exchange.verify_round

    async def skipped(**kw: Any) -> dict[str, str]:
        return {}

    samples: dict[str, list[float]] = {"checked": [], "unchecked": []}
    wire: dict[str, list[float]] = {"checked": [], "unchecked": []}
    checks: list[float] = []
    try:
        contributions = []
        for i, a in enumerate(averagers):
            payloads, _ = _payloads(shapes, i)
            report = PeerReport(peer_id=a.peer_id, slot_stats=(None,), b_max=8, tokens=100).encode()
            contributions.append(Contribution(a.peer_id, payloads, 100.0, 100.0, report))
        for r in range(2 * count + 2):  # a warm-up round of each first
            mode = "checked" if r % 2 == 0 else "unchecked"
            setattr(round_exchange, "verify_round", real if mode == "checked" else skipped)  # noqa: B010
            seconds, results = _one_round(averagers, contributions, r)
            if r >= 2:
                samples[mode].append(max(seconds))
                wire[mode].append(statistics.mean(res.traffic.wire_sent for res in results))
                if mode == "checked":
                    checks.append(statistics.mean(res.traffic.checks_sent for res in results))
            print(f"round {r} {mode}: {max(seconds):.2f} s", file=sys.stderr)
    finally:
        setattr(round_exchange, "verify_round", real)  # noqa: B010
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    checked, unchecked = statistics.median(samples["checked"]), statistics.median(samples["unchecked"])
    return {
        "aggregate": str(aggregate),
        "params": num_params(shapes),
        "rounds_each": count,
        "call_s": {"checked": samples["checked"], "unchecked": samples["unchecked"]},
        "median_call_s": {"checked": checked, "unchecked": unchecked},
        "ratio": checked / unchecked,
        "wire_sent_per_member": {m: statistics.median(v) for m, v in wire.items()},
        "checks_sent_per_member": statistics.median(checks),
        "payload_bytes": sum(len(p) for p in contributions[0].payloads.values()),
    }


def _one_round(
    averagers: list[Any], contributions: list[Contribution], r: int
) -> tuple[list[float], list[Any]]:
    """Every member averages round `r` from its own thread; the seconds each call took, the results."""
    seconds: list[float] = [0.0] * len(averagers)
    results: list[Any] = [None] * len(averagers)
    start = threading.Barrier(len(averagers))

    def member(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        results[i] = averagers[i].average(contributions[i], round=r, codec=make_codec("int8"), timeout=600.0)
        seconds[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(res is None for res in results):
        raise RuntimeError(f"round {r} failed for a member")
    return seconds, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--aggregate", type=Aggregate.parse, default=Aggregate(), help="the owners' rule")
    args = parser.parse_args()
    torch.set_num_threads(2)
    big = llama_shapes(64, 1, 256) if args.quick else gpt2_shapes()
    small = llama_shapes(64, 1, 256) if args.quick else llama_shapes(256, 4, 8192)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "command": " ".join(["python -m adloco.bench.verify_cost", *sys.argv[1:]]),
        "components": components(big, args.repeats, args.aggregate),
        "rounds": rounds(small, 2 if args.quick else args.rounds, args.aggregate),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
