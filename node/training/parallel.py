"""An MIT instance trained data parallel over several devices (issue 27 §2).

With more devices than instances, a node's devices that hold no instance hold replicas: each further
device of an instance keeps a copy of its model and AdamW state in its worker process, joined with
the instance (the primary, rank 0) in a process group of its own (gloo on the CPU, NCCL on GPUs;
torch.distributed's process groups, built over a store the node serves on the loopback). An inner
step of a replicated instance:

- the primary draws the step's micro-batches from its data stream, as it would alone, and sends
  each to the replicas; every member trains its share of the rows (`share`), its loss weighted by
  that share, so that the gradients summed over the group are the batch's mean gradient;
- the gradients are summed in the group, bucket by bucket, before clipping and AdamW: every member
  then takes the same step from the same gradient, so the replicas stay the primary's copies, bit
  for bit, and the instance's Δ is the primary's;
- each member's own gradient is one sample g_m of the batch test (M = the group's size): the norm
  test's sums need one more scalar per member, the augmented test's inner products one per member
  too, so the statistics cost no extra pass (alone, the first step is cut into two chunks for them).

What a round needs besides the steps travels from the primary in the same group: at the round's
start its weights (they changed since the last round: θ loaded, a shift, a merge, a checkpoint
loaded) and, when they changed otherwise than by a step (a state loaded, the group new), the AdamW
moments; mid-round, after a shift (overlap's landing of an update), its weights before the next
step. A small header opens each of these, so a replica follows the primary's round without being
told anything else: `serve_round` runs until the primary says the round ended.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore
from torch.distributed.distributed_c10d import _set_pg_timeout

from ...protocol.algorithms.batchtest import GradStats, stats_from_sums
from ..model.devices import autocast, is_sharded
from ..model.loss import COMPILED_MARK, causal_lm_loss

if TYPE_CHECKING:
    from collections import Counter

    from .instances import InnerConfig, Instance
    from .sharding import SummedReduceScatter

# What a header announces (its first field).
_END, _STEP, _SYNC, _GATHER = 0, 1, 2, 3
# What a step gathers for the batch test (a header field): nothing, the norm test's sums, or also
# the inner products the augmented test needs.
_STATS = {"none": 0, "sums": 1, "full": 2}
_HEADER = 5
# Elements per bucket of the collectives: gradients and weights cross in flat buffers of at most
# this many elements (64 MiB of fp32), so a step makes tens of calls at 124M, not one per tensor,
# and holds at most one bucket beyond the model.
BUCKET = 1 << 24
# How long a member waits for the others: a replica waits through the primary's work between steps
# (an update landing, θ evaluated) and through the rounds of the node's other instances before its
# own begins. A dead member is noticed at once (its connections close); only a hung one waits this.
TIMEOUT = datetime.timedelta(minutes=30)
# The layers' collectives of a sharded group (FSDP2's, inside a step or a gather) wait for the others
# at most SLACK times what the operation takes at the rate measured on earlier ones, and never less
# than FLOOR_S (a scheduler's or a collector's pause): a member that failed inside one (an
# out-of-memory error in its forward pass) then lets the others go in about ten steps' time, not
# TIMEOUT (`Group.layers_timed`).
SLACK = 10.0
FLOOR_S = 30.0


@dataclass(frozen=True)
class GroupSpec:
    """Where and as what one member joins a group: the node's store, the group's name, its rank."""

    port: int
    name: str
    rank: int
    size: int
    # The members shard the instance's decoder layers (`sharding`, FSDP2) instead of each holding
    # the whole model: the layers' collectives then run in the process's default group.
    sharded: bool = False


def share(rows: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [lo, hi) of a micro-batch of `rows` that member `rank` of `size` trains: contiguous,
    as even as can be, the first members taking one more where they do not divide (a member may
    get none when the batch is smaller than the group)."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class Group:
    """One instance's process group, as one member sees it: bucketed collectives rooted at rank 0."""

    def __init__(self, spec: GroupSpec, device: torch.device) -> None:
        self.rank, self.size = spec.rank, spec.size
        self.device = device
        store = TCPStore("127.0.0.1", spec.port, None, False, timeout=TIMEOUT)
        prefixed = PrefixStore(spec.name, store)
        self._pg: Any  # gloo's or NCCL's backend: the same broadcast and allreduce
        self.sharded = spec.sharded
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if spec.sharded:
            # FSDP2 takes only a registered group: a process is in one group at most (a device's
            # process holds one primary or one replica, record 064), so its collectives run in the
            # default one. The headers and the rest run in a group of the node's own, as for
            # replicas: the default group outlives its registry (FSDP2's meshes hold it), so only
            # dropping a group of our own closes its connections when a member leaves.
            if dist.is_initialized():
                raise RuntimeError("a sharded group: this process is in one already")
            backend = "nccl" if device.type == "cuda" else "gloo"
            layers = PrefixStore("layers/", prefixed)
            dist.init_process_group(
                backend, store=layers, rank=spec.rank, world_size=spec.size, timeout=TIMEOUT
            )
        if device.type == "cuda":
            # (only CUDA builds of torch have NCCL's process group)
            from torch._C import _distributed_c10d as c10d

            nccl = c10d.ProcessGroupNCCL  # type: ignore[attr-defined,unused-ignore]
            self._pg = nccl(prefixed, spec.rank, spec.size, nccl.Options())
        else:
            self._pg = ProcessGroupGloo(prefixed, spec.rank, spec.size, TIMEOUT)
        self._store = store
        # Seconds per unit of each operation with the layers' collectives, the slowest measured
        # (`layers_timed`), and the shapes of the passes the group's steps have run.
        self._rate: dict[int, float] = {}
        self._limit = TIMEOUT
        self.shapes: set[tuple[int, int]] = set()

    def layers_timed(self, kind: int, units: int, *, fresh: bool = False) -> Callable[[], None]:
        """Start an operation with the layers' collectives (`kind`: a step or a gather; `units`: its
        size, the same on every member: a step's tokens) under a timeout from the rate measured on
        earlier ones: SLACK × rate × units, FLOOR_S at least; TIMEOUT where none was measured yet, or
        where the operation is `fresh` (it may compile: a group's first step, a compiled model's pass
        of a new shape). Returns what to call once it has ended: it measures the rate (not where
        `fresh`, nor where the operation raised). A member waits in one of the collectives at most for
        another's whole operation, and a member that raised inside one and lives on (its
        connections stay open: FSDP2's meshes hold the default group) leaves the others waiting until
        the timeout. On gloo the waiting member's collective then raises; NCCL's watchdog ends its
        process instead (a replica's worker: a lost device, `remote`)."""
        if not self.sharded:
            return lambda: None
        rate = self._rate.get(kind)
        limit = TIMEOUT
        if rate is not None and not fresh:
            limit = min(TIMEOUT, datetime.timedelta(seconds=max(SLACK * rate * units, FLOOR_S)))
        if limit != self._limit:
            _set_pg_timeout(limit)
            self._limit = limit
        start = time.perf_counter()

        def ended() -> None:
            if not fresh:
                self._rate[kind] = max(rate or 0.0, (time.perf_counter() - start) / units)

        return ended

    def header(self, fields: Sequence[int] = ()) -> list[int]:
        """The primary's header (rank 0 gives its fields), as every member receives it."""
        message = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            message[: len(fields)] = torch.tensor(list(fields), dtype=torch.int64)
        self.broadcast([message])
        return [int(v) for v in message.tolist()]

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's `tensors` into every member's (same shapes, dtypes and order everywhere)."""
        options = BroadcastOptions()
        options.rootRank = 0
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self._pg.broadcast([flat], options).wait()
            _unflat(flat, bucket)

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, inner_with_own: bool = False) -> float:
        """Sum `tensors` over the group in place. With `inner_with_own`: also Σ ⟨own, sum⟩ over all
        of them (float64), the member's own values read before the sum replaced them."""
        inner = 0.0
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            own = flat.clone() if inner_with_own else None
            self._pg.allreduce([flat]).wait()
            if own is not None:
                inner += float(torch.dot(own.double(), flat.double()))
            _unflat(flat, bucket)
        return inner

    def close(self) -> None:
        """Leave the group: the others' next collective fails at once (their connections close).
        The layers' group of a sharded one closes once no sharded model of this process holds it:
        until then, a member waiting in one of its collectives waits for `layers_timed`'s bound."""
        self._pg = None
        if self.sharded and dist.is_initialized():
            from . import sharding

            dist.destroy_process_group()
            sharding.release()
            self.sharded = False


