"""An instance's decoder layers sharded over its data-parallel group (FSDP2; issue 27 §2, record 084).

Record 064's replicas each hold the whole model and its AdamW state. Where that does not fit one
device, the group's members can shard the decoder layers instead (`fully_shard` on each block of
the model's layer list, `decoder_layers`): each member then holds 1/n of the layers' weights,
gradients and AdamW moments, and gathers a block's weights only while it runs. The rest (the
embeddings, the final norm, the head) stays whole on every member, its gradients summed by hand as
record 064 sums them: the node's fused loss head reads the head's weight outside any module's
forward pass, which a sharded root would not have gathered, and the layers are most of a large
model (a 7B Llama: 6.5 of its 6.7 B parameters).

What changes in a step (`parallel._step` with a sharded member):
- the layers' gradients are reduce-scattered by FSDP2 inside the backward pass, summed, not
  averaged (`SummedReduceScatter`: each member's loss is weighted by its rows' share, as in record
  064, so the sum is the batch's mean gradient; FSDP2's own average would need gloo's pre-scaled
  sum, which gloo does not have);
- the batch test's samples are the passes, not the members: FSDP2 sums the layers' gradients after
  every backward pass, so a member's gradient over several passes is never whole on it. Each pass's
  squared norm is read as it forms, the layers' in the reduce-scatter's input, the others' by a hook
  (`PassNorms`); the inner products of the augmented test are not (it needs a pass's gradient
  against the sum, held by other members), so a sharded instance takes the norm test;
- the clip's norm is summed over the members' shards (float64) and the gradients scaled by hand.

A replica shards its own model (`shard`); the primary trains a sharded copy (`Trainer`) and keeps
its instance's weights whole, for θ, Δ, merges and checkpoints. They cross into the shards and back
a tensor at a time (`scatter`, `gather`, driven by `parallel`'s headers): rank 0's whole tensor is
broadcast and each member keeps its slice (FSDP2's: `torch.chunk` along the first dimension);
gathering forms each whole tensor on every member in turn.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from ..model.bmax import Sharded
from ..model.devices import is_sharded
from ..model.loss import COMPILED_MARK
from ..model.model import compile_layers
from .instances import RunningSums, inner_optimizer, squared_norm

if TYPE_CHECKING:
    from .instances import Instance

# (torch 2.13 renamed it; the GPU machine's 2.11 has only the old name)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the `ModuleList` holding most of its parameters (Llama's
    `model.layers`, GPT-2's `transformer.h`, OPT's `decoder.layers`, ...). ValueError if it has none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of layers to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shares(model: nn.Module, members: int) -> Sharded:
    """What b_max's estimate counts of `model`'s layers sharded over `members` (`bmax.Sharded`): its
    layers' parameters and its largest block's. ValueError if it has no list of layers."""
    layers = decoder_layers(model)
    return Sharded(
        members,
        sum(p.numel() for p in layers.parameters()),
        max(sum(p.numel() for p in block.parameters()) for block in layers),
    )


class SummedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of a block's gradients as a plain sum, which also adds the squared norm
    of its input (this member's own gradient of the pass, before the sum; FSDP2 pads with zeros) to
    `own_sq` (float64, on the device) while `measuring`."""

    def __init__(self) -> None:
        self.measuring = False
        self.own_sq: torch.Tensor | None = None

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.measuring:
            sq = squared_norm(input_tensor)
            self.own_sq = sq if self.own_sq is None else self.own_sq + sq
        # (`op` is FSDP2's scaled sum for a divide factor of 1: the plain sum here, which gloo has)
        work: dist.Work | None = _REDUCE_SCATTER(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
        return work

    def take(self) -> float:
        """What was measured since the last `take` (one wait for a GPU), and start again from 0."""
        value = 0.0 if self.own_sq is None else float(self.own_sq)
        self.own_sq = None
        return value


class Shardable(Protocol):
    """What `shard` shards: a model whose parameter list and AdamW are rebuilt over its shards."""

    model: nn.Module
    params: list[torch.Tensor]
    sharded_layers: SummedReduceScatter | None

    def rebuild_optimizer(self) -> None: ...


def shard(member: Shardable) -> None:
    """Shard `member`'s decoder layers over the default process group (its data-parallel group,
    `parallel.Group` of a sharded spec) and rebuild its parameter list and AdamW over the new
    parameters (`fully_shard` replaces them; the optimizer starts with no state: the primary sends
    its moments before the next step). `member.sharded_layers` is then the layers' reduce-scatter."""
    comm = SummedReduceScatter()
    layers = decoder_layers(member.model)
    for block in layers:
        fully_shard(block)
        assert isinstance(block, FSDPModule)
        block.set_gradient_divide_factor(1.0)
        block.set_custom_reduce_scatter(comm)
    # The base model (what the fused head's loss calls) as FSDP2's root, holding none of the others'
    # parameters: without one, every layer is a root of its own, and a root keeps its gathered
    # weights from its forward pass to its backward (all the layers' whole weights, in every step).
    base = getattr(member.model, "base_model", member.model)
    in_layers = set(layers.parameters())
    fully_shard(base, ignored_params={p for p in base.parameters() if p not in in_layers})
    member.params = [p for p in member.model.parameters() if p.requires_grad]
    member.sharded_layers = comm
    member.rebuild_optimizer()


class Trainer:
    """What the primary of a sharded group trains: a copy of its instance's model with the layers
    sharded, and its AdamW. The instance keeps its whole weights (θ is loaded into them and Δ read
    out of them, as on one device), and its AdamW moments on the host: `parallel` scatters them into
    the shards before a step where they changed and gathers them back at the round's end."""

    def __init__(self, inst: Instance) -> None:
        self.model = copy.deepcopy(inst.model)  # (a deep copy is not compiled: compiled again below)
        self.inner = inst.inner
        self.autocast_dtype = inst.autocast_dtype
        self.passes = inst.passes
        self.params: list[torch.Tensor] = []
        self.sharded_layers: SummedReduceScatter | None = None
        self.optimizer: torch.optim.Optimizer
        shard(self)
        if getattr(inst.model, COMPILED_MARK, False):
            compile_layers(self.model)

    @property
    def device(self) -> torch.device:
        return local(self.params[0]).device

    def rebuild_optimizer(self) -> None:
        self.optimizer = inner_optimizer(self.params, self.inner)


def release() -> None:
    """Free what still holds a process group that sharded models used, once none is left: DTensor's
    caches keyed by the shards' specs or meshes (the sharding propagator's, in C++; the
    redistribution planners and their transforms, which gathering made), each holding the group's
    mesh, and the models' reference cycles. With the default group destroyed too, the group's
    connections then close: a member waiting in one of its collectives fails at once, and a group
    formed anew leaves nothing of its predecessor open. (The caches are torch's private ones, looked
    up by name: where one is missing, the group stays open until `parallel.Group.layers_timed`'s
    bound lets the others go.)"""
    from torch.distributed.tensor import _redistribute

    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
    ):
        if clear is not None:
            clear()
    gc.collect()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this member holds of `tensor`: its shard, or the whole tensor where it is not sharded."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_slice(whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The part of `whole` that member `rank` of `size` holds: FSDP2's shard, `torch.chunk` along the
    first dimension (empty for a member past the chunks of a short tensor)."""
    chunks = torch.chunk(whole, size, dim=0)
    return chunks[rank] if rank < len(chunks) else whole[:0]


@torch.no_grad()
def scatter(
    params: Sequence[torch.Tensor],
    whole: Sequence[torch.Tensor] | None,
    *,
    rank: int,
    size: int,
    broadcast: Callable[[list[torch.Tensor]], None],
) -> None:
    """Rank 0's `whole` tensors (None on the others) into every member's `params`, a tensor at a
    time: a sharded one's slice, a plain one whole. `broadcast` is the group's."""
    if (whole is None) != (rank != 0):
        raise ValueError("scatter: rank 0 and only rank 0 gives the whole tensors")
    for j, p in enumerate(params):
        held = local(p)
        if whole is not None:
            buffer = whole[j].detach().to(held.device)
        else:
            buffer = torch.empty(p.shape, dtype=p.dtype, device=held.device)
        broadcast([buffer])
        held.copy_(local_slice(buffer, rank, size) if isinstance(p, DTensor) else buffer)


@torch.no_grad()
def gather(params: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Every member's parameters whole, a tensor at a time (each member must take every one: a
    sharded tensor is gathered from all of them)."""
    for p in params:
        yield p.full_tensor() if isinstance(p, DTensor) else p.detach()


