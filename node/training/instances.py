"""One MIT instance (AdLoCo stage 1): a model copy with its own persistent AdamW state and data stream.

Each round an instance starts from the global θ, runs H optimizer steps of micro-batch × accumulation
(AdLoCo switch mode, see `adloco.protocol.switch.plan_batch`), and returns its pseudo-gradient
Δ = θ_start − θ_end together with the gradient statistics the adaptive-batch test needs.

Under one-step-delay overlap (DiLoCoX) a round starts from the instance's own weights instead, and
when the averaged update of the previous round lands mid-round, `shift` moves the weights and the
recorded start onto the new θ (rebase, overwrite or mix), so Δ is always measured from a global θ.
Under mix and overwrite a round with an update in flight need not record its start at all
(`begin(None, keep_start=False)`): the shift puts it on θ itself, and a round that ends first takes
its update then, as if it had landed after the last step (record 080).

The statistics come from the micro-batch gradients of the *first* optimizer step of the round, which
every instance (and, in a synchronous round, every peer) computes at the same synchronized θ. This is
the "gradients at the synchronized θ" option of research/algorithms.md §2.10 item 4: the first step's
batch is split into `stats_chunks` (2) equal micro-batches when it is not already accumulated, and the
chunk gradients are the samples g_m of the batch test, read tensor by tensor so that no copy of the
model's gradients is ever held (the memory stays at the training floor):

- the norm test (the default) needs only S = Σ_m ||g_m − ḡ||² = Σ_m ||g_m||² − M·||ḡ||² and ||ḡ||²:
  a hook reads each g_m[j] the moment the chunk's backward forms it, adds its squared norm and moves
  it into the step's gradient (`_step_with_sums`), so the statistics cost no extra pass;
- the augmented inner-product test needs ⟨g_m, ḡ⟩, known only once every chunk is done: a second
  backward pass over the same micro-batches yields each g_m again (`_chunk_stats`), one extra
  forward and backward per round;
- with no batch test ("none") nothing is gathered.

Over 500 lines, one idea: an MIT instance's inner loop, with the batch test's statistics gathered
inside it (`RunningSums`, which a sharded step's samples also use, and `_ChunkSums`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ...protocol.algorithms.batchtest import GradStats, stats_from_sums
from ...protocol.algorithms.codecs import span_bounds
from ...protocol.algorithms.merge import merge_weighted
from ...protocol.algorithms.pseudograd import PseudoGradient
from ...protocol.algorithms.switch import BatchPlan
from ..data.sampling import TokenSampler
from ..data.state import malformed, mapping, tensors_like
from ..model.devices import Placement, adamw, autocast
from ..model.loss import TiedEmbedding, causal_lm_loss
from . import parallel

if TYPE_CHECKING:
    from .sharding import SummedReduceScatter, Trainer

logger = logging.getLogger(__name__)

Files = tuple[list[torch.Tensor], Callable[[int, int, int], None]]
"""Tensors mapped from files and what hands the pages of values `start` to `stop` of tensor j back
(`PseudoGradient.materialize`'s `hand_back`)."""
DeltaFiles = Callable[[list[torch.Tensor]], Files]
"""Where a Δ computed whole goes (`Instance.delta_files`): given tensors like it, the `Files` to
compute it into."""

BatchStats = Literal["sums", "full", "none"]
# Values of a θ tensor copied at a time when its reader hands its pages back as it goes (`load`).
LOAD_SPAN = 1 << 20
# What each batch test needs gathered in the first step of a round (`ScheduleConfig.test`).
BATCH_STATS: dict[str, BatchStats] = {"norm": "sums", "augmented": "full", "none": "none"}


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer of every instance (DiLoCo: AdamW lr 4e-4, wd 0.1, betas 0.9/0.95).

    `grad_clip` bounds the global gradient norm of each inner step (0 turns it off); lower it if the
    inner loss spikes right after the batch size grows. `stats_chunks` is how many equal micro-batches
    the first step of a round is split into for the variance test when it is not already accumulated.
    Two: the test pools every instance of every peer (one degree of freedom each, so a swarm of P
    peers has at least P, what AdLoCo's own code gathers from P nodes), and each further chunk makes
    the round's first step slower (smaller matrix products, one more pass of hooks): on this CPU 4
    chunks cost 4 % of an H = 10 round, 2 cost 2 % (docs/decisions/039-two-chunks-for-the-test.md).
    """

    lr: float = 4e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    stats_chunks: int = 2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"inner lr must be > 0, got {self.lr}")
        if self.stats_chunks < 1:
            raise ValueError(f"stats_chunks must be >= 1, got {self.stats_chunks}")


def inner_optimizer(params: Sequence[torch.Tensor], inner: InnerConfig) -> torch.optim.AdamW:
    """The inner AdamW over `params`, with no state."""
    return adamw(params, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))


@dataclass
class InstanceRound:
    """What one instance produced in one round."""

    delta: Sequence[torch.Tensor]  # a `PseudoGradient`, or on another training device Δ on the host
    tokens: int
    samples: int
    steps: int
    mean_loss: float
    stats: GradStats | None
    compute_s: float
    # Forward and backward passes by micro-batch size (the simulator's compute model, `StepCurve`).
    passes: Mapping[int, int] = field(default_factory=dict)


class Instance:
    """A model instance with persistent AdamW state, fed by its own token stream.

    `placement` says where θ and the round start live (default: with the model, as on a CPU);
    `autocast_dtype` is the precision of its forward passes (None: fp32), see `model/devices.py`.
    `batch_stats` is what the first step of a round gathers for the batch test: "sums" (the norm
    test's), "full" (also the inner products the augmented test needs) or "none".
    """

    def __init__(
        self,
        *,
        slot: int,
        model: torch.nn.Module,
        sampler: TokenSampler,
        inner: InnerConfig,
        placement: Placement | None = None,
        autocast_dtype: torch.dtype | None = None,
        batch_stats: BatchStats = "full",
        random_seed: int = 0,
    ) -> None:
        self.slot = slot
        self.batch_stats = batch_stats
        self.model = model
        self.sampler = sampler
        self.inner = inner
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        device = self.params[0].device
        self.placement = placement or Placement(train=device, state=device)
        self.autocast_dtype = autocast_dtype
        self.optimizer: torch.optim.Optimizer
        self.rebuild_optimizer()
        # Where the current round started: Δ = start − weights at the end of the round. Either θ's
        # own tensors (a round from θ that nothing moves meanwhile: no copy) or this instance's copy.
        self.start: list[torch.Tensor] = []
        self._own_start: list[torch.Tensor] | None = None
        # A round begun without recording its start (`begin(None, keep_start=False)`): the shift of
        # the update that lands gives it (θ itself), and Δ is read only after that.
        self._start_pending = False
        # The last round's Δ, read from the start and the weights while someone still holds it.
        self._delta: weakref.ref[PseudoGradient] | None = None
        # Where a Δ computed whole goes (`settle_delta`): tensors mapped from a file (the networked
        # node: `Peer.keep_state_on_disk`), or memory (None, or where the file cannot be made).
        self.delta_files: DeltaFiles | None = None
        # The round's forward and backward passes by micro-batch size (`InstanceRound.passes`).
        self.passes: Counter[int] = Counter()
        # Dropout's random stream, this instance's own: its masks do not depend on which other
        # instances share the process or in which order they train (the same θ on one device or
        # several). Swapped in for each round (`run_round`).
        self._random = _seeded_random(self.device, random_seed)
        # Data parallel over further devices (`parallel`): this instance's group, as its primary
        # (rank 0) or as a replica, and what the replicas need before the primary's next step.
        self.group: parallel.Group | None = None
        self._sync: parallel.Sync | None = None
        # The decoder layers' reduce-scatter where they are sharded over the group (`sharding`): a
        # replica's own layers, or, for the group's primary, its trainer's (a sharded copy), whose
        # weights and moments this instance's whole ones are behind after a step until gathered.
        self.sharded_layers: SummedReduceScatter | None = None
        self.trainer: Trainer | None = None
        self._behind: set[str] = set()
        # Where a sharded primary's gathered moments wait (`keep_moments`): (exp_avg's, exp_avg_sq's).
        self._moment_files: tuple[Files, Files] | None = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def rebuild_optimizer(self) -> None:
        """A new AdamW over `params`, with no state (the parameters were replaced: `sharding.shard`)."""
        self.optimizer = inner_optimizer(self.params, self.inner)

    def settle_delta(self) -> None:
        """Compute the last round's Δ whole if it is still held: the weights or the start (which may
        be θ itself) are about to change. Called by everything that changes them. With `delta_files`
        Δ goes into mapped files, a tensor's pages handed back once computed and once read
        (`PseudoGradient.done_with`): a round contributed late (a joiner's, a laggard's) is then not
        held whole while the node catches up (4 B/param)."""
        delta = self._delta() if self._delta is not None else None
        self._delta = None
        if delta is None or not delta.is_lazy:
            return
        files = None
        if self.delta_files is not None:
            try:
                files = self.delta_files(list(self.start))
            except OSError as e:  # (the folder took θ and m: it is gone or full since)
                logger.warning("the round's Δ stays in memory: its files cannot be made: %s", e)
        if files is None:
            delta.materialize()
        else:
            delta.materialize(files[0], hand_back=files[1])

    def join(self, spec: parallel.GroupSpec) -> None:
        """Join a data-parallel group (`parallel`): as its primary (rank 0) the replicas get this
        instance's weights and AdamW state before its next step; as a replica, the primary's."""
        self.leave()
        if self.sharded_layers is not None:
            raise RuntimeError("join: this instance's layers are sharded over a group already")
        self.group = parallel.Group(spec, self.device)
        self._sync = "all"
        if spec.sharded:
            from .sharding import Trainer, shard

            # The primary trains a sharded copy and keeps its whole weights; a replica's own are
            # never read: it shards them in place.
            if spec.rank == 0:
                self.trainer = Trainer(self)
            else:
                shard(self)

    def leave(self) -> None:
        """Leave this instance's data-parallel group, if it has one. A sharded primary drops its
        trainer, and its AdamW moments come back from host memory to train alone."""
        trained = self.trainer is not None
        self.trainer = None  # (before the group closes: its sharded modules hold the layers' group)
        if self.group is not None:
            self.group.close()
        self.group, self._sync = None, None
        if trained:
            self._behind = set()
            for p in self.params:
                for name, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.optimizer.state[p][name] = value.to(p.device)

    def serve_round(self) -> None:
        """As a replica, follow the primary's round (`parallel.serve_round`)."""
        if self.group is None or self.group.rank == 0:
            raise RuntimeError("serve_round: this instance is no replica")
        parallel.serve_round(self, self.group)

    def keep_moments(self, j: int, step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """A sharded primary's AdamW moments of parameter j, gathered whole from the shards
        (`parallel`), kept until they are scattered again: in files mapped beside θ's where the node
        keeps its state on disk (`delta_files`), their pages handed back once written, else in host
        memory. Its own AdamW never steps meanwhile: its trainer's does."""
        if self._moment_files is None and self.delta_files is not None:
            try:
                self._moment_files = (self.delta_files(self.params), self.delta_files(self.params))
            except OSError as e:
                logger.warning("the sharded instance's AdamW moments stay in memory: %s", e)
        p = self.params[j]
        state: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
        for k, (name, whole) in enumerate((("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))):
            if self._moment_files is None:
                state[name] = whole.detach().to("cpu", copy=True)
                continue
            tensors, hand_back = self._moment_files[k]
            tensors[j].copy_(whole)
            hand_back(j, 0, tensors[j].numel())
            state[name] = tensors[j]
        self.optimizer.state[p] = state

    def keep_moments_on_host(self) -> None:
        """After a sharded primary's moments were scattered into the shards: the whole ones go to
        host memory (from the device, where a state loaded put them), or their mapped pages back."""
        for j, p in enumerate(self.params):
            state = self.optimizer.state.get(p, {})
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    state[name] = value.to("cpu")
            if self._moment_files is not None:
                for _tensors, hand_back in self._moment_files:
                    hand_back(j, 0, p.numel())

    def _catch_up(self, *what: str) -> None:
        """A sharded primary's whole weights and/or moments (`what`), where its trainer's are ahead:
        gathered from the group's shards (every member takes part: only inside a round)."""
        behind = self._behind.intersection(what)
        if behind and self.group is not None:
            self.settle_delta()  # (the last round's Δ reads the whole weights the gather changes)
            parallel.lead_gather(self, self.group, weights="weights" in behind, moments="moments" in behind)
        self._behind -= behind

    def _moved(self, what: parallel.Sync = "weights") -> None:
        """The weights (or, "all", also the AdamW state) changed otherwise than by a step."""
        if self.group is not None and self._sync != "all":
            self._sync = what

    @contextlib.contextmanager
    def own_random(self) -> Iterator[None]:
        """Draw from this instance's own random stream (dropout) inside, the caller's after."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            _set_rng_state(self.device, self._random)
            yield
            self._random = _rng_state(self.device)

    @torch.no_grad()
    def load(
        self, theta: Sequence[torch.Tensor], *, on_read: Callable[[int, int, int], None] | None = None
    ) -> None:
        """Set the instance's parameters to θ (copied, so the instance never aliases global state).
        With `on_read`, θ is copied `LOAD_SPAN` values at a time, `on_read(j, start, stop)` after
        the flat values `start` to `stop` of tensor j (for a θ mapped from a file, whose pages the
        caller then hands back: `spill.MappedTensors`)."""
        self.settle_delta()
        if on_read is None:
            self.placement.load(self.params, theta)
        else:
            for j, (p, t) in enumerate(zip(self.params, theta, strict=True)):
                flat_p, flat_t = p.view(-1), t.reshape(-1)
                for at, stop in span_bounds(t.numel(), LOAD_SPAN):
                    flat_p[at:stop].copy_(flat_t[at:stop], non_blocking=self.placement.pin)
                    on_read(j, at, stop)
            self.placement.synchronize()
        self._moved()

    @property
    def start_is_shared(self) -> bool:
        """The round start is the caller's θ itself, not a copy (`begin(θ, share=True)`)."""
        return self._own_start is None or self.start is not self._own_start

    @property
    def start_pending(self) -> bool:
        """The round began without recording its start, and no shift has given it one yet."""
        return self._start_pending

    @torch.no_grad()
    def begin(
        self,
        theta: Sequence[torch.Tensor] | None,
        *,
        share: bool = False,
        keep_start: bool = True,
        on_read: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Start a round from θ, or (θ None: overlap) from the instance's own current weights.

        `share`: the start is θ's tensors themselves, saving a copy of the model. Only for a round
        in which the caller changes θ in place only after calling `settle_delta`, and shifts it only
        under mix or overwrite, which do not read the start.
        `keep_start` False (θ None): no copy of where the round started either. The caller shifts
        the instance onto θ (mix or overwrite) before it reads the round's Δ (`round_delta`), which is
        then measured from that θ: for a round that ended first, as if its update had landed after
        its last step (record 080). `on_read`: as `load`'s.
        """
        self.settle_delta()
        self._start_pending = False
        if theta is not None:
            self.load(theta, on_read=on_read)
        # A round that records no start of its own frees the copy an earlier round made.
        if theta is not None and share:
            self.start, self._own_start = list(theta), None
            return
        if theta is None and not keep_start:
            self.start, self._own_start, self._start_pending = [], None, True
            return
        if self._own_start is None:
            # On the state device: on a GPU the round start takes host memory, not device memory.
            self._own_start = [self.placement.state_copy(p) for p in self.params]
        else:
            for s, p in zip(self._own_start, self.params, strict=True):
                s.copy_(p)
        self.start = self._own_start

    @torch.no_grad()
    def shift(
        self,
        theta: Sequence[torch.Tensor],
        *,
        mode: str,
        mix: float = 0.5,
        on_read: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """The global θ changed while this instance trains on (overlap): carry its progress over;
        with `on_read`, `LOAD_SPAN` values at a time, as `load` reads θ.

        rebase: weights ← θ + (weights − start), the local progress of the round kept on top of θ.
        overwrite: weights ← θ, the progress since the round started is dropped.
        mix: weights ← mix·weights + (1 − mix)·θ (Streaming DiLoCo's α-mixing).
        In every mode the start becomes θ, so the round's Δ is measured from the global θ: a copy of
        it where the round keeps its own start, else θ's tensors themselves. An instance that has not
        begun a round yet (a joiner catching up before it trains) has no progress to carry: it simply
        starts from θ.
        """
        if mode not in ("rebase", "overwrite", "mix"):
            raise ValueError(f"unknown overlap mode {mode!r}")
        if not self.start and not self._start_pending:
            self.begin(theta, share=mode != "rebase", on_read=on_read)
            return
        self.settle_delta()
        self._catch_up("weights")  # (mid-round, a sharded primary's whole weights are behind)
        own = not self.start_is_shared
        if mode == "rebase" and not own:
            raise RuntimeError("shift(mode='rebase') needs a round begun with its own start")
        # θ and the start live on the state device: one tensor at a time crosses (no copy on a CPU).
        # Every operation is elementwise: a span at a time gives the same bits as a tensor at a time.
        for j, (whole_p, whole_t) in enumerate(zip(self.params, theta, strict=True)):
            span = LOAD_SPAN if on_read is not None else max(whole_t.numel(), 1)
            flat_p, flat_t = whole_p.view(-1), whole_t.reshape(-1)
            flat_start = self.start[j].view(-1) if own else flat_t  # (not own: the start is θ)
            for at, stop in span_bounds(whole_t.numel(), span):
                p, t = flat_p[at:stop], flat_t[at:stop]
                if mode == "rebase":
                    p.add_((t - flat_start[at:stop]).to(p.device))
                elif mode == "overwrite":
                    p.copy_(t)
                else:
                    p.mul_(mix).add_(t.to(p.device), alpha=1 - mix)
                if own:
                    flat_start[at:stop].copy_(t)
                if on_read is not None:
                    on_read(j, at, stop)
        if not own:
            self.start, self._start_pending = list(theta), False
        self._moved()

    def run_round(
        self,
        theta: Sequence[torch.Tensor] | None,
        *,
        plan: BatchPlan,
        steps: int,
        on_step: Callable[[int], None] | None = None,
        share_theta: bool = False,
        collect_stats: bool = True,
        on_read: Callable[[int, int, int], None] | None = None,
    ) -> InstanceRound:
        """Run `steps` optimizer steps of `plan`; return Δ and the round's statistics (none unless
        `collect_stats`: a batch already at the cap has no test left to take).

        With θ the round starts there (`share_theta`: from θ's own tensors, see `begin`). With None it
        continues a round `begin(None)` started, and Δ is measured from the start as `shift` may have
        moved it meanwhile. The gradients are freed when the round ends. Δ is a `PseudoGradient`
        read from the start and the weights: until the instance or θ next changes, which computes it
        whole first (`settle_delta`), it costs no memory; in a round begun with `keep_start` False
        and not shifted by its end it is empty, and `round_delta` gives it after the shift.
        `on_step(step)` runs after every step; `on_read` is `load`'s, for the round's start. The
        losses stay on the device until the round ends: no step waits for the host to read one.
        """
        self.settle_delta()
        if theta is not None:
            self.begin(theta, share=share_theta, on_read=on_read)
        self.model.train()
        self.passes = Counter()
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        stats: GradStats | None = None
        self._moved()  # (the weights a replica holds are those of the last round's end at most)
        try:
            with self.own_random():
                for step in range(steps):
                    loss, step_stats = self.inner_step(plan, collect_stats=collect_stats and step == 0)
                    # Nothing reads the gradients after the step they made: freed now, not at the
                    # next step's start, they leave their memory to what runs between (an update
                    # landing under overlap, its evaluation: 4 B/param at GPT-2 124M on a CPU).
                    self.optimizer.zero_grad(set_to_none=True)
                    losses.append(loss)
                    if step == 0:
                        stats = step_stats
                    if on_step is not None:
                        with torch.random.fork_rng(
                            devices=[self.device] if self.device.type == "cuda" else []
                        ):
                            on_step(step)  # the caller's draws (an evaluation, a scorer) are not ours
            if self.group is not None:
                self._catch_up("weights", "moments")
                parallel.lead_end(self.group)
        except BaseException as e:
            # The replicas may be mid-step, waiting for what will not come: leaving the group ends
            # their round at once (its connections close); the node forms it anew. The frames the
            # error passed through hold what raised, a sharded trainer perhaps, which holds the
            # layers' group open: they go first (their lines stay, `_frames_as_text`).
            _frames_as_text(e)
            self.leave()
            raise
        # Reading the mean waits for the last step: the compute time below includes it.
        mean_loss = float(torch.stack(losses).mean()) if losses else 0.0
        compute_s = time.perf_counter() - t0
        samples = plan.effective * steps
        return InstanceRound(
            delta=[] if self._start_pending else self.round_delta(),
            tokens=samples * self.sampler.seq_len,
            samples=samples,
            steps=steps,
            mean_loss=mean_loss,
            stats=stats,
            compute_s=compute_s,
            passes=dict(self.passes),
        )

    def round_delta(self) -> Sequence[torch.Tensor]:
        """The round's Δ = start − weights: a `PseudoGradient` (see `run_round`), or where training runs
        on another device, Δ on the host, whole. RuntimeError while the start awaits its shift."""
        if self._start_pending:
            raise RuntimeError("the round's Δ is read before the shift that gives its start")
        if self.placement.staged:
            # Training on another device: Δ comes to the host through the staging buffer, whole.
            return self.placement.delta(self.start, self.params)
        lazy = PseudoGradient(self.start, self.params)
        self._delta = weakref.ref(lazy)
        return lazy

    def inner_step(self, plan: BatchPlan, *, collect_stats: bool) -> tuple[torch.Tensor, GradStats | None]:
        """One AdamW step over plan.accum micro-batches; its mean loss (a 0-d tensor on the training
        device, not waited for) and optionally the per-micro-batch gradient stats."""
        self.settle_delta()
        collect_stats = collect_stats and self.batch_stats != "none"
        if self.group is not None:
            # The replicas' gradients are the batch test's samples: no chunks.
            if self._sync is not None:
                parallel.lead_sync(self, self.group, self._sync)
                self._sync = None
            gather = self.batch_stats if collect_stats else "none"
            if self.trainer is not None:
                self._behind = {"weights", "moments"}
            return parallel.lead_step(self, self.group, micro=plan.micro, accum=plan.accum, stats=gather)
        micro, accum = self._stats_split(plan) if collect_stats else (plan.micro, plan.accum)
        self.passes[micro] += accum
        if collect_stats and self.batch_stats == "sums" and accum >= 2:
            return self._step_with_sums(micro, accum)
        self.optimizer.zero_grad(set_to_none=True)
        # With statistics: each micro-batch and the random state it ran under (dropout), to replay it.
        replay: list[tuple[torch.Tensor, _RngState]] = []
        total_loss = torch.zeros((), device=self.device)
        for _ in range(accum):
            batch = self.sampler.next_batch(micro).to(self.device, non_blocking=True)
            if collect_stats:
                replay.append((batch, _rng_state(self.device)))
            with autocast(self.device, self.autocast_dtype):
                loss = causal_lm_loss(self.model, batch)
            torch.autograd.backward(loss / accum)
            total_loss += loss.detach().float()
        stats = None
        if len(replay) >= 2:
            after = _rng_state(self.device)
            stats = self._chunk_stats(replay, samples_per_grad=micro)
            _set_rng_state(self.device, after)
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.optimizer.step()
        return total_loss / accum, stats

    def _chunk_stats(
        self, replay: Sequence[tuple[torch.Tensor, _RngState]], *, samples_per_grad: int
    ) -> GradStats:
        """The norm-test statistics of the step's M micro-batch gradients g_m, tensor by tensor.

        The step's gradient (its .grad, the mean ḡ of the g_m) is already computed. A second
        backward pass per micro-batch, from the same weights and random state, yields each g_m one
        parameter tensor at a time: a hook reads it the moment it is accumulated, adds its terms to
        the sums, and frees it. So no copy of the model's gradients is ever held (the cost: one extra
        forward and backward of the round's first step).
        """
        mean = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        acc = _ChunkSums(len(replay), device=self.device)
        handles = []
        for p, g_mean in zip(self.params, mean, strict=True):
            p.grad = None
            handles.append(p.register_post_accumulate_grad_hook(acc.hook(g_mean)))  # type: ignore[no-untyped-call]
        get_lookup = getattr(self.model, "get_input_embeddings", None)
        tied = get_lookup() if callable(get_lookup) else None
        tied = tied if isinstance(tied, TiedEmbedding) else None
        if tied is not None:
            tied.defer_head = True  # beside ḡ, no V x D gradient while the activations are held
        try:
            for m, (batch, rng) in enumerate(replay):
                _set_rng_state(self.device, rng)
                acc.chunk = m
                with autocast(self.device, self.autocast_dtype):
                    loss = causal_lm_loss(self.model, batch)
                torch.autograd.backward(loss)
        finally:
            if tied is not None:
                tied.defer_head = False
            for handle in handles:
                handle.remove()
            for p, g_mean in zip(self.params, mean, strict=True):
                p.grad = g_mean
        return acc.stats(samples_per_grad=samples_per_grad)

    def _step_with_sums(self, micro: int, accum: int) -> tuple[torch.Tensor, GradStats]:
        """One AdamW step over `accum` micro-batches that gathers the norm test's sums on the way.

        Each chunk's backward starts with no gradient held; a hook takes each parameter's g_m[j]/M
        as soon as it is formed, adds its squared norm to the sums and moves it into the step's
        running sum (the tensor itself, no copy, added in the order autograd would add it), so the
        gradient, the weights after the step and the peak memory are those of a plain step.
        """
        self.optimizer.zero_grad(set_to_none=True)
        sums = RunningSums(len(self.params), device=self.device)
        handles = [
            p.register_post_accumulate_grad_hook(sums.hook(j))  # type: ignore[no-untyped-call]
            for j, p in enumerate(self.params)
        ]
        total_loss = torch.zeros((), device=self.device)
        try:
            for _ in range(accum):
                batch = self.sampler.next_batch(micro).to(self.device, non_blocking=True)
                with autocast(self.device, self.autocast_dtype):
                    loss = causal_lm_loss(self.model, batch)
                # Scaled as a plain accumulated step scales it: the hooks see g_m / M, and their sum
                # is that step's gradient bit for bit.
                torch.autograd.backward(loss / accum)
                total_loss += loss.detach().float()
        finally:
            for handle in handles:
                handle.remove()
        stats = sums.finish(self.params, num_grads=accum, samples_per_grad=micro)
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.optimizer.step()
        return total_loss / accum, stats

    def _stats_split(self, plan: BatchPlan) -> tuple[int, int]:
        """The (micro, accum) of the statistics step: the plan itself, or the batch cut into chunks."""
        if plan.accum > 1 or self.inner.stats_chunks < 2:
            return plan.micro, plan.accum
        chunks = min(self.inner.stats_chunks, plan.micro)
        # Keep the step's effective batch at least the plan's (never below b).
        return math.ceil(plan.micro / chunks), chunks

    @torch.no_grad()
    def absorb(
        self,
        others: Mapping[str, torch.Tensor],
        sampler: TokenSampler,
        *,
        weight: float,
        other_weight: float,
    ) -> None:
        """AdLoCo MIT merge, this instance surviving: weights become their weighted mean with the
        other's (`others`, by name, on any device: what its `surrender` gave), this instance keeps its
        AdamW state and takes over the other's data stream `sampler` (its compute share). Merges
        happen between local rounds (a merge decided mid-round waits for the round's end), so the
        round start, which the next round sets anew, is not merged. One tensor at a time: the merged
        weights never exist as a third copy of the model."""
        self.settle_delta()
        if others.keys() != dict(self.model.named_parameters()).keys():
            raise ValueError("cannot merge instances of different models")
        for name, p in self.model.named_parameters():
            other = others[name].to(p.device)
            merged = merge_weighted({name: p}, {name: other}, weight_a=weight, weight_b=other_weight)
            p.copy_(merged[name])
        self.sampler = self.sampler.merged_with(sampler)
        self._moved()

    def surrender(self) -> tuple[dict[str, torch.Tensor], TokenSampler]:
        """What an MIT merge takes of this instance, the one merged away: its weights by name and
        its data stream (`absorb`)."""
        self.settle_delta()
        return {name: p.detach() for name, p in self.model.named_parameters()}, self.sampler

    def close(self) -> None:
        """Leave its data-parallel group; nothing else to stop: this instance lives in the node's
        process (a `RemoteInstance` does not)."""
        self.leave()

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        self._moved("all")

    # ---- state dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Weights, AdamW moments and steps (by parameter index) and the sampler's state.

        Not the round start: a state is taken between rounds, and every round sets its start anew
        (checkpoints that hold one still load). The tensors are the live ones: save or copy the tree
        before the instance trains on. The optimizer's hyper-parameters are configuration, not
        state, and are left out.
        """
        optimizer = self.optimizer.state_dict()["state"]
        return {
            "params": [p.detach() for p in self.params],
            "optimizer": {str(idx): dict(fields) for idx, fields in optimizer.items()},
            "sampler": self.sampler.state_dict(),
            "random": list(self._random) if self._random[1] is not None else [self._random[0]],
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError if `load_state_dict(state)` would fail (another shape, a malformed tree)."""
        self._checked(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` (copied, so the instance never aliases it); the sampler continues
        the saved random sequence on its own stream. ValueError, nothing changed, if it does not fit."""
        params, moments = self._checked(state)
        self.settle_delta()
        with torch.no_grad():
            for p, saved_p in zip(self.params, params, strict=True):
                p.copy_(saved_p)
        # The config's hyper-parameters (lr, betas, ...) stay; only the moments and steps load, copied:
        # AdamW's load_state_dict keeps tensors that are already on the right device and dtype.
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            idx: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in fields.items()}
            for idx, fields in moments.items()
        }
        self.optimizer.load_state_dict(optimizer)
        self._moved("all")
        self.sampler.load_state_dict(state["sampler"])
        if "random" in state:  # (checkpoints from before dropout had a stream per instance have none)
            saved = state["random"]
            self._random = (saved[0].clone(), saved[1].clone() if len(saved) > 1 else self._random[1])

    def _checked(self, state: Mapping[str, Any]) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
        with malformed("instance state"):
            params = tensors_like(state["params"], self.params, "instance parameters")
            moments: dict[int, dict[str, Any]] = {}
            for idx, fields in mapping(state["optimizer"], "instance optimizer").items():
                if not idx.isdigit() or int(idx) >= len(self.params):
                    raise ValueError(f"instance optimizer: no parameter {idx!r}")
                shape = self.params[int(idx)].shape
                for name, value in mapping(fields, f"instance optimizer {idx}").items():
                    # Every tensor of AdamW's state but the step count has the parameter's shape.
                    if isinstance(value, torch.Tensor) and name != "step" and value.shape != shape:
                        raise ValueError(f"instance optimizer {idx}.{name}: shape {tuple(value.shape)}")
                moments[int(idx)] = dict(fields)
            self.sampler.check_state_dict(state["sampler"])
            if "random" in state:
                _check_random(state["random"], self.device)
        return params, moments


_RngState = tuple[torch.Tensor, torch.Tensor | None]


def _rng_state(device: torch.device) -> _RngState:
    """The random state a forward pass draws from (dropout): the CPU one, and the device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _seeded_random(device: torch.device, seed: int) -> _RngState:
    """The random state `_rng_state` gives, of generators seeded with `seed`."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    return cpu, torch.Generator(device).manual_seed(seed).get_state() if device.type == "cuda" else None


def _check_random(saved: Any, device: torch.device) -> None:
    """ValueError unless `saved` is the CPU's random state and, on a GPU, the device's."""
    if not isinstance(saved, list) or not 1 <= len(saved) <= 2:
        raise ValueError("instance random state: not a list of one or two states")
    for state, where in zip(saved, (torch.device("cpu"), device), strict=False):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError("instance random state: not a byte tensor")
        try:
            torch.Generator(where).set_state(state)
        except RuntimeError as e:
            raise ValueError(f"instance random state: {e}") from None


def _set_rng_state(device: torch.device, state: _RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


# Elements per slice of a gradient tensor in the norm-test sums (4 MiB of fp32 temporaries).
STATS_SLICE = 1 << 20


def _frames_as_text(error: BaseException) -> None:
    """Drop the frames `error` passed through below the one handling it, their lines kept as a note
    on it: a frame keeps the function it ran, and with its closure what that function saw (a
    module's `_call_impl` keeps the module), however its locals are cleared."""
    tb = error.__traceback__
    if tb is not None and tb.tb_next is not None:
        text = "".join(traceback.format_tb(tb.tb_next)).rstrip()
        add_note = getattr(error, "add_note", None)  # (Python 3.11 on; 3.10 logs them)
        if add_note is not None:
            add_note(text)
        else:
            logger.debug("the error's frames:\n%s", text)
        tb.tb_next = None


class RunningSums:
    """The norm test's sums over M micro-batch gradients that arrive one tensor at a time, in one pass.

    Each h = g_m[j]/M adds ||h||² (float64, on the device) and is moved into the running sum of
    parameter j, which ends as the step's gradient ḡ[j]; `finish` returns ||ḡ||² and
    S = M²·Σ_m ||g_m/M||² − M·||ḡ||² (= Σ_m ||g_m − ḡ||², clamped at 0 against rounding).
    The inner products ⟨g_m, ḡ⟩ are not measured: each is reported as their mean ||ḡ||², so the
    inner-product terms are 0 (only the augmented test reads them, and it gathers `_ChunkSums`).
    """

    def __init__(self, num_params: int, *, device: torch.device) -> None:
        self.sq_norms = torch.zeros((), dtype=torch.float64, device=device)
        self.sums: list[torch.Tensor | None] = [None] * num_params

    def hook(self, j: int) -> Callable[[torch.Tensor], None]:
        """A post-accumulate-grad hook for parameter j."""

        def read(param: torch.Tensor) -> None:
            with torch.no_grad():
                g = param.grad
                assert g is not None
                param.grad = None  # the next chunk's backward forms g_{m+1}[j] afresh
                self.sq_norms += squared_norm(g)
                held = self.sums[j]
                if held is None:
                    self.sums[j] = g
                else:
                    held.add_(g)

        return read

    def finish(self, params: Sequence[torch.Tensor], *, num_grads: int, samples_per_grad: int) -> GradStats:
        """Set every parameter's gradient to ḡ and return the statistics."""
        sq_norm = torch.zeros((), dtype=torch.float64, device=self.sq_norms.device)
        for p, total in zip(params, self.sums, strict=True):
            if total is not None:
                sq_norm += squared_norm(total)
            p.grad = total
        self.sums = []
        mean_sq = float(sq_norm)
        return stats_from_sums(
            sq_dev=max(0.0, num_grads * num_grads * float(self.sq_norms) - num_grads * mean_sq),
            sq_norm=mean_sq,
            ip=[mean_sq] * num_grads,
            samples_per_grad=samples_per_grad,
        )


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """||tensor||² in float64, a slice of at most STATS_SLICE values at a time."""
    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for start in range(0, flat.numel(), STATS_SLICE):
        part = flat[start : start + STATS_SLICE].float()
        total += torch.dot(part, part).double()
    return total


class _ChunkSums:
    """The sums of `GradStats` over M micro-batch gradients g_m that arrive one tensor at a time.

    For each parameter tensor j of each g_m: S += ||g_m[j] − ḡ[j]||² and ip_m += ⟨g_m[j], ḡ[j]⟩,
    kept as float64 on the device (one number per tensor crosses to the host only at the end).
    """

    def __init__(self, num_grads: int, *, device: torch.device) -> None:
        self.chunk = 0
        self.sq_dev = torch.zeros((), dtype=torch.float64, device=device)
        self.sq_norm = torch.zeros((), dtype=torch.float64, device=device)
        self.ip = torch.zeros(num_grads, dtype=torch.float64, device=device)

    def hook(self, mean: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """A post-accumulate-grad hook for one parameter whose step gradient (ḡ[j]) is `mean`."""
        counted = False

        def read(param: torch.Tensor) -> None:
            nonlocal counted
            with torch.no_grad():
                g = param.grad
                assert g is not None
                param.grad = None  # read and freed: no copy of the model's gradients builds up
                flat, flat_mean = g.reshape(-1), mean.reshape(-1)
                # A slice at a time: the difference is a temporary of at most STATS_SLICE elements.
                for start in range(0, flat.numel(), STATS_SLICE):
                    g_j = flat[start : start + STATS_SLICE].float()
                    mean_j = flat_mean[start : start + STATS_SLICE].float()
                    dev = g_j - mean_j
                    self.sq_dev += torch.dot(dev, dev).double()
                    self.ip[self.chunk] += torch.dot(g_j, mean_j).double()
                    if not counted:
                        self.sq_norm += torch.dot(mean_j, mean_j).double()
                counted = True

        return read

    def stats(self, *, samples_per_grad: int) -> GradStats:
        """`GradStats` of the sums (ValueError on non-finite gradients, as `grad_stats`)."""
        return stats_from_sums(
            sq_dev=float(self.sq_dev),
            sq_norm=float(self.sq_norm),
            ip=[float(v) for v in self.ip],
            samples_per_grad=samples_per_grad,
        )