def _buckets(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`tensors` in runs of one dtype of at most `BUCKET` elements (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() > BUCKET or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def _flat(bucket: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer with the bucket's values: the tensor itself when it is alone and contiguous."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        return bucket[0].view(-1)
    return torch.cat([t.reshape(-1) for t in bucket])


def _unflat(flat: torch.Tensor, bucket: Sequence[torch.Tensor]) -> None:
    if len(bucket) == 1 and bucket[0].is_contiguous():
        return  # the collective wrote into the tensor itself
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# ---- the primary's side ------------------------------------------------------------------------------


Sync = Literal["weights", "all"]


class Member(Protocol):
    """What trains in a member's steps (`_step`): an `Instance`, or a sharded primary's
    `sharding.Trainer`."""

    model: torch.nn.Module
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    inner: InnerConfig
    autocast_dtype: torch.dtype | None
    passes: Counter[int]
    sharded_layers: SummedReduceScatter | None

    @property
    def device(self) -> torch.device: ...


def lead_sync(inst: Instance, group: Group, what: Sync) -> None:
    """Send the replicas the primary's weights and, with "all", its AdamW moments and step counts
    (with sharded layers: from the instance's whole ones into every member's shards, its own
    trainer's included)."""
    group.header([_SYNC, 1 if what == "all" else 0])
    with torch.no_grad():
        member = inst.trainer or inst
        _broadcast_weights(member, group, inst.params)
        if what == "all":
            _broadcast_optimizer(member, group, inst)


def lead_step(
    inst: Instance, group: Group, *, micro: int, accum: int, stats: str
) -> tuple[torch.Tensor, GradStats | None]:
    """One inner step of a replicated instance, led by its primary (`Instance.inner_step`)."""
    cols = inst.sampler.seq_len
    group.header([_STEP, micro, accum, cols, _STATS[stats]])
    member: Member = inst
    if inst.trainer is not None:
        inst.trainer.passes = inst.passes
        member = inst.trainer
    return _step(
        member, group, micro=micro, accum=accum, cols=cols, stats=stats, draw=inst.sampler.next_batch
    )


def lead_gather(inst: Instance, group: Group, *, weights: bool, moments: bool) -> None:
    """A sharded primary takes its weights and/or its AdamW moments and step counts (into host
    memory) whole from every member's shards: its instance's whole ones are behind its trainer's
    after a step."""
    assert inst.trainer is not None
    group.header([_GATHER, int(weights), int(moments)])
    _gather(inst.trainer, group, inst, weights=weights, moments=moments)


def lead_end(group: Group) -> None:
    group.header([_END])


# ---- a replica's side --------------------------------------------------------------------------------


def serve_round(inst: Instance, group: Group) -> None:
    """A replica's round: follow the primary's headers until it ends its round."""
    stats_names = {v: k for k, v in _STATS.items()}
    with inst.own_random():
        while True:
            op, a, b, c, d = group.header()
            if op == _END:
                break
            if op == _SYNC:
                with torch.no_grad():
                    _broadcast_weights(inst, group, None)
                    if a:
                        _broadcast_optimizer(inst, group, None)
            elif op == _STEP:
                _step(inst, group, micro=a, accum=b, cols=c, stats=stats_names[d], draw=None)
            elif op == _GATHER:
                _gather(inst, group, None, weights=bool(a), moments=bool(b))
            else:
                raise RuntimeError(f"replica: unknown header {op}")
    inst.optimizer.zero_grad(set_to_none=True)


# ---- both ----------------------------------------------------------------------------------------------


def _broadcast_weights(member: Member, group: Group, whole: Sequence[torch.Tensor] | None) -> None:
    """The primary's weights (`whole`, None on the replicas) into every member's: in place where
    each holds them whole, a slice into each member's shard where the layers are sharded."""
    if member.sharded_layers is None:
        group.broadcast([p.detach() for p in member.params])
        return
    from . import sharding

    sharding.scatter(member.params, whole, rank=group.rank, size=group.size, broadcast=group.broadcast)


def _broadcast_optimizer(member: Member, group: Group, source: Instance | None) -> None:
    """AdamW's moments and step counts, from the primary (`source`: its instance, whose whole state
    it sends; None on the replicas) into every member's optimizer, each sharded one's slice: a step
    count of −1 says the primary has no state for that parameter yet (it never stepped)."""
    fused = bool(member.optimizer.param_groups[0].get("fused"))
    steps = torch.full((len(member.params),), -1.0, dtype=torch.float64, device=group.device)
    if source is not None:
        for j, p in enumerate(source.params):
            state = source.optimizer.state.get(p)
            if state:
                steps[j] = float(state["step"])
    group.broadcast([steps])
    moments: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    for j, p in enumerate(member.params):
        if steps[j] < 0:
            member.optimizer.state.pop(p, None)
            continue
        state = member.optimizer.state[p]
        if not state:
            step_device = p.device if fused else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"].fill_(float(steps[j]))
        moments += [state["exp_avg"], state["exp_avg_sq"]]
        if source is not None:
            held = source.optimizer.state[source.params[j]]
            whole += [held["exp_avg"], held["exp_avg_sq"]]
    if member.sharded_layers is None:
        group.broadcast(moments)  # (the primary's are its own: sent in place)
        return
    from . import sharding

    given = whole if source is not None else None
    sharding.scatter(moments, given, rank=group.rank, size=group.size, broadcast=group.broadcast)
    if source is not None:
        source.keep_moments_on_host()  # (until they are gathered again: `_gather`)


def _gather(member: Member, group: Group, into: Instance | None, *, weights: bool, moments: bool) -> None:
    """Every member's weights and/or AdamW moments whole, a tensor at a time, into the primary's
    instance (`into`; None on the replicas, which take part in each gather and keep nothing): its
    weights where they are, its moments in host memory."""
    from . import sharding

    # (its size in whole-model values gathered: the weights once, the moments twice)
    ended = group.layers_timed(_GATHER, int(weights) + 2 * int(moments))
    with torch.no_grad():
        for j, whole in enumerate(sharding.gather(member.params if weights else [])):
            if into is not None:
                into.params[j].copy_(whole)
        for j, p in enumerate(member.params if moments else []):
            state = member.optimizer.state.get(p)
            if not state:  # (the same on every member: each takes the same steps)
                continue
            exp_avg, exp_avg_sq = sharding.gather([state["exp_avg"], state["exp_avg_sq"]])
            if into is not None:
                into.keep_moments(j, float(state["step"]), exp_avg, exp_avg_sq)
    ended()


def _step(
    inst: Member,
    group: Group,
    *,
    micro: int,
    accum: int,
    cols: int,
    stats: str,
    draw: Callable[[int], torch.Tensor] | None,
) -> tuple[torch.Tensor, GradStats | None]:
    """One AdamW step over the group: the batch of `accum` micro-batches of `micro` rows (drawn by
    the primary as it would alone), this member's share of its rows trained in passes of at most
    `micro` (so a switch-mode step takes 1/size of the passes it takes alone), the gradients summed
    in the group, clipped and applied alike everywhere. Returns the batch's mean loss (a 0-d tensor)
    and, when `stats` asks, the batch test's statistics: one sample per member that trained, or with
    sharded layers (`sharding`) one per pass."""
    rows = micro * accum
    shapes = (
        {
            (b - a, cols)
            for r in range(group.size)
            for a, b in _passes(rows, micro, r, group.size, lockstep=True)
        }
        if group.sharded
        else set()  # (no layers' collectives: nothing to time)
    )
    # (a group's first step initializes FSDP2 and may compile; a compiled model recompiles for a new
    # pass shape, once, on every member: neither is measured nor bounded by a rate)
    fresh = not group.shapes or (getattr(inst.model, COMPILED_MARK, False) and not shapes <= group.shapes)
    ended = group.layers_timed(_STEP, rows * cols, fresh=fresh)
    if draw is not None:
        batch = torch.cat([draw(micro) for _ in range(accum)]).to(group.device)
    else:
        batch = torch.empty((rows, cols), dtype=torch.int64, device=group.device)
    group.broadcast([batch])
    lo, hi = share(rows, group.rank, group.size)
    weight = (hi - lo) / rows
    inst.optimizer.zero_grad(set_to_none=True)
    comm = inst.sharded_layers
    if comm is not None:
        from . import sharding  # (FSDP2's modules, a third of a second: imported where a group shards)
    gather = stats != "none"
    if comm is not None and stats == "full":
        raise ValueError("the augmented batch test needs whole gradients: sharded layers take the norm test")
    norms = sharding.PassNorms(inst.params, comm) if comm is not None and gather else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=inst.device)
    for first, last in _passes(rows, micro, group.rank, group.size, lockstep=comm is not None):
        # (a pass of no rows keeps a sharded member in step with the others' collectives: one row's
        # forward and backward, weighted 0)
        part = batch[first:last] if last > first else batch[:1]
        part = part.to(inst.device, non_blocking=True)
        with autocast(inst.device, inst.autocast_dtype):
            loss = causal_lm_loss(inst.model, part)
        # Each pass weighted by its rows' share of the batch: summed over the group, the batch's mean.
        torch.autograd.backward(loss * ((last - first) / rows))
        if last == first:
            continue
        loss_sum += loss.detach().double() * ((last - first) / rows)
        inst.passes[last - first] += 1
        if norms is not None:
            norms.end_pass((last - first) / rows)
    if norms is not None:
        norms.finish()
    grads = []
    for p in inst.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    # ||G_r||² / w_r = w_r·||g_r||²: g_r this member's mean gradient, G_r = w_r·g_r what it holds
    # (with sharded layers: the sum of the same over its passes, `sharding.PassNorms`).
    own_sq = 0.0
    if norms is not None:
        own_sq = norms.total
    elif gather and hi > lo:
        own_sq = _sq_norm(grads) / weight
    summed = grads if comm is None else [g for g in grads if not is_sharded(g)]
    with torch.no_grad():
        own_inner = group.all_reduce(summed, inner_with_own=stats == "full")
    # What every member needs: the loss, Σ_r w_r·||g_r||², how many samples, ⟨g_r, ḡ⟩ of each.
    scalars = torch.zeros(3 + group.size, dtype=torch.float64, device=group.device)
    scalars[0] = loss_sum.to(group.device)
    scalars[1] = own_sq
    if norms is not None:
        scalars[2] = norms.passes
    elif hi > lo:
        scalars[2] = 1.0
        scalars[3 + group.rank] = own_inner / weight
    group.all_reduce([scalars])
    step_stats = None
    samples = round(float(scalars[2]))
    whole_sq = None
    if comm is not None and (inst.inner.grad_clip > 0 or (gather and samples >= 2)):
        whole_sq = sharding.sq_norm(inst.params, all_reduce=group.all_reduce)
    if gather and samples >= 2:
        sq_norm = whole_sq if whole_sq is not None else _sq_norm(grads)
        # Σ_r w_r·||g_r − ḡ||² = Σ_r w_r·||g_r||² − ||ḡ||²; times M: S of M samples of equal size.
        sq_dev = samples * max(float(scalars[1]) - sq_norm, 0.0)
        if stats == "full":
            inner = [float(v) for v in scalars[3:]]
            ip = [
                inner[r]
                for r in range(group.size)
                if share(rows, r, group.size)[1] > share(rows, r, group.size)[0]
            ]
        else:
            ip = [sq_norm] * samples
        step_stats = stats_from_sums(
            sq_dev=sq_dev, sq_norm=sq_norm, ip=ip, samples_per_grad=max(1, round(rows / samples))
        )
    if inst.inner.grad_clip > 0:
        if whole_sq is not None:
            sharding.clip(inst.params, inst.inner.grad_clip, whole_sq)
        else:
            torch.nn.utils.clip_grad_norm_(inst.params, inst.inner.grad_clip)
    inst.optimizer.step()
    ended()
    group.shapes |= shapes
    return scalars[0].float().to(inst.device), step_stats


def _passes(rows: int, micro: int, rank: int, size: int, *, lockstep: bool) -> list[tuple[int, int]]:
    """The passes [first, last) in which member `rank` trains its share of a batch of `rows`: of at
    most `micro` rows each. In `lockstep` (sharded layers: every pass is a collective of the whole
    group) every member makes as many passes as the member with the most rows, its share split as
    evenly as can be (a pass may then be empty)."""
    lo, hi = share(rows, rank, size)
    if not lockstep:
        return [(first, min(first + micro, hi)) for first in range(lo, hi, micro)]
    most = share(rows, 0, size)
    count = max(1, -(-(most[1] - most[0]) // micro))
    return [(lo + a, lo + b) for a, b in (share(hi - lo, k, count) for k in range(count))]


def _sq_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Σ ||t||² over `tensors`, in float64 on their device, read once (one wait for a GPU)."""
    return float(torch.stack([torch.sum(t.double() * t.double()) for t in tensors]).sum())