class PassNorms:
    """Σ over a step's passes of ‖G_p‖² / w_p, with G_p what pass p adds to the gradient (its loss
    weighted by its rows' share w_p of the batch): one batch-test sample per pass, read as it forms,
    the layers' in their reduce-scatter (`comm`), the other parameters' by hooks that move each
    pass's gradient into the step's (`RunningSums`, as one device's norm test reads them)."""

    def __init__(self, params: Sequence[torch.Tensor], comm: SummedReduceScatter) -> None:
        self.comm = comm
        self._plain = [p for p in params if not is_sharded(p)]
        self._sums = RunningSums(len(self._plain), device=self._plain[0].device)
        self.total = 0.0
        self.passes = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._sums.hook(k))  # type: ignore[no-untyped-call]
            for k, p in enumerate(self._plain)
        ]
        comm.measuring = True
        comm.take()

    def end_pass(self, weight: float) -> None:
        """After pass p's backward: add ‖G_p‖² / w_p."""
        self.total += (self.comm.take() + float(self._sums.sq_norms)) / weight
        self._sums.sq_norms.zero_()
        self.passes += 1

    def finish(self) -> None:
        """Stop reading, and give the other parameters their gradient: the passes' sum."""
        for handle in self._handles:
            handle.remove()
        self.comm.measuring = False
        for p, total in zip(self._plain, self._sums.sums, strict=True):
            p.grad = total
        self._sums.sums = []


def sq_norm(params: Sequence[torch.Tensor], *, all_reduce: Callable[[list[torch.Tensor]], Any]) -> float:
    """‖gradient‖² of a sharded instance, float64: the shards' squares summed over the group, the
    plain parameters' (whole, the same on every member) once."""
    device = local(params[0]).device
    shards = torch.zeros(1, dtype=torch.float64, device=device)
    plain = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None:
            continue
        held = local(p.grad).double()
        if is_sharded(p.grad):
            shards += torch.sum(held * held)
        else:
            plain += torch.sum(held * held)
    all_reduce([shards])
    return float(shards[0] + plain)


@torch.no_grad()
def clip(params: Sequence[torch.Tensor], max_norm: float, total_sq: float) -> None:
    """Scale every gradient as `clip_grad_norm_` does, from the whole gradient's squared norm."""
    coefficient = min(1.0, max_norm / (total_sq**0.5 + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coefficient)
