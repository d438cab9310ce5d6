"""The node in a swarm: the same `Peer` round as the simulator, averaged over hivemind.

Per round: train locally, catch up if the swarm moved on meanwhile (replay of the updates peers
keep, or a verified full state download), contribute (HeLoCo-corrected and staleness-weighted when
late), average with the peers ready within the matchmaking window (`HivemindAverager`), apply the
outer step, publish (round, θ hash, schedule) in the DHT. Joiners adopt the published state first.

Everything a run shares is namespaced by its prefix: run id + a fingerprint of the protocol version
and the model's parameter shapes, so a node of another run or another model never averages with us.
The corpus is not in the fingerprint: its train/validation split is by file-path hash, the same on
every Python version, so volunteers on different Pythons train together (their files differ a bit).

Not yet here (issue 3 continues): one-step-delay overlap, signed schedule/hash records, DyLU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from adloco.node.config import TrainConfig
from adloco.node.model import model_fingerprint
from adloco.node.peer import LocalRound, Peer, PeerState, Update
from adloco.node.runtime import load_data
from adloco.protocol.dht import NetworkConfig, start_dht, visible_maddrs
from adloco.protocol.hivemind_averager import HivemindAverager
from adloco.protocol.pseudograd import tensors_hash
from adloco.protocol.records import StateRecord, add_run_validators, parse_states, run_prefix, state_key
from adloco.protocol.schedule import Schedule
from adloco.protocol.state_transfer import StateServer, StateSnapshot, UpdateRecord

logger = logging.getLogger(__name__)

RECORD_TTL_S = 600.0
MAX_ATTEMPTS = 3
# Averager round ids are single-use: id = round × stride + the number of earlier tries at that round.
# Peers that reach a round meet at its first id; after a round failed everywhere they meet at the next.
ROUND_ID_STRIDE = 1000


@dataclass(frozen=True)
class SwarmConfig:
    """The swarm side of a node.

    run_id: swarms with different run ids never mix. window_s: the matchmaking window: how long a
        round waits for more ready peers after the first (raise it if groups often miss peers that
        finish a little later; it never waits for the slowest peer). part_timeout_s: how long an
        owner waits for parts before dropping a silent member. data_shard / data_shards: which part
        of the corpus this node trains on (default: random). simulate_slowdown: a test and benchmark
        knob that makes this node F× slower (it idles (F−1)× its compute time after each local
        phase), to study heterogeneous swarms on one machine.
    """

    run_id: str = "default"
    rounds: int = 0
    window_s: float = 3.0
    part_timeout_s: float = 15.0
    status_file: Path | None = None
    data_shard: int | None = None
    data_shards: int = 16
    simulate_slowdown: float = 1.0


class StatusLog:
    """One JSON object per line, appended and flushed: what `adloco-swarm` and operators read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


