"""The node in a swarm: the simulator's `Peer` round, averaged over hivemind with strangers.

`SwarmNode` builds the pieces and runs them: the `Peer` (training/), the DHT and the transports
(the `HivemindAverager`, typed by the loop as the `Averager` interface, the state server, the run's
signed records), then three parts of its own, one module each: loop.py drives the rounds,
sync.py keeps the node in step with the swarm (publish, head, catch-up, fork healing), ops.py holds
what operators see and ask for (counters, status events, checkpoints, drain).

Everything a run shares is namespaced by its prefix: run id + a fingerprint of the protocol version,
the model's parameter shapes and the tokenizer (`Peer.fingerprint`), so a node of another run,
another model or another tokenizer never averages with us.
The corpus is not in the fingerprint: its train/validation split is by file-path hash, the same on
every Python version, so volunteers on different Pythons train together (their files differ a bit).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...errors import NetworkLost, UserError
from ...protocol.algorithms.parts import Aggregate
from ...protocol.algorithms.scoring import SCORE_SEQUENCES, RoundScorer, Score
from ...protocol.transport.admission import Admission
from ...protocol.transport.dht import NetworkConfig, network_failure, start_dht, visible_maddrs
from ...protocol.transport.hivemind_averager import HivemindAverager
from ...protocol.transport.records import RunRecords, run_prefix
from ...protocol.transport.state_transfer import StateServer, TransferSettings
from ...protocol.transport.wire import DEFAULT_CHUNK_BYTES, PART_FLOOR_S, REDUCE_FLOOR_S
from ..data.corpus import Corpus
from ..data.sampling import TokenSampler, evaluate
from ..data.tokenizer import Tokenizer
from ..model.model import check_model
from ..operations.checkpoint import peek_checkpoint
from ..operations.metrics import NodeMetrics
from ..training.config import TrainConfig
from ..training.peer import Peer
from ..training.replica import DiskShelf
from ..training.rounds import RoundRecord
from ..training.runtime import load_data
from .loop import ROUND_ID_STRIDE, LoopConfig, RoundLoop
from .offers import StateOffers
from .ops import NodeOps, StatusLog
from .sync import SwarmSync, updates_of

logger = logging.getLogger(__name__)

RECORD_TTL_S = 600.0
# Fault injection for tests, read once at start (`answer_delay_from_env`, `register_delay_from_env`,
# `die_at_from_env`); never set in production.
SLOW_ANSWERS_ENV = "ADLOCO_FAULT_SLOW_ANSWERS"
SLOW_REGISTRATION_ENV = "ADLOCO_FAULT_SLOW_REGISTRATION"
DIE_AT_ENV = "ADLOCO_FAULT_DIE_AT"


@dataclass(frozen=True)
class SwarmConfig:
    """The swarm side of a node.

    run_id: swarms with different run ids never mix. window_s: the matchmaking window: how long a
        round waits for more ready peers after the first (raise it if groups often miss peers that
        finish a little later; it never waits for the slowest peer). grace_s, part_timeout_s,
        reduce_timeout_s, exchange_bandwidth_bps, exchange_chunk_bytes: the averaging exchange's
        knobs (`HivemindAverager`: the wait before reading a group, the floors of the part deadline
        and of the answer phase, the rate deadlines assume, the chunk size). data_shard /
        data_shards: which part of the corpus this node trains on (default: random).
        simulate_slowdown: a test and benchmark knob that makes this node F× slower (it idles
        (F−1)× its compute time after each local phase), to study heterogeneous swarms on one
        machine. state_transfer: how joiners download the state (chunk size, bandwidth, timeout
        floor, donors: `TransferSettings`). run_owner / credential / allowed_peers: a private run
        (`transport.admission`): the owner id whose credentials admit peers, this node's credential,
        and peer ids admitted outright; all empty: a public run. trusted_peers: the peers whose
        state records a fresh joiner believes first, with the peers those records list as workers
        (`sync.live_head`): what lets a joiner tell the swarm from keys that list one another.
    """

    run_id: str = "default"
    rounds: int = 0
    window_s: float = 3.0
    grace_s: float = 0.5
    part_timeout_s: float = PART_FLOOR_S
    reduce_timeout_s: float = REDUCE_FLOOR_S
    exchange_bandwidth_bps: float = 10e6 / 8
    exchange_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    status_file: Path | None = None
    data_shard: int | None = None
    data_shards: int = 16
    simulate_slowdown: float = 1.0
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10
    state_transfer: TransferSettings = field(default_factory=TransferSettings)
    run_owner: str | None = None
    credential: str | None = None
    allowed_peers: frozenset[str] = frozenset()
    trusted_peers: frozenset[str] = frozenset()

    @property
    def spill_dir(self) -> str | None:
        """Where the node keeps on disk what it holds for others (the updates kept for laggards, a
        round frozen for a download, the payloads held for the checks): beside the checkpoints,
        else (None) the system's temporary folder."""
        return None if self.checkpoint_dir is None else str(self.checkpoint_dir)


