"""A hostile node for bench/robust_swarm.py: it joins a run exactly as `adloco-node` does (the same
flags, its own identity, real p2pd) and trains, then attacks every round (`--attack`):

- as a member, it sends a forged pseudo-gradient instead of its own (flip1000, flip, random,
  constant: `node.sim.engine.forge`, the simulator's attacks) and applies whatever the group's
  owners return, as an honest node does;
- as an owner (issue 25), signing every lie with its own key: owner-scaled answers its parts with
  the true average × −50, owner-noise with noise of the average's norm, owner-split each member
  with an answer of its own (the true one to the first, 1.001 × it to the others), owner-stall takes
  the parts and never answers;
- mute: it sends its parts and takes the answers, then never reveals what it got;
- as an owner again: owner-omit reduces without one member's parts it took (the first other one by
  peer id), owner-rewrite relays another member's report with its tokens set to 10^9, owner-header
  answers with a `rejected` field naming a peer that is no member, owner-refuse refuses every
  member's request at its header (it takes nothing, signs no receipt);
- as a member again: claim says its Δ is worth 10^12 tokens (weight and tokens), sum-bomb sends each
  part as a `sum` payload of the same size and shape whose tiny sparse parts each decode to the whole
  tensor, report sends an honest Δ with a forged report (a step time of 1 µs, a link of 1 bit/s).

As a peer that serves state (issue 25 §3): hijack trains nothing and publishes, every 2 s, a signed
state record of round 10^6 whose state (random weights) it serves to whoever asks (issue 10's
far-ahead hijack; tests/test_swarm.py runs this mode); replay-poison trains and averages honestly,
but the kept updates it serves laggards to replay are the true ones × −50, re-encoded (printed each
time it serves them).

As a registrant (issue 25 §2): backdate trains and averages honestly, but every readiness record
it stores says it registered `BACKDATE_S` earlier than it did (the record is its own, signed with its
key; only the time in it is false), so that a round it is in seems to have opened long ago.

With "+rekey" after the attack (owner-stall+rekey), once the others leave it out it stops and
joins again under a fresh key (0.1 s to make), as an attacker whose bans are keyed by peer id would:
it catches up like any joiner and attacks again whenever it is given the chance. With "+fresh" it
does not wait to be left out: after every round it averaged in, it joins again under a fresh key, so
every group it is in meets it as a newcomer (mute+fresh: a newcomer's withheld reveal, every time);
"+freshN" after every N rounds (a key that leaves once the others wait for it: record 071).

    python bench/hostile_node.py --attack owner-scaled --peers ... --run-id r [node flags]
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import time
from typing import Any

import torch

from adloco.node.cli.node import (
    build_parser,
    network_from_args,
    parse_settings,
    swarm_from_args,
    swarm_train_config,
    train_config_from_args,
)
from adloco.node.sim.engine import ATTACKS, forge, sum_bomb
from adloco.node.swarm.node import SwarmNode
from adloco.protocol.algorithms.allreduce import Contribution
from adloco.protocol.algorithms.codecs import decode, make_codec, payload_codec, payload_shape
from adloco.protocol.algorithms.report import PeerReport
from adloco.protocol.transport import owner, round_exchange
from adloco.protocol.transport.matchmaking import RoundFailed
from adloco.protocol.transport.owner import Answer, OwnerSession
from adloco.protocol.transport.owner_streams import OwnerHandler
from adloco.protocol.transport.state_transfer import UpdateRecord

OWNER_ATTACKS = (
    *("owner-scaled", "owner-noise", "owner-split", "owner-stall", "mute", "silent"),
    *("owner-omit", "owner-rewrite", "owner-header", "owner-refuse"),
)
MEMBER_ATTACKS = ("claim", "sum-bomb", "report")  # an honest Δ, something else forged
HOLDER_ATTACKS = ("hijack", "replay-poison")  # what it serves to laggards and joiners
RECORD_ATTACKS = ("backdate",)  # what its readiness records say
BACKDATE_S = 30.0
HIJACK_ROUND = 10**6


def _reencoded(answer: Answer, change: Any) -> Answer:
    told = {}
    for key, payload in answer.payloads.items():
        family = payload_codec(payload)
        codec = make_codec(family if family in ("none", "fp16", "int8", "int4") else "int8")
        told[key] = codec.encode(key, change(decode(payload)))
    return dataclasses.replace(answer, payloads=told)


def _noise(values: torch.Tensor) -> torch.Tensor:
    noise = torch.randn_like(values)
    return noise * (float(values.norm()) / max(float(noise.norm()), 1e-30))


def attack_as_owner(attack: str) -> None:
    """Install `attack` into this process's owner side (only the hostile node runs this)."""
    if attack in ("owner-scaled", "owner-noise"):
        real = owner.reduce_owned
        change = (lambda v: v * -50.0) if attack == "owner-scaled" else _noise

        def lying(*args: Any, **kwargs: Any) -> Any:
            answer, rejections = real(*args, **kwargs)
            signed_by = kwargs.get("signed_by")
            if signed_by is not None and answer.statement is not None:
                answer = signed_by.__self__.restate(_reencoded(answer, change))
            return answer, rejections

        owner.reduce_owned = lying
    elif attack in ("owner-omit", "owner-rewrite", "owner-header"):
        real_reduce = owner.reduce_owned

        def dishonest(keys: Any, contributions: Any, *args: Any, **kwargs: Any) -> Any:
            session = kwargs.get("signed_by")
            me = None if session is None else session.__self__.signer.peer_id
            others = sorted(p for p in contributions if p != me)
            if attack == "owner-omit" and others:
                contributions = {p: c for p, c in contributions.items() if p != others[0]}
            answer, rejections = real_reduce(keys, contributions, *args, **kwargs)
            if session is None or answer.statement is None:
                return answer, rejections
            if attack == "owner-rewrite" and answer.metadata is not None and len(answer.metadata) > 1:
                metadata = list(answer.metadata)
                at = next((i for i, m in enumerate(metadata) if _report_of(m) not in (None, me)), None)
                if at is not None:
                    forged = PeerReport.decode(metadata[at])
                    metadata[at] = dataclasses.replace(forged, tokens=10**9).encode()
                    answer = session.__self__.restate(dataclasses.replace(answer, metadata=tuple(metadata)))
            elif attack == "owner-header":
                answer = session.__self__.restate(dataclasses.replace(answer, rejected={"not-a-member": 1}))
            return answer, rejections

        owner.reduce_owned = dishonest
    elif attack == "owner-split":
        real_answer = OwnerHandler._answer
        told: dict[int, str] = {}

        async def split(
            self: OwnerHandler, writer: Any, session: OwnerSession, meter: Any, peer: str
        ) -> None:
            result = session.result
            first = told.setdefault(session.group.round, peer)
            if result is not None and result.statement is not None and peer != first:
                session = _session_with(session, result)
            await real_answer(self, writer, session, meter, peer)

        OwnerHandler._answer = split  # type: ignore[method-assign]
    elif attack == "owner-refuse":  # refuses every member at its request's header: takes nothing

        def refuse(self: OwnerHandler, *args: Any) -> str:
            return "refused"

        OwnerHandler._refusal = refuse  # type: ignore[method-assign]
    elif attack == "owner-stall":

        async def never(self: OwnerHandler, *args: Any) -> None:
            await asyncio.sleep(3600)

        OwnerHandler._answer = never  # type: ignore[method-assign]
    elif attack == "mute":
        real_verify = round_exchange.verify_round

        async def withheld(**kw: Any) -> Any:
            return await real_verify(**{**kw, "send": lambda *args: None})

        round_exchange.verify_round = withheld
    elif attack == "silent":  # registers and joins groups, then sends no owner its parts

        async def hold(self: Any, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(self.averager.part_timeout_s)  # then registers again for the next try
            raise RoundFailed("silent")

        round_exchange.RoundExchange._exchange = hold  # type: ignore[method-assign]


def _hijack(node: SwarmNode) -> bool:
    """Random weights at round `HIJACK_ROUND`, published and served until the process is stopped."""
    try:
        with node.lock, torch.no_grad():
            generator = torch.Generator().manual_seed(666)
            for t in node.peer.state.theta:
                t.copy_(torch.randn(t.shape, generator=generator))
            node.peer.state.round = HIJACK_ROUND
        while True:
            node.sync.publish()
            print(f"hostile node: published round {HIJACK_ROUND} as {node.peer_id}", flush=True)
            time.sleep(2.0)
    finally:
        node.shutdown()


def _poison_replays(node: SwarmNode) -> None:
    """Serve laggards the kept updates × −50 (the state server reads them through this name)."""
    from adloco.node.swarm import node as node_module

    honest = node_module.updates_of

    def poisoned(peer: Any, lock: Any, from_round: int) -> list[UpdateRecord]:
        records = honest(peer, lock, from_round)
        out = []
        for r in records:
            averaged = {}
            for key, payload in r.averaged.items():
                family = payload_codec(payload)
                codec = make_codec(family if family in ("none", "fp16", "int8", "int4") else "int8")
                averaged[key] = codec.encode(key, decode(payload) * -50.0)
            out.append(dataclasses.replace(r, averaged=averaged))
        print(f"hostile node: served {len(out)} poisoned updates from round {from_round}", flush=True)
        return out

    node_module.updates_of = poisoned  # type: ignore[assignment]


def _backdate(node: SwarmNode) -> None:
    """Every readiness record this node stores dated `BACKDATE_S` before its registration."""
    dht = node.averager._matchmaker.dht
    store = dht.store

    def backdated(key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        registration = ".round" in key and not key.endswith(".failed")
        if registration and isinstance(value, tuple) and value and isinstance(value[0], float):
            value = (value[0] - BACKDATE_S, *value[1:])
        return store(key, value, *args, **kwargs)

    dht.store = backdated


def _report_of(metadata: bytes) -> str | None:
    """The peer a relayed report names (None: it does not parse)."""
    try:
        return PeerReport.decode(metadata).peer_id
    except Exception:
        return None


def forge_member(honest: Contribution, attack: str) -> Contribution:
    """A member's attack on what goes with its honest Δ (`MEMBER_ATTACKS`)."""
    if attack == "claim":
        return dataclasses.replace(honest, weight=1e12, tokens=1e12)
    if attack == "sum-bomb":
        bombs = {key: sum_bomb(len(p), payload_shape(p)) for key, p in honest.payloads.items()}
        return dataclasses.replace(honest, payloads=bombs)
    report = PeerReport.decode(honest.metadata)
    forged = dataclasses.replace(report, step_time_s=1e-6, bandwidth_bps=1.0)
    return dataclasses.replace(honest, metadata=forged.encode())


def _session_with(session: OwnerSession, result: Answer) -> OwnerSession:
    """A copy of `session` answering 1.001 × its true result (re-signed)."""
    import copy

    other = copy.copy(session)
    other.result = session.restate(_reencoded(result, lambda v: v * 1.001))
    return other


def main(argv: list[str]) -> int:
    attack = "flip"
    if "--attack" in argv:
        at = argv.index("--attack")
        attack, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    attack, rekey = attack.removesuffix("+rekey"), attack.endswith("+rekey")
    fresh = 0
    if found := re.fullmatch(r"(.+)\+fresh(\d*)", attack):
        attack, fresh = found[1], int(found[2] or 1)
    known = (*ATTACKS[1:], *OWNER_ATTACKS, *MEMBER_ATTACKS, *HOLDER_ATTACKS, *RECORD_ATTACKS)
    if attack not in known or (found and fresh < 1):
        raise SystemExit(f"--attack: one of {', '.join(known)}, +rekey or +fresh[N] optional")
    args = parse_settings(build_parser(), argv)
    if attack in OWNER_ATTACKS:
        attack_as_owner(attack)
    keys = 0
    while True:
        keys += 1
        left_out = _run(args, attack, rekey=rekey, fresh=fresh)
        if not left_out:
            break
        why = f"averaged {fresh} round(s)" if fresh else "left out"
        print(f"hostile node: {why}, joining again under key {keys + 1}", flush=True)
    print(f"hostile node: {attack}, {keys} key(s)", flush=True)
    return 0


def _run(args: Any, attack: str, *, rekey: bool, fresh: int = 0) -> bool:
    """One life of the hostile node, under a fresh key unless --identity-path names one; True when
    it stopped because the others left it out (`rekey`), or once it averaged `fresh` rounds."""
    cfg = swarm_train_config(train_config_from_args(args), args)  # as adloco-node runs it
    node = SwarmNode(cfg, network_from_args(args), swarm_from_args(args))
    left_out = False
    if fresh:
        averager: Any = node.averager
        say = averager._log
        rounds = 0

        def averaged(round: int, message: str, *rest: Any, **kw: Any) -> None:
            nonlocal left_out, rounds
            rounds += message.startswith("averaged with")
            if rounds >= fresh:
                left_out = True
                node.ops.draining.set()
            say(round, message, *rest, **kw)

        averager._log = averaged
    if rekey:
        matchmaker = node.averager._matchmaker
        log = matchmaker._log

        def watch(round: int, message: str, *rest: Any, **kw: Any) -> None:
            nonlocal left_out
            if message.startswith("left out"):
                left_out = True
                node.ops.draining.set()  # the loop ends after this try; a fresh key comes next
            log(round, message, *rest, **kw)

        matchmaker._log = watch
    calls = 0
    if attack == "hijack":
        return _hijack(node)
    if attack == "replay-poison":
        _poison_replays(node)
    if attack == "backdate":
        _backdate(node)
    if attack not in (*OWNER_ATTACKS, *HOLDER_ATTACKS, *RECORD_ATTACKS):
        honest = node.peer.contribute

        def hostile(local: Any, **kwargs: Any) -> Any:
            nonlocal calls
            contribution, info = honest(local, **kwargs)
            if contribution is None:
                return contribution, info
            calls += 1
            if attack in MEMBER_ATTACKS:
                return forge_member(contribution, attack), info
            forged = forge(contribution, attack, seed=calls << 20, bounds=node.peer.claim_bounds())
            return forged, info

        node.peer.contribute = hostile  # type: ignore[method-assign]
    try:
        node.run()
    finally:
        node.shutdown()
    print(f"hostile node: {calls} forged contributions under {node.peer_id}", flush=True)
    return left_out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