class SwarmNode:
    """A volunteer node: joins the DHT, trains, averages, publishes; see the module docstring."""

    def __init__(self, cfg: TrainConfig, net: NetworkConfig, swarm: SwarmConfig) -> None:
        self.cfg, self.net, self.swarm = cfg, net, swarm
        self.status = StatusLog(swarm.status_file)
        self.lock = threading.Lock()  # guards peer.state against the state server's thread
        # Everything that can fail on bad input happens before the DHT (and its p2pd) starts.
        corpus, tokenizer = load_data(cfg)
        shard = swarm.data_shard if swarm.data_shard is not None else _random_shard(swarm.data_shards)
        self.peer = Peer(
            peer_id="",
            index=shard,
            num_peers=swarm.data_shards,
            cfg=cfg,
            corpus=corpus,
            vocab_size=tokenizer.vocab_size,
        )
        self.prefix = run_prefix(swarm.run_id, model_fingerprint(self.peer.eval_model))
        self.dht = start_dht(net)
        try:
            self.peer_id = self.peer.peer_id = self.dht.peer_id.to_base58()
            self.signing_key = add_run_validators(self.dht, self.prefix)
            self.averager = HivemindAverager(
                self.dht, prefix=self.prefix, window_s=swarm.window_s, part_timeout_s=swarm.part_timeout_s
            )
            self.server = StateServer(
                self.dht, prefix=self.prefix, snapshot=self._snapshot, updates=self._updates
            )
        except BaseException:
            self.dht.shutdown()
            raise
        self.bytes_sent = 0
        self.bytes_received = 0
        self.payload_sent = 0  # encoded tensor bytes only; bytes_* include the protocol's framing
        self.payload_received = 0
        self.last_group_size = 0
        self.last_staleness = 0
        self.last_heloco: dict[str, int] | None = None
        self.on_round: Callable[[dict[str, Any]], None] | None = None
        self._tries: dict[int, int] = {}

    @property
    def maddrs(self) -> list[str]:
        return visible_maddrs(self.dht)

    # ---- state published in the DHT -------------------------------------------------------------

    def publish(self) -> None:
        """Announce (round, θ hash, schedule), signed, so joiners and laggards know where the swarm is."""
        state = self.peer.state
        record = StateRecord(
            peer_id=self.peer_id,
            round=state.round,
            theta_hash=state.theta_hash(),
            schedule=json.dumps(state.schedule.to_dict(), sort_keys=True),
        )
        self.dht.store(
            state_key(self.prefix),
            record.dict(),
            expiration_time=get_dht_time() + RECORD_TTL_S,
            subkey=self.signing_key,
        )

    def swarm_head(self) -> tuple[int, str, list[str]] | None:
        """The latest round any peer published, its majority θ hash, and the peers holding it."""
        found = self.dht.get(state_key(self.prefix), latest=True)
        records = parse_states(None if found is None else found.value)
        if not records:
            return None
        top = max(r.round for r in records)
        hashes = Counter(r.theta_hash for r in records if r.round == top)
        best = hashes.most_common(1)[0][0]
        holders = sorted({r.peer_id for r in records if r.round == top and r.theta_hash == best})
        return top, best, [p for p in holders if p != self.peer_id]

    # ---- serving state (called on the state server's thread) ---------------------------------------

    def _snapshot(self) -> StateSnapshot:
        with self.lock:
            state = self.peer.state
            names = self.peer.names
            return StateSnapshot(
                round=state.round,
                schedule=state.schedule.to_dict(),
                theta={n: t.detach().cpu().clone() for n, t in zip(names, state.theta, strict=True)},
                momentum={n: t.detach().cpu().clone() for n, t in zip(names, state.momentum, strict=True)},
                theta_hash=state.theta_hash(),
            )

    def _updates(self, from_round: int) -> list[UpdateRecord]:
        with self.lock:
            return [
                UpdateRecord(u.round, dict(u.averaged), u.schedule.to_dict(), u.merge)
                for u in self.peer.state.history
                if u.round >= from_round
            ]

    # ---- catching up ------------------------------------------------------------------------------

    def sync_with_swarm(self) -> int:
        """Reach the swarm's published round: replay kept updates, else download the state."""
        head = self.swarm_head()
        if head is None:
            return 0
        top, expected, holders = head
        behind = top - self.peer.state.round
        if behind <= 0 or not holders:
            return 0
        for holder in holders:
            try:
                if self._replay_from(holder, expected) or self._download_from(holder, expected):
                    self.status.write("catch_up", round=self.peer.state.round, behind=behind, source=holder)
                    return behind
            except Exception as e:  # a holder that left or answered badly: try the next one
                logger.warning(
                    "[%s round=%d] catch-up from %s failed: %s",
                    self.peer_id[-6:],
                    self.peer.state.round,
                    holder[-6:],
                    e,
                )
        return 0

    def _replay_from(self, holder: str, expected_hash: str) -> bool:
        records = self.server.fetch_updates(holder, from_round=self.peer.state.round)
        if not records or records[0].round != self.peer.state.round:
            return False
        updates = [Update(r.round, r.averaged, Schedule.from_dict(r.schedule), r.merge) for r in records]
        with self.lock:
            self.peer.catch_up(updates)
            ok = self.peer.state.theta_hash() == expected_hash
        if not ok:
            logger.warning("replayed θ does not match the published hash; downloading the state instead")
        return ok

    def _download_from(self, holder: str, expected_hash: str) -> bool:
        snap = self.server.fetch_state(holder)
        theta = [snap.theta[n].to(self.peer.device) for n in self.peer.names]
        if snap.theta_hash != expected_hash or tensors_hash(theta) != expected_hash:
            raise ValueError("downloaded θ does not match the hash the swarm published")
        state = PeerState(
            theta=theta,
            momentum=[snap.momentum[n].to(self.peer.device) for n in self.peer.names],
            round=snap.round,
            schedule=Schedule.from_dict(snap.schedule),
        )
        with self.lock:
            self.peer.adopt_state(state)
        self.status.write("state_download", round=snap.round, source=holder)
        return True

    # ---- the round --------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Train until `swarm.rounds` rounds are applied (0: until stopped); returns rounds applied."""
        self.status.write("start", peer_id=self.peer_id, maddrs=self.maddrs, prefix=self.prefix)
        self.sync_with_swarm()
        self.publish()
        done = 0
        while (self.swarm.rounds == 0 or done < self.swarm.rounds) and not should_stop():
            t0 = time.perf_counter()
            local = self.peer.train_round()
            if self.swarm.simulate_slowdown > 1:
                time.sleep((self.swarm.simulate_slowdown - 1) * local.compute_s)
            if self.contribute_until_applied(local):
                done += 1
                self.report(local, time.perf_counter() - t0)
        self.status.write("done", rounds=done)
        return done

    def contribute_until_applied(self, local: LocalRound) -> bool:
        """Average `local` in the current round; on failure catch up and retry it (late) a few times."""
        for attempt in range(MAX_ATTEMPTS):
            self.sync_with_swarm()
            current = self.peer.state.round
            tries = self._tries.get(current, 0)
            self._tries[current] = tries + 1
            contribution, info = self.peer.contribute(local)
            if contribution is None:
                return False  # too stale: dropped, counted in the report
            spec = self.peer.state.schedule.codec
            result = self.averager.average(
                contribution,
                round=current * ROUND_ID_STRIDE + tries,
                codec=self.peer.downlink_codec(spec),
                timeout=self.swarm.window_s + 2 * self.swarm.part_timeout_s + 30,
                # A late contribution joins a round fresh peers opened; it never opens one alone.
                join_only=info.staleness > 0,
            )
            if result is None:
                logger.info(
                    "[%s round=%d] no group this time (attempt %d)",
                    self.peer_id[-6:],
                    self.peer.state.round,
                    attempt,
                )
                continue
            with self.lock:
                self.peer.apply_round(result)
            self.last_group_size = len(result.members)
            self.last_staleness = info.staleness
            report = info.correction
            self.last_heloco = (
                {"keep": report.keep, "shrink": report.shrink, "rotate": report.rotate, "skip": report.skip}
                if report is not None
                else None
            )
            self.bytes_sent += result.sent_bytes.get(self.peer_id, 0)
            self.bytes_received += result.received_bytes.get(self.peer_id, 0)
            traffic = getattr(result, "traffic", None)
            if traffic is not None:
                self.payload_sent += traffic.payload_sent
                self.payload_received += traffic.payload_received
            self.publish()
            return True
        return False

    def report(self, local: LocalRound, round_s: float) -> None:
        """The round's figures: one status line, and the `on_round` callback (the CLI prints it)."""
        state = self.peer.state
        fields = {
            "round": state.round,
            "val_loss": self.peer.validation_loss(),
            "inner_loss": local.mean_loss,
            "tokens": local.tokens,
            "tokens_per_s": local.tokens / max(round_s, 1e-9),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "payload_sent": self.payload_sent,
            "payload_received": self.payload_received,
            "theta_hash": state.theta_hash(),
            "group_size": self.last_group_size,
            "staleness": self.last_staleness,
            "round_s": round_s,
            "compute_s": local.compute_s,
            "heloco": self.last_heloco,
            "batch_sizes": list(state.schedule.batch),
        }
        self.status.write("round", **fields)
        if self.on_round is not None:
            self.on_round(fields)

    def shutdown(self) -> None:
        """Leave the swarm: stop serving, stop averaging, stop the DHT (and its p2pd)."""
        for part in (self.server, self.averager):
            try:
                part.shutdown()
            except Exception as e:
                logger.debug("shutdown: %r", e)
        self.dht.shutdown()


def format_round(peer_id: str, f: dict[str, Any]) -> str:
    """One compact `[peer round=N]` summary line of a swarm round."""
    return (
        f"[{peer_id[-6:]} round={f['round']}] val {f['val_loss']:.3f} inner {f['inner_loss']:.3f}"
        f" {f['tokens_per_s']:.0f} tok/s group={f['group_size']} τ={f['staleness']}"
        f" sent {f['bytes_sent'] / 1e6:.2f}MB recv {f['bytes_received'] / 1e6:.2f}MB {f['round_s']:.1f}s"
    )


def _random_shard(shards: int) -> int:
    """A data shard for a node that was not given one (peers pick independently, like volunteers)."""
    return int.from_bytes(hashlib.sha256(str(time.time_ns()).encode()).digest()[:4], "big") % shards