class SwarmNode:
    """A volunteer node: joins the DHT, trains, averages, publishes; see the module docstring."""

    def __init__(
        self, cfg: TrainConfig, net: NetworkConfig, swarm: SwarmConfig, metrics: NodeMetrics | None = None
    ) -> None:
        # Every member checks its owners' answers here (ValueError for a downlink it cannot check).
        cfg = replace(cfg, checked_answers=True)
        self.cfg, self.net, self.swarm = cfg, net, swarm
        self.metrics = metrics or NodeMetrics()
        self.status = StatusLog(swarm.status_file)
        self.lock = threading.Lock()  # guards peer.state against the state server's thread
        # Bad data, tokenizer or model flags fail before the DHT (and its p2pd) starts.
        corpus, tokenizer = load_data(cfg)
        self.data_shard = _data_shard(swarm)
        check_model(cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=max(1024, cfg.seq_len))
        self._answer_delay = answer_delay_from_env(os.environ)
        self._register_delay = register_delay_from_env(os.environ)
        self._die_at = die_at_from_env(os.environ)
        # hivemind forks the DHT process from this one: started before the model is built, it does
        # not inherit the weights and state, whose pages it would otherwise keep (copy-on-write) as
        # this process rewrites them every round (2.1 GiB per node at GPT-2 124M).
        self.dht = start_dht(net)
        self._lost: str | None = None
        self._lost_checked = -float("inf")
        try:
            self._build(corpus, tokenizer)
            self._join()
        except BaseException:
            self.dht.shutdown()
            raise

    def _build(self, corpus: Corpus, tokenizer: Tokenizer) -> None:
        """The Peer (model, instances, state) and what only needs it."""
        swarm = self.swarm
        self.peer = Peer(
            peer_id="",
            index=self.data_shard,
            num_peers=swarm.data_shards,
            cfg=self.cfg,
            corpus=corpus,
            vocab_size=tokenizer.vocab_size,
            tokenizer=tokenizer,
        )
        # The updates kept for laggards wait on disk, beside the checkpoints where there are any.
        self.peer.keep_updates_on_disk(swarm.spill_dir)
        self.peer.keep_residual_on_disk(swarm.spill_dir)
        self.peer.keep_state_on_disk(swarm.spill_dir)
        self.prefix = run_prefix(swarm.run_id, self.peer.fingerprint)
        self.ops = NodeOps(
            peer=self.peer,
            lock=self.lock,
            status=self.status,
            run_id=swarm.run_id,
            checkpoint_dir=swarm.checkpoint_dir,
            checkpoint_every=swarm.checkpoint_every,
            data_shard=self.data_shard,
        )

    def _join(self) -> None:
        """The transports on the started DHT, and the parts that use them."""
        swarm = self.swarm
        self.peer_id = self.peer.peer_id = self.dht.peer_id.to_base58()
        self.admission = Admission(run_id=swarm.run_id, owner=swarm.run_owner, allowed=swarm.allowed_peers)
        self.admission.attach(self.dht, self.prefix)
        records = RunRecords(
            self.dht, prefix=self.prefix, run_id=swarm.run_id, ttl_s=RECORD_TTL_S, admission=self.admission
        )
        if swarm.credential is not None:
            mine = self.admission.learn(swarm.credential)
            if mine.peer_id != self.peer_id:
                raise ValueError(f"--credential: it admits peer {mine.peer_id}, this node is {self.peer_id}")
            records.publish_credential(swarm.credential)
        self.averager = HivemindAverager(
            self.dht,
            prefix=self.prefix,
            window_s=swarm.window_s,
            grace_s=swarm.grace_s,
            part_timeout_s=swarm.part_timeout_s,
            reduce_timeout_s=swarm.reduce_timeout_s,
            bandwidth_bps=swarm.exchange_bandwidth_bps,
            chunk_bytes=swarm.exchange_chunk_bytes,
            aggregate=Aggregate.parse(self.peer.cfg.aggregate),
            outlier_factor=self.peer.cfg.outlier_factor,
            admission=self.admission,
            scorer=shard_scorer(self.peer),
            answer_delay=self._answer_delay,
            register_delay=self._register_delay,
            on_stage=self._die_at,
            shelve=DiskShelf(swarm.spill_dir, "the payloads held for the checks"),
        )
        # fp32 is the largest encoding of the pseudo-gradient: a bound for every codec of the run.
        fp32_bytes = 4 * sum(t.numel() for t in self.peer.named_theta().values())
        self.offers = StateOffers(
            self.peer,
            self.lock,
            chunk_bytes=swarm.state_transfer.chunk_bytes,
            directory=swarm.spill_dir,
        )
        self.server = StateServer(
            self.dht,
            prefix=self.prefix,
            offered=self.offers.offered,
            updates=lambda from_round: updates_of(self.peer, self.lock, from_round),
            settings=swarm.state_transfer,
            admission=self.admission,
            published=self.offers.published,
        )
        self.sync = SwarmSync(
            peer=self.peer,
            lock=self.lock,
            records=records,
            server=self.server,
            offers=self.offers,
            ops=self.ops,
            metrics=self.metrics,
            rejoin=self.dht.rejoin,
            workers=self.averager.workers,
            excluded=self.averager.excluded,
            anchors=swarm.trusted_peers,
        )
        self.loop = RoundLoop(
            peer=self.peer,
            lock=self.lock,
            averager=self.averager,
            sync=self.sync,
            ops=self.ops,
            metrics=self.metrics,
            cfg=LoopConfig(
                rounds=swarm.rounds,
                part_timeout_s=swarm.part_timeout_s,
                average_timeout_s=self.averager.call_timeout_s(fp32_bytes),
                simulate_slowdown=swarm.simulate_slowdown,
            ),
        )

    @property
    def maddrs(self) -> list[str]:
        return visible_maddrs(self.dht)

    @property
    def on_round(self) -> Callable[[RoundRecord], None] | None:
        """Called with each applied round's record (the CLI prints it)."""
        return self.loop.on_round

    @on_round.setter
    def on_round(self, callback: Callable[[RoundRecord], None] | None) -> None:
        self.loop.on_round = callback

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Train until `swarm.rounds` rounds are applied (0: until stopped or drained); returns the
        rounds applied. Checkpoints: resumed from at start, written every `checkpoint_every` rounds,
        on request between rounds, and at the end."""
        self.status.write("start", peer_id=self.peer_id, maddrs=self.maddrs, prefix=self.prefix)
        self.ops.resume()
        self.sync.sync()
        self.sync.publish()
        self.loop.network_lost = self._network_lost
        leaving = lambda: should_stop() or self.ops.draining.is_set() or bool(self._network_lost())  # noqa: E731
        try:
            try:
                self.loop.run(leaving)
            except Exception:
                if self._network_lost() is None:
                    raise
                # A DHT call failed on the dead network: the loss below says why, not a traceback.
            self.ops.save_final()
            if self._network_lost() is None:
                self.sync.records.settle()
        finally:
            self.ops.stopped()
        lost = self._network_lost()
        if lost is not None and not should_stop():
            self.status.write("network_lost", round=self.peer.state.round, error=lost)
            raise NetworkLost(f"{lost}; the node saved a checkpoint and stops (restart it to rejoin)")
        self.status.write("done", rounds=self.ops.counters.applied)
        return self.ops.counters.applied

    def _network_lost(self) -> str | None:
        """Why the DHT process or p2pd is gone (None while both run), looked up at most once a second."""
        now = time.monotonic()
        if self._lost is None and now - self._lost_checked >= 1.0:
            self._lost_checked = now
            self._lost = network_failure(self.dht)
            if self._lost is not None:
                logger.error("[%s] %s", self.peer_id[-6:], self._lost)
        return self._lost

    def shutdown(self) -> None:
        """Leave the swarm: stop serving, stop averaging, stop the DHT (and its p2pd) and the
        further devices' worker processes."""
        for part in (self.server, self.averager):
            try:
                part.shutdown()
            except Exception as e:
                logger.debug("shutdown: %r", e)
        self.dht.shutdown()
        self.peer.close()


