"""One peer's side of a round, the same code for the simulator and for the real swarm.

A `Peer` holds the state every peer of a run holds (θ, outer momentum m, round r, schedule S_r, the
error-feedback residual e) and its local MIT instances. A round is three calls, and only the
transport between the second and the third differs between the simulator and the swarm:

    local = peer.train_round()                       # DESIGN §3 steps 1-3
    contribution = peer.contribute(local)            # steps 4 and 9: correct, weight, compress
    ... transport averages the group's contributions (protocol.allreduce semantics) ...
    peer.apply_round(result)                         # steps 7-8: outer step, schedule, merge

A peer that missed rounds first replays the averaged updates it missed (`catch_up`), so a late
contribution is corrected against the current momentum (HeLoCo) and weighted by its staleness.

With one-step-delay overlap (`TrainConfig.overlap`, DiLoCoX) the order becomes: contribute round r,
train round r+1 while r is averaged, apply r's update when it lands (`apply_round` may be called
from `train_round`'s `on_step` callback, between two inner steps). Every change of θ then moves the
instances' progress onto the new θ (`Instance.shift`), and MIT merges decided meanwhile wait for the
local round to end.

Over 500 lines, one idea: `Peer`, one peer's half of a round (train, contribute, apply, adopt a
state, merge instances), whose methods share the replica, the instances and the error-feedback
residual; split, each half would reach into the other's state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from ...errors import UserError
from ...protocol.algorithms.adaptive import Payloads, choose_codec, predicted_wire_bytes
from ...protocol.algorithms.allreduce import Contribution, GroupResult
from ...protocol.algorithms.batchtest import pool_stats
from ...protocol.algorithms.claims import ClaimBounds, reference_tokens
from ...protocol.algorithms.codecs import (
    SPAN,
    Codec,
    decoded_spans,
    make_codec,
    payload_shape,
    span_bounds,
    sum_count,
)
from ...protocol.algorithms.downlink import OwnerFeedback, make_downlink
from ...protocol.algorithms.feedback import RESIDUAL_DTYPES, ErrorFeedback
from ...protocol.algorithms.heloco import Correction, dylu_inner_steps, staleness_weight
from ...protocol.algorithms.outer import outer_step
from ...protocol.algorithms.pseudograd import PseudoGradient, TensorsHash, tensors_hash, weighted_mean
from ...protocol.algorithms.report import PeerReport, dylu_ratio, hiding_inner_steps, overlap_byte_budget
from ...protocol.algorithms.schedule import accumulation_for, next_schedule
from ...protocol.algorithms.switch import BatchPlan
from ..data.corpus import Corpus
from ..data.sampling import TokenSampler, evaluate, restore_streams, shard_corpus, validation_batches
from ..data.spill import MappedTensors, SpillFile
from ..data.state import IncompatibleState, integer, malformed, mapping, number
from ..data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_files
from ..model.bmax import Sharded, activation_bytes, fitting_rows, memory_budget, probe_b_max
from ..model.devices import Placement, resolve_devices, resolve_precision
from ..model.model import (
    model_fingerprint,
    peak_flops,
    resolve_compile,
    train_flops_per_token,
)
from .build import instance_random_seed, new_instance, training_model
from .config import TrainConfig, residual_dtype
from .dataparallel import DataParallel, replica_devices, sharing
from .instances import DeltaFiles, Instance, InstanceRound
from .remote import DeviceLost, DeviceWorker, RemoteInstance, WorkerSpec, finish_rounds
from .replica import HISTORY_ROUNDS, DiskShelf, PeerState, Update, initial_state
from .rounds import ContributionInfo, LocalRound

logger = logging.getLogger(__name__)


class Peer:
    """A peer's state, its MIT instances, and the local half of every round.

    `vocab_size` is the model's; `tokenizer` is what `corpus` was tokenized with (default the byte
    tokenizer): its fingerprint is part of the peer's `fingerprint` and of its checkpoints.
    `placement`: where the instances train and where θ and the rest of the state live (default:
    `Placement.for_training` of `cfg.device`: the state in host memory, see `model/devices.py`).
    """

    def __init__(
        self,
        *,
        peer_id: str,
        index: int,
        num_peers: int,
        cfg: TrainConfig,
        corpus: Corpus,
        vocab_size: int,
        tokenizer: Tokenizer | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.cfg = cfg
        # The instances' devices: slot k on device k mod D, the first in this process (`remote`).
        self.devices = [placement.train] if placement is not None else resolve_devices(cfg.device)
        self.placement = placement or Placement.for_training(self.devices[0])
        self.device = self.placement.train
        # The devices as metrics name them: "cuda:1"; a device listed again gets its place ("cpu#1").
        self.device_labels = [
            str(d) if self.devices.index(d) == i else f"{d}#{i}" for i, d in enumerate(self.devices)
        ]
        self._workers: dict[int, DeviceWorker] = {}
        # Instances trained data parallel over the devices no instance holds (`dataparallel`).
        self.data_parallel = DataParallel(sharded=cfg.shard_layers)
        # Checked before the model is built: a bad --precision fails in a second, not a minute.
        self.autocast_dtype = resolve_precision(cfg.precision, self.device)
        self.compiled = resolve_compile(cfg.compile, self.device)
        self.vocab_size = vocab_size
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        if tokenizer is not None and tokenizer.vocab_size != vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is not the tokenizer's {tokenizer.vocab_size}")
        self._tokenizer_files: dict[str, bytes] | None = None
        # Every peer builds the same seeded model, so θ_0 is identical without a download. The first
        # instance trains this very model; θ is evaluated through it (`validation_loss`), no copy.
        # The architecture as built, for checkpoints and export.
        built, self._model_config = training_model(cfg, vocab_size)
        # (typed as a Module: transformers types `PreTrainedModel.to` too narrowly for a device)
        model = cast(torch.nn.Module, built)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._model_fingerprint = model_fingerprint(model)
        # What one training token costs and what the device can do: the node's MFU (metrics).
        self.flops_per_token = train_flops_per_token(model, cfg.seq_len)
        self.peak_flops = peak_flops(self.device)
        # θ_0 is copied from the model on the host before the model moves to the training device.
        self.state = initial_state(model, cfg, copy=self.placement.host_copy)
        model.to(self.device)
        # θ is evaluated through this model, and later instances start as copies of it, also once
        # MIT merges have left no instance on the first device (then it only carries θ).
        self.home_model = model
        # θ and m mapped from files (`keep_state_on_disk`): the folder, and the mappings in use.
        self._state_on_disk = False
        self._state_dir: str | None = None
        self._mapped: list[MappedTensors] = []
        self.instances: list[Instance | RemoteInstance] = [
            self._make_instance(corpus, model, slot=k, index=index, num_peers=num_peers)
            for k in range(cfg.instances)
        ]
        # What a slot this peer had merged away is rebuilt from (`adopt_state`).
        self._corpus, self._index, self._num_peers = corpus, index, num_peers
        # Where the kept updates wait for laggards (`keep_updates_on_disk`): in memory unless set.
        self._kept_shelf: DiskShelf | None = None
        self.b_max = self._probe(model)
        if len(self.devices) > cfg.instances and not cfg.data_parallel:
            idle = ", ".join(map(str, self.devices[cfg.instances :]))
            logger.warning(
                "%d MIT instances on %d devices: %s train nothing (--data-parallel off); use"
                " --instances %d or --data-parallel on to train on all of them",
                cfg.instances,
                len(self.devices),
                idle,
                len(self.devices),
            )
        dtype = str(self.autocast_dtype).removeprefix("torch.")
        logger.info(
            "instances on %s in %s%s%s; θ and the outer state on %s%s",
            ", ".join(str(inst.device) for inst in self.instances),
            "fp32" if self.autocast_dtype is None else f"{dtype} autocast",
            ", activation checkpointing" if cfg.activation_checkpointing else "",
            ", layers compiled" if self.compiled else "",
            self.placement.state,
            " (pinned)" if self.placement.pin else "",
        )
        self.val_batches = validation_batches(corpus, seq_len=cfg.seq_len, num_sequences=cfg.val_sequences)
        self.error_feedback = ErrorFeedback(RESIDUAL_DTYPES[residual_dtype(cfg)], decay=cfg.ef_decay)
        self._codecs: dict[str, Codec] = {}
        # DyLU (Async DiLoCo): this peer's speed relative to the fastest; H shrinks in proportion.
        self.dylu_speed_ratio: float | None = None
        # The round whose θ the instances' current local round is measured from (its base round).
        self.phase_round = 0
        self._in_round = False
        # MIT merges decided while the instances were mid-round: (victim, survivor, batch of then).
        self._deferred_merges: list[tuple[int, int, tuple[int, ...]]] = []
        # Called just before θ and m change in place (an outer step, applied or replayed), from the
        # thread that applies it: the swarm's state offers freeze a round a joiner is downloading.
        self.before_change: Callable[[], None] | None = None
        # The Δ last contributed: spent once its round is applied (see `apply_round`).
        self._contributed: weakref.ref[PseudoGradient] | None = None
        self._replan()

    def _probe(self, model: torch.nn.Module) -> int:
        """b_max (`cfg.b_max`, else probed), and whether the data-parallel groups shard the decoder
        layers: asked (`--data-parallel shard`), or with `on` where one whole model's training does
        not fit a device and a sharded member's does, every instance having a group to shard over.

        The probe runs on the first device for all (a node's devices are taken to be alike), and
        counts the models whose memory it shares: a GPU's own, every device's on the host. A sharded
        group is estimated from its members' shares (`bmax.Sharded`) where every instance has one;
        where one trains alone, its whole step is what must fit."""
        cfg = self.cfg
        layout = sharing(
            cfg.instances, len(self.devices), data_parallel=cfg.data_parallel, host=self.device.type == "cpu"
        )
        budget = int(cfg.memory_budget_gb * 2**30) if cfg.memory_budget_gb else None
        state_on_device = self.placement.state == self.device
        activations = None  # (measured once, where the choice needs them: two forward passes)

        def fitting(room: int, sharded: Sharded | None) -> bool:
            return (
                fitting_rows(
                    model,
                    seq_len=cfg.seq_len,
                    vocab_size=self.vocab_size,
                    budget_bytes=room,
                    instances=layout.models,
                    concurrent=layout.concurrent,
                    autocast_dtype=self.autocast_dtype,
                    state_on_device=state_on_device,
                    sharded=sharded,
                    activations=activations,
                )
                >= 1
            )

        sharded = None
        if layout.members:
            from .sharding import shares  # (FSDP2's modules: imported where a node may shard)

            with contextlib.suppress(ValueError):  # (a model with no list of layers: never sharded)
                sharded = shares(model, layout.members)
        if sharded is not None and not cfg.shard_layers:
            room = memory_budget(self.device, budget)
            activations = activation_bytes(
                model, seq_len=cfg.seq_len, vocab_size=self.vocab_size, autocast_dtype=self.autocast_dtype
            )
            if not fitting(room, None) and fitting(room, sharded):
                if cfg.schedule.test == "augmented":
                    raise UserError(
                        "--data-parallel: this model's training does not fit one device, so its layers"
                        " must be sharded over each instance's devices, which the augmented batch test"
                        " cannot use: use --batch-test norm"
                    )
                logger.info(
                    "the model's training does not fit one device (%.1f GiB): its layers are sharded"
                    " over each instance's %d devices (--data-parallel shard)",
                    room / 2**30,
                    sharded.members,
                )
                self.data_parallel.sharded = True
        if not self.data_parallel.sharded:
            sharded = None
        if cfg.b_max:
            return cfg.b_max
        return probe_b_max(
            model,
            seq_len=cfg.seq_len,
            vocab_size=self.vocab_size,
            instances=layout.models,
            concurrent=layout.concurrent,
            memory_budget_bytes=budget,
            autocast_dtype=self.autocast_dtype,
            state_on_device=state_on_device,
            sharded=sharded,
            activations=activations,
        )

    def _device_of(self, inst: Instance | RemoteInstance) -> int:
        """The index in `devices` of the device `inst` trains on."""
        if isinstance(inst, Instance):
            return 0
        return next(where for where, worker in self._workers.items() if worker is inst.worker)

    def _replan(self) -> None:
        """Give the devices no instance holds to the instances as data-parallel replicas
        (`dataparallel`), after anything that changed the instances; a no-op when nothing did.

        This process must hold a primary (it never serves a replica): when merges took the instance
        of the first device, another moves there, its state through shared memory, and its old
        device then serves as a replica like any other free one.
        """
        if not self.cfg.data_parallel or len(self.devices) == 1:
            return
        if len(self.instances) >= len(self.devices):
            self.data_parallel.arrange(self.instances, [()] * len(self.instances), self._new_replica)
            return
        if not self.local_instances:
            self.data_parallel.dissolve()
            moved, state = self.instances[0], self.instances[0].state_dict()
            # No local instance trains the home model (merges took them): the moved one trains it.
            here = new_instance(
                self.cfg,
                slot=moved.slot,
                model=self.home_model,
                sampler=moved.sampler,
                placement=self.placement,
                autocast_dtype=self.autocast_dtype,
                compiled=self.compiled,
                random_seed=0,  # (its own stream comes with its state)
            )
            here.load_state_dict(state)
            here.delta_files = self._delta_files()
            moved.close()
            self.instances[0] = here
        held = [self._device_of(inst) for inst in self.instances]
        self.data_parallel.arrange(
            self.instances, replica_devices(held, len(self.devices)), self._new_replica
        )

    def _new_replica(self, primary: Instance | RemoteInstance, where: int, rank: int) -> RemoteInstance:
        """A replica of `primary` in the worker of device `where`, with a dropout stream of its own."""
        seed = instance_random_seed(self.cfg, index=self._index, slot=primary.slot, replica=rank)
        return RemoteInstance(
            self._worker(where), slot=primary.slot, sampler=primary.sampler, random_seed=seed
        )

    def _make_instance(
        self, corpus: Corpus, model: torch.nn.Module, *, slot: int, index: int, num_peers: int
    ) -> Instance | RemoteInstance:
        """Instance `slot` on its data shard and device (k mod D): slot 0 trains `model` itself, the
        others of the first device a copy; another device's train in its worker process."""
        sampler = instance_sampler(corpus, self.cfg, index=index, num_peers=num_peers, slot=slot)
        if self.cfg.batch_size * self.cfg.seq_len > sampler.num_tokens:
            raise UserError(
                f"--batch-size: a batch of {self.cfg.batch_size}×{self.cfg.seq_len} tokens is larger than"
                f" this peer's data shard ({sampler.num_tokens} tokens); use a smaller batch or more data"
            )
        where = slot % len(self.devices)
        random_seed = instance_random_seed(self.cfg, index=index, slot=slot)
        if where:
            worker = self._worker(where)
            return RemoteInstance(worker, slot=slot, sampler=sampler, random_seed=random_seed)
        inst = new_instance(
            self.cfg,
            slot=slot,
            model=model if slot == 0 else copy.deepcopy(model),
            sampler=sampler,
            placement=self.placement,
            autocast_dtype=self.autocast_dtype,
            compiled=self.compiled,
            random_seed=random_seed,
        )
        inst.delta_files = self._delta_files()
        return inst

    def _delta_files(self) -> DeltaFiles | None:
        """Where an instance's Δ computed whole goes (`Instance.settle_delta`): files beside θ's and
        m's, the pages of each span handed back with θ's (the start Δ is read from) once computed,
        and each tensor's once read."""
        if not (self._state_on_disk and self._mapped):
            return None
        directory, release_state = self._state_dir, weakref.WeakMethod(self.release_state)

        def files(like: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[int, int, int], None]]:
            mapped = MappedTensors(like, directory)

            def hand_back(j: int, start: int, stop: int) -> None:
                mapped.release(j, start, stop)
                release = release_state()
                if release is not None:
                    release(j, start, stop)

            return mapped.tensors, hand_back

        return files

    @property
    def local_instances(self) -> list[Instance]:
        """The instances training in this process (all of them on one device)."""
        return [inst for inst in self.instances if isinstance(inst, Instance)]

    def _worker(self, where: int) -> DeviceWorker:
        """The worker process of device `where` (1 ≤ where < D), started at its first instance."""
        if where not in self._workers:
            spec = WorkerSpec(
                device=str(self.devices[where]),
                cfg=self.cfg,
                vocab_size=self.vocab_size,
                threads=torch.get_num_threads(),
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            self._workers[where] = DeviceWorker(self.devices[where], spec, label=self.device_labels[where])
        return self._workers[where]

    def close(self) -> None:
        """Stop the worker processes of the further devices (they also stop when this process ends)."""
        for inst in self.local_instances:
            inst.leave()
        self.data_parallel.groups = []
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()

    # ---- local phase -------------------------------------------------------------------------

    @property
    def overlap(self) -> bool:
        return self.cfg.overlap != "off"

    @property
    def _shift_mode(self) -> str:
        """How an update landing mid-round moves the instances (`Instance.shift`)."""
        return "mix" if self.cfg.overlap == "auto" else self.cfg.overlap

    @property
    def _start_on_theta(self) -> bool:
        """Under overlap, a round start may be θ itself: a shift (mix, overwrite) never reads it."""
        return self.overlap and self._shift_mode != "rebase"

    @property
    def in_round(self) -> bool:
        """A local round is running, or its deferred MIT merges are not done yet."""
        return self._in_round or bool(self._deferred_merges)

    @property
    def codecs(self) -> Mapping[str, Codec]:
        """The codecs this peer has built, by key ("int8", "int8/avg"): their warm starts are state."""
        return self._codecs

    def train_round(
        self,
        on_step: Callable[[int], None] | None = None,
        *,
        from_theta: bool = False,
        land: Callable[[float], None] | None = None,
    ) -> LocalRound:
        """Run every instance for one round; the node pseudo-gradient and its statistics.

        Without overlap (or with `from_theta`: a round that waited for its update) every instance
        starts from θ. With overlap they go on from their own weights, and `on_step(samples done so
        far)` runs after every inner step: the place to apply an update that has landed. The round's
        base is the θ it is measured from when it ends.

        `land(compute seconds)` (overlap, an update in flight): runs after the last step and must
        apply the update if `on_step` has not (`apply_round`, or `rebase_instances` if it failed).
        With it, under mix or overwrite, the instances of this process record no copy of where their
        round started: the update's shift puts the start on θ itself, so a round that ended first is
        measured as if its update had landed after its last step (record 080). A round `land` leaves
        unshifted is measured from the θ held, as if its update had failed.
        """
        self._replan()
        plans = accumulation_for(self.state.schedule, self.b_max)
        steps = self.state.schedule.inner_steps
        if self.dylu_speed_ratio is not None:
            steps = dylu_inner_steps(steps, self.dylu_speed_ratio, 1.0)
        overlapped = self.overlap and not from_theta
        if overlapped:
            keep = land is None or not self._start_on_theta
            for inst in self.instances:
                if isinstance(inst, Instance):
                    inst.begin(None, keep_start=keep)
                else:
                    inst.begin(None)
        else:
            self.phase_round = self.state.round
        self._in_round = True
        try:
            results = self._run_instances(plans, steps, from_theta=not overlapped, on_step=on_step)
            if land is not None:
                # Still in the round: a merge the update decides waits for its end (`_local_round`).
                land(self._compute_s(self._by_device(results, plans)))
                if any(isinstance(inst, Instance) and inst.start_pending for inst in self.instances):
                    self.rebase_instances()
                # An instance whose steps ended before the shift gave its start has an empty Δ (even
                # if the update landed while another instance trained): read it now.
                results = [
                    replace(r, delta=inst.round_delta())
                    if isinstance(inst, Instance) and not len(r.delta)
                    else r
                    for inst, r in zip(self.instances, results, strict=True)
                ]
        finally:
            self._in_round = False
        return self._local_round(results, plans, steps)

    def _run_instances(
        self,
        plans: Sequence[BatchPlan],
        steps: int,
        *,
        from_theta: bool,
        on_step: Callable[[int], None] | None,
    ) -> list[InstanceRound]:
        """Each instance's round: another device's while this process trains its own in turn;
        `on_step(samples done by all so far)` after every step of any."""
        done = 0

        def counter(samples_per_step: int) -> Callable[[int], None]:
            def step_done(_step: int) -> None:
                nonlocal done
                done += samples_per_step
                if on_step is not None:
                    on_step(done)
                # The step read θ (a round's start) or the update it landed wrote θ and m: the
                # mapped pages go back to the system until the round's boundary (no-op otherwise).
                self.release_state()

            return step_done

        theta = self.state.theta if from_theta else None
        cap = self.cfg.schedule.batch_cap

        # Without overlap nothing changes θ until the round ends, so it is the round start itself; so
        # it is under overlap (mix, overwrite) for this process's instances: whatever changes θ
        # settles their Δ first (`settle_delta`), and their shift reads no start. A slot whose batch
        # is at the cap gathers no statistics: the batch test only grows b up to the cap, so they
        # could not change the schedule (`batchtest.next_batch`), and they cost the first step a
        # split into micro-batches and, with the norm test, its hooks.
        def launch(run: Callable[..., Any], plan: BatchPlan, batch: int, *, local: bool) -> Any:
            return run(
                theta,
                plan=plan,
                steps=steps,
                on_step=counter(plan.effective),
                share_theta=not self.overlap or (local and self._start_on_theta),
                collect_stats=batch < cap,
                # θ mapped from a file is read for the round's start: its pages go back a span at
                # a time (no-op otherwise; another device's worker reads no mapped θ).
                **({"on_read": self.release_state} if local else {}),
            )

        rounds = list(zip(self.instances, plans, self.state.schedule.batch, strict=True))
        results: dict[int, InstanceRound] = {}
        primaries: list[RemoteInstance] = []  # another device's instances whose round started
        replicas: list[RemoteInstance] = []  # data-parallel replicas told to follow their primary's
        try:
            self.data_parallel.serve(replicas)
            for inst, plan, batch in rounds:
                if isinstance(inst, RemoteInstance):
                    launch(inst.start_round, plan, batch, local=False)
                    primaries.append(inst)
            for inst, plan, batch in rounds:
                if isinstance(inst, Instance):
                    results[id(inst)] = launch(inst.run_round, plan, batch, local=True)
        except BaseException:
            # No worker is left mid-round: replicas whose primary will lead no round end theirs when
            # it leaves the group. What they report then (their group closed) says less than the
            # error that stopped the round, unless a worker died.
            self.data_parallel.broke()
            self.data_parallel.release(led=primaries)
            try:
                finish_rounds([*primaries, *replicas])
            except DeviceLost:
                raise
            except Exception:
                pass
            raise
        ended = finish_rounds([*primaries, *replicas])
        results.update(zip(map(id, primaries), ended, strict=False))
        return [results[id(inst)] for inst, _, _ in rounds]

    def _local_round(
        self, results: Sequence[InstanceRound], plans: Sequence[BatchPlan], steps: int
    ) -> LocalRound:
        """The node's Δ (token-weighted over its instances) and report; deferred merges happen here."""
        tokens = sum(r.tokens for r in results)
        delta: Sequence[torch.Tensor]
        if len(results) == 1:
            delta = results[0].delta  # what the weighted mean of one gives, read when contributed
        else:
            delta = weighted_mean([r.delta for r in results], [float(r.tokens) for r in results])
            for r in results:
                if isinstance(r.delta, PseudoGradient):
                    r.delta.release()  # read tensor by tensor into the mean; never computed whole
        by_device = self._by_device(results, plans)
        compute_s = self._compute_s(by_device)
        slot_stats = [r.stats for r in results]
        for victim, survivor, batch in self._deferred_merges:
            # A merge decided while this round ran: the survivor's slot reports both instances.
            slot_stats[survivor] = pool_stats([slot_stats[survivor], slot_stats[victim]])
            del slot_stats[victim]
            self.merge_instances(victim, survivor, batch=batch)
        self._deferred_merges.clear()
        report = PeerReport(
            peer_id=self.peer_id,
            slot_stats=tuple(slot_stats),
            b_max=self.b_max,
            tokens=tokens,
            step_time_s=compute_s / max(steps, 1),
            base_round=self.phase_round,
            round_compute_s=compute_s,
        )
        return LocalRound(
            base_round=self.phase_round,
            delta=delta,
            tokens=tokens,
            samples=sum(r.samples for r in results),
            mean_loss=sum(r.mean_loss * r.tokens for r in results) / max(tokens, 1),
            report=report,
            compute_s=compute_s,
            accum_steps=max(p.accum for p in plans),
            inner_steps=steps,
            passes=dict(sum((Counter(r.passes) for r in results), Counter())),
            by_device=by_device,
        )

    def _by_device(
        self, results: Sequence[InstanceRound], plans: Sequence[BatchPlan]
    ) -> dict[str, tuple[int, float]]:
        """Tokens and compute seconds of a round by device label (before its deferred merges)."""
        by_device: dict[str, tuple[int, float]] = {}
        for inst, r, plan in zip(self.instances, results, plans, strict=True):
            own = inst.worker.label if isinstance(inst, RemoteInstance) else self.device_labels[0]
            # A data-parallel instance's tokens by its devices' shares of the rows.
            for where, part in self.data_parallel.by_device(inst, plan.micro * plan.accum):
                label = own if where is None else self.device_labels[where]
                tokens_before, seconds = by_device.get(label, (0, 0.0))
                by_device[label] = (tokens_before + round(r.tokens * part), seconds + r.compute_s)
        return by_device

    @staticmethod
    def _compute_s(by_device: Mapping[str, tuple[int, float]]) -> float:
        """Devices train at once: a round takes as long as the busiest device's instances in turn."""
        return max(seconds for _, seconds in by_device.values())

    # ---- contribution --------------------------------------------------------------------------

    def codec(self, spec: str) -> Codec:
        """The uplink codec for a spec, kept across rounds (low-rank warm-starts its Q from the last)."""
        if spec not in self._codecs:
            self._codecs[spec] = make_codec(spec)
        return self._codecs[spec]

    def downlink_codec(self, spec: str) -> Codec:
        """The codec this peer encodes averages with for the parts it owns in the current round
        (`cfg.downlink`: re-encoded, with owner-side error feedback, or gathered); separate from the
        uplink codec so the two low-rank warm starts (own Δ, group average) never mix."""
        key = f"{spec}/avg"
        if key not in self._codecs:
            self._codecs[key] = make_downlink(make_codec(spec), self.cfg.downlink_of(spec))
        codec = self._codecs[key]
        if isinstance(codec, OwnerFeedback):
            codec.start_round(self.state.round)
        return codec

    def contribute(
        self, local: LocalRound, *, bandwidth_bps: float = 0.0
    ) -> tuple[Contribution | None, ContributionInfo]:
        """Correct (if late), weight and compress the local pseudo-gradient for the current round.

        Call after `catch_up`, so θ and m are the current round's. Returns None as the contribution
        when it is too stale to use (it is then dropped, and counted). `bandwidth_bps`: this peer's
        measured link (0: unknown), reported for the adaptive codec's byte budget.
        """
        tau = self.state.round - local.base_round
        spec = self.state.schedule.codec
        # tau < 0: trained from a round this peer has since left for an earlier one of another
        # lineage (it healed a fork it made alone); that Δ belongs to no round here.
        if tau > self.cfg.max_staleness or tau < 0:
            return None, ContributionInfo(tau, 0.0, None, 0, spec, dropped=True)
        delta = local.delta
        # HeLoCo option (a) of algorithms.md §5.4: each peer corrects its own Δ against the
        # replicated momentum, which every caught-up peer holds identically.
        correction = Correction(self.cfg.heloco) if tau > 0 and self.cfg.correct_late else None
        weight = local.tokens * staleness_weight(
            tau, kind=self.cfg.staleness_weight, tokens=local.tokens, ref_tokens=self._ref_tokens()
        )
        # Tensor by tensor: with a `PseudoGradient` only one tensor of Δ exists at a time, corrected
        # (late) against its momentum as it is encoded.
        codec = self.codec(spec)
        payloads = {}
        for i, (name, d) in enumerate(zip(self.names, delta, strict=True)):
            if correction is not None:
                d = correction.apply(d, self.state.momentum[i], scale=self._momentum_scale())
            payloads[name] = self.error_feedback.compress_tensor(codec, name, d)
            del d
            self.release_state(i)  # θ (the start Δ is read from) and m, mapped: back to the system
            if isinstance(delta, PseudoGradient):
                delta.done_with(i)  # (a Δ settled into mapped files: its pages too)
        if isinstance(delta, PseudoGradient):
            self._contributed = weakref.ref(delta)
        wire = sum(len(p) for p in payloads.values())
        report = replace(
            local.report, staleness=tau, base_round=local.base_round, bandwidth_bps=bandwidth_bps
        )
        contribution = Contribution(
            peer_id=self.peer_id,
            payloads=payloads,
            weight=weight,
            tokens=float(local.tokens),
            metadata=report.encode(),
        )
        corrected = None if correction is None else correction.report()
        return contribution, ContributionInfo(tau, weight, corrected, wire, spec)

    def _momentum_scale(self) -> float:
        """The factor of the momentum HeLoCo compares late Δ against, to put it on the scale of one Δ.

        HeLoCo's formula uses the dampened (N2) buffer, whose norm is that of a typical Δ, so its κ
        weighs ‖Δ‖ against ‖m‖ on equal terms. Under N1 the buffer is about 1/(1−μ) larger; we
        compare against (1−μ)·m so κ keeps its meaning (same direction, so the cosines are equal).
        """
        if self.cfg.outer.convention == "n2":
            return 1.0
        return 1 - self.cfg.outer.momentum

    def _ref_tokens(self) -> int:
        return reference_tokens(self.state.schedule, self.cfg.seq_len)

    def claim_bounds(self) -> ClaimBounds:
        """What another member's contribution to the current round may claim (`claims`)."""
        return ClaimBounds.for_schedule(
            self.state.schedule, seq_len=self.cfg.seq_len, staleness_weight=self.cfg.staleness_weight
        )

    # ---- apply -----------------------------------------------------------------------------------

    def apply_round(self, result: GroupResult) -> Update:
        """Outer step with the group's average, then what the group's reports decide: the next
        schedule (fresh reports of the current slot count), the next codec when adaptive (within
        the byte budget of the members' links), and this peer's DyLU ratio; returns the update.

        The local round contributed to this round is spent: its Δ is released, not computed whole
        before the outer step changes θ (a late contribution's Δ was, when its catch-up changed θ).
        """
        contributed = self._contributed() if self._contributed is not None else None
        if contributed is not None:
            contributed.release()
        self._contributed = None
        fresh = [
            r
            for r in result.reports
            if r.staleness == 0 and len(r.slot_stats) == self.state.schedule.instances
        ]
        codec = self._next_codec(result)
        hiding = self._hiding_steps(result, codec or self.state.schedule.codec)
        schedule, merge = next_schedule(
            self.state.schedule, fresh, self.cfg.schedule, codec=codec, hiding_steps=hiding
        )
        update = Update(round=self.state.round, averaged=result.averaged, schedule=schedule, merge=merge)
        self._apply(update)
        for owned in self._codecs.values():
            if isinstance(owned, OwnerFeedback):
                owned.commit(update.round)  # the residuals formed for this round now count
        if self.cfg.dylu:
            # Every member sees every member's step time, so each shortens its own H alike.
            self.dylu_speed_ratio = dylu_ratio(result.reports, self.peer_id) or self.dylu_speed_ratio
        return update

    def _next_codec(self, result: GroupResult) -> str | None:
        if self.cfg.codec != "adaptive":
            return None
        # Chosen from the averaged Δ̄ and the gathered reports, which every member holds
        # bit-identically, so every member picks the same codec without another message.
        budget = overlap_byte_budget(result.reports, group_size=len(result.members))
        if budget is not None and self.cfg.schedule.inner_steps_policy == "hide_comm":
            # H will grow to hide the exchange: the codec need only fit the longest round allowed.
            budget *= self.cfg.schedule.max_inner_steps / max(self.state.schedule.inner_steps, 1)
        choice = choose_codec(
            Payloads(result.averaged),
            candidates=self.cfg.codec_candidates,
            max_rel_error=self.cfg.max_rel_error,
            byte_budget=budget,
        )
        return choice.spec

    def _hiding_steps(self, result: GroupResult, codec: str) -> int | None:
        """Under "hide_comm", the H whose round hides the next exchange in `codec`, from the group's
        reports (every member holds the same, so every member picks the same H); else None."""
        cfg = self.cfg.schedule
        if cfg.inner_steps_policy != "hide_comm":
            return None
        payload = predicted_wire_bytes(codec, dict(zip(self.names, self.state.theta, strict=True)))
        return hiding_inner_steps(
            result.reports,
            payload_bytes=payload,
            group_size=len(result.members),
            min_steps=cfg.min_inner_steps,
            max_steps=cfg.max_inner_steps,
        )

    def _apply(self, update: Update, *, rebase: bool = True) -> None:
        self._check_update(update)
        if self.before_change is not None:
            self.before_change()
        for inst in self.instances:
            inst.settle_delta()  # a round's Δ may be read from θ itself, which changes now
        # Tensor by tensor, a decoded span at a time (`_step_spans`): never a decoded tensor whole
        # (GPT-2's embedding: 154 MB, and as much again inside an int8 decode), let alone the model.
        for i, (name, theta, momentum) in enumerate(
            zip(self.names, self.state.theta, self.state.momentum, strict=True)
        ):
            what = f"update for round {update.round}: {name}"
            spans = _decoded_spans(update.averaged[name], theta.shape, what)
            # A mapped θ and m are held a span at a time too (GPT-2's embedding: 0.29 GiB of both).
            on_span = functools.partial(self.release_state, i)
            self._step_spans(theta, momentum, spans, index=self.state.round, on_span=on_span)
        if update.merge is not None:
            if self._in_round:
                # The instances are mid-round (overlap): merge when the round ends.
                self._deferred_merges.append((*update.merge, self.state.schedule.batch))
            else:
                self.merge_instances(*update.merge)
        self.state.schedule = update.schedule
        self.state.round += 1
        self.state.history.append(update)
        self._trim_history()
        if self.overlap and rebase:
            self.rebase_instances()

    def _step_spans(
        self,
        theta: torch.Tensor,
        momentum: torch.Tensor,
        spans: Iterable[torch.Tensor],
        *,
        index: int,
        on_span: Callable[[int, int], None] | None = None,
    ) -> None:
        """The outer step of round `index` on one tensor, its Δ given flat a span at a time in order
        (`codecs.decoded_spans`), `on_span(start, stop)` after each: every operation of the step is
        elementwise, so θ and m end bit for bit as one step on the whole Δ leaves them."""
        flat_theta, flat_momentum, at = theta.view(-1), momentum.view(-1), 0
        for span in spans:
            stop = at + span.numel()
            delta = span.to(self.placement.state)
            outer_step([flat_theta[at:stop]], [flat_momentum[at:stop]], [delta], self.cfg.outer, index=index)
            if on_span is not None:
                on_span(at, stop)
            at = stop

    def _trim_history(self) -> None:
        """Keep the last few averaged updates, so a peer a few rounds behind can replay them: at most
        `HISTORY_ROUNDS`, and no more than fit in `cfg.replay_mb` of encoded bytes; on disk after
        `keep_updates_on_disk`."""
        budget, kept = self.cfg.replay_mb * 2**20, 0
        history = self.state.history[-HISTORY_ROUNDS:]
        for back, update in enumerate(reversed(history)):
            kept += update.num_bytes
            if kept > budget:
                history = history[len(history) - back :]
                break
        if self._kept_shelf is not None:
            history = [replace(update, averaged=self._kept_shelf(update.averaged)) for update in history]
        self.state.history = history

    def keep_updates_on_disk(self, directory: str | None = None) -> None:
        """Keep the averaged updates for laggards in unnamed files in `directory` (default: the
        system's temporary folder), read back when one asks, instead of in memory: ~1 B/param per
        int8 update kept (`SpilledPayloads`). The networked node does; the simulator does not."""
        self._kept_shelf = DiskShelf(directory, "kept updates")
        self._trim_history()

    def keep_residual_on_disk(self, directory: str | None = None) -> None:
        """Keep the int8 error-feedback residuals in an unnamed file in `directory` (default: the
        system's temporary folder), read and rewritten a slice at a time as each contribution is
        encoded, instead of in memory (1 B/param). The networked node does; the simulator does not.
        Other residual dtypes stay in memory."""
        self.error_feedback.keep_on_disk(lambda: SpillFile(directory))

    def keep_state_on_disk(self, directory: str | None = None) -> None:
        """Keep θ and the outer momentum in unnamed files in `directory` (default: the system's
        temporary folder) mapped into memory (`MappedTensors`), and hand their pages back to the
        system after every inner step and every tensor of an outer step: the node holds them only
        while it reads or writes them, at a round's boundary, not through its inner steps (8 B/param,
        record 082). θ stays in memory where it crosses to a training device by DMA (pinned, for a
        GPU) or to another device's worker process (shared memory); m never crosses. The networked
        node does; the simulator does not. A folder that cannot hold them (gone, full, or a file
        system that cannot allocate the file ahead) leaves them in memory, with one warning."""
        self._state_on_disk, self._state_dir = True, directory
        self._map_state()
        for inst in self.local_instances:
            inst.delta_files = self._delta_files()

    def _map_state(self) -> None:
        """Move the current θ and m into mapped files, a tensor at a time (`keep_state_on_disk`)."""
        self._map(self.state.theta, self.state.momentum)

    def _map(self, theta: list[torch.Tensor], momentum: list[torch.Tensor]) -> tuple[bool, bool]:
        """Copy `theta` and `momentum` into new mapped files a tensor at a time, each list's entries
        replaced by the mapped tensors, which this peer releases from now on; returns whether θ and
        whether m were (neither without `keep_state_on_disk`, θ not where it must stay in memory)."""
        if not self._state_on_disk:
            return False, False
        map_theta = not self.placement.pin and not self._workers
        held = [theta, momentum] if map_theta else [momentum]
        try:
            mapped = [MappedTensors(tensors, self._state_dir) for tensors in held]
        except OSError as e:
            where = self._state_dir or "the temporary folder"
            logger.warning("θ and the outer momentum stay in memory: %s cannot hold them: %s", where, e)
            self._state_on_disk, self._mapped = False, []
            return False, False
        for store, tensors in zip(mapped, held, strict=True):
            store.take(tensors)
        self._mapped = mapped
        return map_theta, True

    def release_state(self, index: int | None = None, start: int = 0, stop: int | None = None) -> None:
        """Hand the mapped θ's and m's pages (of tensor `index`, or all; of its flat values `start`
        to `stop` only) back to the system: what reads them whole calls it after each tensor or
        span (no-op unless `keep_state_on_disk`)."""
        for store in self._mapped:
            store.release(index, start, stop)

    def theta_hash(self) -> str:
        """θ's hash (`PeerState.theta_hash`), read a span at a time: a mapped θ's pages go back after
        each span (the embedding's 154 MB at GPT-2 124M were held whole while hashed)."""
        digest = TensorsHash()
        for i, theta in enumerate(self.state.theta):
            digest.update_spans(theta.shape, self._theta_spans(i, theta))
        return digest.hexdigest()

    def _theta_spans(self, i: int, theta: torch.Tensor) -> Iterator[torch.Tensor]:
        """θ's tensor i flat, a span at a time, each handed back once the next is asked for."""
        flat = theta.detach().reshape(-1)
        for at, stop in span_bounds(flat.numel(), _SPAN):
            yield flat[at:stop]
            self.release_state(i, at, stop)

    def _check_update(self, update: Update) -> None:
        """ValueError unless the update decodes to one finite tensor of θ's shape per name and any MIT
        merge it carries names two of the current slots, the next schedule having one fewer: checked
        whole before any is applied (one tensor decoded at a time), so a bad update changes nothing."""
        if update.round != self.state.round:
            raise ValueError(f"update for round {update.round} applied at round {self.state.round}")
        if update.averaged.keys() != set(self.names):
            raise ValueError(f"update for round {update.round} does not carry exactly this model's tensors")
        if update.merge is not None:
            slots = self.state.schedule.instances
            victim, survivor = update.merge
            if not (0 <= victim < slots and 0 <= survivor < slots and victim != survivor):
                raise ValueError(f"update for round {update.round}: merge {update.merge} of {slots} slots")
            if update.schedule.instances != slots - 1:
                raise ValueError(f"update for round {update.round}: a merge must leave {slots - 1} slots")
        for name, theta in zip(self.names, self.state.theta, strict=True):
            what = f"update for round {update.round}: {name}"
            spans = _decoded_spans(update.averaged[name], theta.shape, what)
            if not all(bool(torch.isfinite(span).all()) for span in spans):
                raise ValueError(f"{what} is not finite")

    def rebase_instances(self) -> None:
        """Overlap: move the instances' progress onto the current θ (`cfg.overlap` says how); the
        local round in progress is measured from this θ from now on."""
        mode, mix = self._shift_mode, self.cfg.overlap_mix
        for inst in self.instances:
            if isinstance(inst, Instance):  # (a mapped θ's pages go back a span at a time)
                inst.shift(self.state.theta, mode=mode, mix=mix, on_read=self.release_state)
            else:
                inst.shift(self.state.theta, mode=mode, mix=mix)
        self.phase_round = self.state.round
        self.release_state()

    def replayed_hash(self, updates: Sequence[Update]) -> str:
        """θ's hash after replaying `updates` (those from the current round on, in order), worked out
        a span at a time on copies of θ's and its momentum's values there (a mapped θ's and m's
        pages handed back after each): nothing of this peer changes, so a caller can refuse updates
        that do not lead where it trusts before applying any (`catchup.catch_up`). ValueError for
        updates that do not follow each other from here."""
        pending = [u for u in updates if u.round >= self.state.round]
        if [u.round for u in pending] != list(range(self.state.round, self.state.round + len(pending))):
            raise ValueError("the updates do not follow each other from this peer's round")
        digest = TensorsHash()
        for i, (name, theta, momentum) in enumerate(
            zip(self.names, self.state.theta, self.state.momentum, strict=True)
        ):
            deltas = []
            for update in pending:
                payload = update.averaged.get(name)
                if payload is None:
                    raise ValueError(f"update for round {update.round} has no {name}")
                what = f"update for round {update.round}: {name}"
                deltas.append((update.round, _decoded_spans(payload, theta.shape, what)))
            digest.update_spans(theta.shape, self._replayed_spans(i, theta, momentum, deltas))
        return digest.hexdigest()

    def _replayed_spans(
        self,
        i: int,
        theta: torch.Tensor,
        momentum: torch.Tensor,
        deltas: Sequence[tuple[int, Iterator[torch.Tensor]]],
    ) -> Iterator[torch.Tensor]:
        """θ's tensor i after the outer steps of `deltas` ((round, its Δ's spans) in order), a span at
        a time: each span of θ and m copied, stepped by every round's span of Δ there, and handed
        back (elementwise steps: the bits of the whole tensor's)."""
        flat_theta, flat_momentum = theta.detach().reshape(-1), momentum.detach().reshape(-1)
        for at, stop in span_bounds(flat_theta.numel(), _SPAN):
            t, m = flat_theta[at:stop].clone(), flat_momentum[at:stop].clone()
            for round_, spans in deltas:
                delta = next(spans).to(self.placement.state)
                outer_step([t], [m], [delta], self.cfg.outer, index=round_)
            self.release_state(i, at, stop)
            yield t

    def catch_up(self, updates: Sequence[Update]) -> int:
        """Replay the averaged updates this peer missed, in order; returns how many were applied.
        Under overlap the instances move onto the final θ once, not through every replayed one."""
        applied = 0
        try:
            for update in updates:
                if update.round < self.state.round:
                    continue
                self._apply(update, rebase=False)
                applied += 1
        finally:  # a bad update stops the replay: the instances still follow the θ reached
            if applied and self.overlap:
                self.rebase_instances()
        return applied

    def adopt_state(self, other: PeerState, *, expected_hash: str) -> None:
        """Full state transfer for a peer too far behind to replay: θ, m, r and S_r from another
        peer. `expected_hash` is the θ hash this peer trusts for that state (the swarm's published
        one), never one the sender computed: a state whose θ does not hash to it raises ValueError
        and changes nothing. Instances beyond S_r's count are merged away; slots S_r has and this peer
        had merged away (it trained on alone, and its own MIT merged sooner than the swarm's) are
        rebuilt from θ on their data shards."""
        shapes = [t.shape for t in self.state.theta]
        if [t.shape for t in other.theta] != shapes or [t.shape for t in other.momentum] != shapes:
            raise ValueError("downloaded state does not have this model's tensor shapes")
        if tensors_hash(other.theta) != expected_hash:
            raise ValueError("downloaded θ does not match the published θ hash")
        # Copied straight into mapped files where this peer keeps them there (no copy in memory).
        theta, momentum = list(other.theta), list(other.momentum)
        mapped_theta, mapped_momentum = self._map(theta, momentum)
        self.state = PeerState(
            theta=theta if mapped_theta else [self.placement.host_copy(t) for t in theta],
            momentum=momentum if mapped_momentum else [self.placement.state_copy(t) for t in momentum],
            round=other.round,
            schedule=other.schedule,
            history=list(other.history),
        )
        self._trim_history()
        while len(self.instances) > self.state.schedule.instances:
            # The two slots with the smallest data streams merge, as a missed MIT merge would have.
            order = sorted(
                range(len(self.instances)), key=lambda k: (self.instances[k].sampler.num_tokens, k)
            )
            self.merge_instances(order[0], order[1], weights=(1.0, 1.0))
        while len(self.instances) < self.state.schedule.instances:
            model, slot = self.home_model, len(self.instances)
            shard = {"index": self._index, "num_peers": self._num_peers}
            self.instances.append(self._make_instance(self._corpus, model, slot=slot, **shard))
        self._replan()
        if self.overlap:
            self.rebase_instances()

    def merge_instances(
        self,
        victim: int,
        survivor: int,
        weights: tuple[float, float] | None = None,
        *,
        batch: tuple[int, ...] | None = None,
    ) -> None:
        """AdLoCo MIT merge: batch-weighted parameters, the survivor keeps its optimizer state and
        takes over the victim's data stream (its compute share). `batch` is the schedule the merge
        was decided under (default: the current one). Round starts merge alike, so Δ stays linear."""
        batch = batch or self.state.schedule.batch
        w_survivor, w_victim = weights or (float(batch[survivor]), float(batch[victim]))
        others, sampler = self.instances[victim].surrender()
        self.instances[survivor].absorb(others, sampler, weight=w_survivor, other_weight=w_victim)
        self.instances.pop(victim).close()
        for slot, inst in enumerate(self.instances):
            inst.slot = slot
        if self.local_instances and all(inst.model is not self.home_model for inst in self.local_instances):
            # The merged-away instance trained the home model: θ is evaluated through a survivor's
            # now, and the victim's weights are freed (held on, they cost a model's weights).
            self.home_model = self.local_instances[0].model
        if not self.in_round:
            self._replan()

    # ---- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean validation loss of θ on the fixed validation windows (identical on every peer).

        In fp32 whatever `--precision`, so peers of different precisions report comparable losses.
        Through the first device's model (`home_model`): θ given in place of its weights
        (functional_call), or, where θ lives on the host (a GPU peer), swapped into it tensor by
        tensor and its weights back after.
        """
        model = self.home_model
        if not self.placement.staged:
            hooks = self._release_after_modules(model) if self._mapped and not self.compiled else []
            try:
                return evaluate(model, self.val_batches, micro_batch=16, parameters=self.named_theta())
            finally:
                for hook in hooks:
                    hook.remove()
                self.release_state()
        params = [p for p in model.parameters() if p.requires_grad]
        held = self.placement.swap(params, self.state.theta)
        try:
            return evaluate(model, self.val_batches, micro_batch=16)
        finally:
            self.placement.load(params, held)

    def _release_after_modules(self, model: torch.nn.Module) -> list[RemovableHandle]:
        """Forward hooks that give a mapped θ's pages back as each module holding parameters is done
        with them: an evaluation through θ then holds it a layer at a time, not whole (a tied
        weight is released after each of its uses, and read back from the page cache)."""
        index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
        hooks = []
        for module in model.modules():
            own = tuple(index[id(p)] for p in module.parameters(recurse=False) if id(p) in index)
            if own:

                def release(*_: Any, own: tuple[int, ...] = own) -> None:
                    for i in own:
                        self.release_state(i)

                hooks.append(module.register_forward_hook(release))
        return hooks

    def named_theta(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.state.theta, strict=True))

    @property
    def fingerprint(self) -> str:
        """What peers must share to average together: the model's architecture and the tokenizer.

        sha256 of `model_fingerprint` and the tokenizer's fingerprint: two tokenizers of the same
        size give the same parameter shapes but different meanings to the same ids.
        """
        parts = f"model={self._model_fingerprint}|tokenizer={self.tokenizer.fingerprint}"
        return hashlib.sha256(parts.encode()).hexdigest()

    # ---- state dict (checkpoints) ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything this peer needs to go on where it stopped, as a tree `load_state_dict` takes.

        The replicated state (θ, m, r, S_r, the kept updates, θ's hash), the model's fingerprint and
        parameter names, each instance's state, the error-feedback residual, the codecs' warm starts,
        the overlap base round, DyLU's speed ratio and b_max; and what `adloco-node export` needs to
        rebuild the model outside adloco: its transformers config (JSON text), the tokenizer's
        fingerprint and its `save_pretrained` files. Tensors are the live ones, not copies: save or
        copy the tree before the peer trains on. Raises RuntimeError during a local round.
        """
        if self.in_round:
            raise RuntimeError("cannot checkpoint during a local round; save between rounds")
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_files(self.tokenizer)
        return {
            **self.state.state_dict(theta_hash=self.theta_hash()),
            "model_fingerprint": self._model_fingerprint,
            "model_config": self._model_config,
            "tokenizer_fingerprint": self.tokenizer.fingerprint,
            "tokenizer_files": dict(self._tokenizer_files),
            "names": list(self.names),
            "instances": [inst.state_dict() for inst in self.instances],
            "error_feedback": self.error_feedback.state_dict(),
            "codecs": {key: codec.state_dict() for key, codec in self._codecs.items()},
            "phase_round": self.phase_round,
            "dylu_speed_ratio": self.dylu_speed_ratio,
            "b_max": self.b_max,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Become the peer a `state_dict` described; the peer must be built from the same config.

        Checks all of `state` first and changes nothing unless all of it fits: IncompatibleState (a
        UserError) for a state of another model or of more MIT instances than this peer has,
        ValueError for a malformed or corrupt one (e.g. θ not matching its hash). Instances the saved
        peer had merged away are dropped and the survivors' data streams rebuilt from this peer's
        shards (`restore_streams`). An explicit `cfg.b_max` wins over the saved probe (the hardware
        may have changed). Raises RuntimeError during a local round.
        """
        if self.in_round:
            raise RuntimeError("cannot load a state during a local round")
        self._check_compatible(mapping(state, "peer state"))
        with malformed("peer state"):
            replicated = PeerState.from_state_dict(
                state, like=self.state, copy_theta=self.placement.host_copy, copy=self.placement.state_copy
            )
            saved = state["instances"]
            if not isinstance(saved, list) or not saved:
                raise ValueError("peer state: no instances")
            kept = self.instances[: len(saved)]
            for inst, inst_state in zip(kept, saved, strict=True):
                inst.check_state_dict(inst_state)
            feedback = ErrorFeedback(RESIDUAL_DTYPES[residual_dtype(self.cfg)], decay=self.cfg.ef_decay)
            if self.error_feedback.storage is not None:
                feedback.keep_on_disk(self.error_feedback.storage)
            feedback.load_state_dict(mapping(state["error_feedback"], "error feedback"))
            codecs = {
                key: self._codec_from_state(key, mapping(codec_state, f"codec {key}"))
                for key, codec_state in mapping(state["codecs"], "codecs").items()
            }
            phase_round = integer(state["phase_round"], "phase_round")
            b_max = integer(state["b_max"], "b_max", minimum=1)
            ratio = state["dylu_speed_ratio"]
            ratio = None if ratio is None else number(ratio, "dylu_speed_ratio")
            samplers = restore_streams(
                [inst.sampler for inst in self.instances], [s["sampler"] for s in saved]
            )
        # Everything is checked: from here on nothing raises, so the state is applied whole.
        self.state = replicated
        self._map_state()
        self._trim_history()
        for slot, (inst, inst_state, sampler) in enumerate(zip(kept, saved, samplers, strict=True)):
            inst.slot = slot
            inst.sampler = sampler
            inst.load_state_dict(inst_state)
        for dropped in self.instances[len(kept) :]:
            dropped.close()  # (a worker's instance would otherwise stay on its device)
        self.instances = kept
        self._replan()
        self.error_feedback = feedback
        self._codecs = codecs
        self.phase_round = phase_round
        self.dylu_speed_ratio = ratio
        self.b_max = self.cfg.b_max or b_max

    def _check_compatible(self, state: Mapping[str, Any]) -> None:
        ours, theirs = self._model_fingerprint, str(state.get("model_fingerprint"))
        if theirs != ours or state.get("names") != self.names:
            raise IncompatibleState(
                f"this state is of another model (fingerprint {theirs[:12]}, this node's {ours[:12]});"
                " use the --model it was trained with"
            )
        # Checkpoints from before the tokenizer was recorded could only use the byte tokenizer.
        theirs = str(state.get("tokenizer_fingerprint", ByteTokenizer.fingerprint))
        if theirs != self.tokenizer.fingerprint:
            raise IncompatibleState(
                f"this state was trained with another tokenizer (fingerprint {theirs[:12]}, this node's"
                f" {self.tokenizer.fingerprint[:12]}); use the --tokenizer it was trained with"
            )
        saved = state.get("instances")
        if isinstance(saved, list) and len(saved) > len(self.instances):
            raise IncompatibleState(
                f"this state was saved with {len(saved)} MIT instances, this node starts"
                f" {len(self.instances)}; use --instances {len(saved)}"
            )

    def _codec_from_state(self, key: str, state: Mapping[str, Any]) -> Codec:
        """A codec of this peer's table ("int8", "lowrank:4/avg") rebuilt with its saved warm starts
        (and, for a downlink codec with owner feedback, its residuals)."""
        spec = key.removesuffix("/avg")
        codec = make_codec(spec)
        if key.endswith("/avg"):
            codec = make_downlink(codec, self.cfg.downlink_of(spec))
        codec.load_state_dict(state)
        return codec


def instance_sampler(
    corpus: Corpus, cfg: TrainConfig, *, index: int, num_peers: int, slot: int
) -> TokenSampler:
    """The data stream of MIT instance `slot` of peer `index` of `num_peers`: its shard of the corpus,
    drawn in its own seeded order (a baseline trained on the peers' data takes the same streams)."""
    shard = shard_corpus(
        corpus,
        peer_index=index,
        num_peers=num_peers,
        instance_index=slot,
        num_instances=cfg.instances,
        non_iid=cfg.non_iid,
        seed=cfg.seed,
    )
    return TokenSampler(shard, seq_len=cfg.seq_len, seed=cfg.seed * 1000 + index * 31 + slot)


# The most payloads a kept update's `sum` payload may carry (a "gather" downlink's answer: one per
# contributor of a group); each decodes to the whole tensor (`_decoded_spans`).
MAX_SUM_PARTS = 256


def _decoded_spans(payload: bytes, shape: torch.Size, what: str) -> Iterator[torch.Tensor]:
    """`payload` decoded flat, a span at a time (`codecs.decoded_spans`: a dense payload is never
    decoded whole), once its header says it decodes to `shape` and, as a sum, carries at most
    `MAX_SUM_PARTS` payloads; ValueError naming `what` otherwise. An update may come from any holder
    (`catchup`): a few bytes could state any shape (a low-rank pair of a 10^5 × 10^5 tensor), and a
    sum of many tiny sparse parts decodes each to the whole tensor (issue 25 §1.3)."""
    try:
        stated, count = payload_shape(payload), sum_count(payload)
    except ValueError as e:
        raise ValueError(f"{what} is malformed: {e}") from None
    if stated != tuple(shape):
        raise ValueError(f"{what} is misshapen: {stated} for {tuple(shape)}")
    if count > MAX_SUM_PARTS:
        raise ValueError(f"{what} is a sum of {count} payloads (at most {MAX_SUM_PARTS})")
    return decoded_spans(payload, _SPAN)


# Values of an update's tensor decoded, checked and stepped at a time (`_decoded_spans`).
_SPAN = SPAN


def overlap_this_round(mode: str, *, comm_s: float | None, compute_s: float | None) -> bool:
    """Whether the next local round trains while the exchange in flight runs.

    off: never; rebase, overwrite, mix: always; auto: when the last exchange took no longer than the
    last local round (DiLoCoX: T_comm ≤ H·t_step). When the exchange is longer, a round started
    before the update landed is trained entirely from a θ one update old, which the outer momentum
    turns into oscillation (docs/experiments.md), so that round waits for the update instead.
    """
    if mode == "off":
        return False
    if mode != "auto":
        return True
    return comm_s is not None and compute_s is not None and comm_s <= compute_s