def shard_scorer(peer: Peer) -> RoundScorer | None:
    """The owner's scorer of `--score` (None when off): each call judges the members' Δs over the
    parts this node owns, from its θ (the round's anchor: a round is applied only after its owners
    have reduced) on a fresh batch of its own data shard, drawn with a seed only this process knows,
    so no member can choose or predict it; on a model of its own, since the reduction runs on the
    averager's thread while the instances train."""
    score = Score.parse(peer.cfg.score)
    if not score.on:
        return None
    model = copy.deepcopy(peer.home_model)
    device = next(model.parameters()).device
    stream = TokenSampler(
        peer.instances[0].sampler.stream, seq_len=peer.cfg.seq_len, seed=secrets.randbits(63)
    )
    return RoundScorer(
        score,
        theta=peer.named_theta,
        batch=lambda: stream.next_batch(SCORE_SEQUENCES),
        loss=lambda params, batch: evaluate(
            model, batch, micro_batch=SCORE_SEQUENCES, parameters={k: v.to(device) for k, v in params.items()}
        ),
        step=peer.cfg.outer.lr,
    )


def _round_and_seconds(environ: Mapping[str, str], name: str) -> tuple[int, float] | None:
    """A fault knob's "R:S" (None: unset)."""
    text = environ.get(name)
    if not text:
        return None
    try:
        return int(text.split(":")[0]), float(text.split(":")[1])
    except (IndexError, ValueError):
        raise UserError(f"{name}: expected ROUND:SECONDS, got {text!r}") from None


def answer_delay_from_env(environ: Mapping[str, str]) -> Callable[[int], float] | None:
    """The test knob ADLOCO_FAULT_SLOW_ANSWERS="R:S": in round R (numbered as the status events
    number a round applied), this node reads its owners' answers S seconds late in every averaging
    call (`HivemindAverager.answer_delay`: a member on a stalled machine). Unset: None, no cost."""
    knob = _round_and_seconds(environ, SLOW_ANSWERS_ENV)
    if knob is None:
        return None
    first, seconds = knob
    return lambda round_id: seconds if round_id // ROUND_ID_STRIDE + 1 == first else 0.0


def register_delay_from_env(environ: Mapping[str, str]) -> Callable[[int], float] | None:
    """The test knob ADLOCO_FAULT_SLOW_REGISTRATION="R:S": from round R on (numbered as the status
    events number a round applied), this node registers for each averaging call S seconds late
    (`HivemindAverager.register_delay`: its local rounds end later than its peers'). Unset: None."""
    knob = _round_and_seconds(environ, SLOW_REGISTRATION_ENV)
    if knob is None:
        return None
    first, seconds = knob
    return lambda round_id: seconds if round_id // ROUND_ID_STRIDE + 1 >= first else 0.0


def die_at_from_env(environ: Mapping[str, str]) -> Callable[[str, int], None] | None:
    """The test knob ADLOCO_FAULT_DIE_AT="STAGE:R": the first time this node reaches averaging stage
    STAGE (`HivemindAverager.on_stage`; "answered": as an owner, once one member has read its whole
    answer) in round R (numbered as the status events number a round applied), its process group is
    killed with SIGKILL at once (node, DHT process and p2pd: a machine that dies). Unset: None."""
    text = environ.get(DIE_AT_ENV)
    if not text:
        return None
    try:
        stage, at = text.split(":")[0], int(text.split(":")[1])
    except (IndexError, ValueError):
        raise UserError(f"{DIE_AT_ENV}: expected STAGE:ROUND, got {text!r}") from None

    def die(reached: str, round_id: int) -> None:
        if reached == stage and round_id // ROUND_ID_STRIDE + 1 == at:
            logger.warning("fault injection: dying at %s of round %d", stage, at)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    return die


def _data_shard(swarm: SwarmConfig) -> int:
    """The shard this node trains on: the flag, else the one its checkpoint's instances came from,
    else a random one (peers pick independently, like volunteers)."""
    if swarm.data_shard is not None:
        return swarm.data_shard
    if swarm.checkpoint_dir is not None:
        info = peek_checkpoint(swarm.checkpoint_dir)
        saved = None if info is None else info.extra.get("data_shard")
        if isinstance(saved, int) and 0 <= saved < swarm.data_shards:
            return saved
    return (
        int.from_bytes(hashlib.sha256(str(time.time_ns()).encode()).digest()[:4], "big") % swarm.data_shards
    )
