"""b_max: the largest micro-batch one optimizer step fits in memory (AdLoCo's hardware batch limit).

On CUDA it is found by binary search over real forward+backward+AdamW steps, treating an
out-of-memory error as "does not fit" (AdLoCo `utils/max_batch_calculator.py`, with the same 0.9
safety factor), while the memory the other instances' gradients and AdamW state and the statistics
pass will take is held aside. On CPU an OOM kills the process instead of raising, so we measure
instead: the bytes autograd saves for backward at batch 1 and 2 (exactly, with saved-tensor hooks)
give the activation memory per sample, and b_max is what fits into a memory budget after every
instance's weights, gradients and AdamW state, the statistics buffers and, on a CPU, the peer's
state (θ, m, Δ, the error-feedback residual). Both probe with the training's precision (autocast)
and activation checkpointing (a property of the model). Switch mode (gradient accumulation) takes
over above b_max.

A data-parallel group whose members shard the decoder layers (`Sharded`, record 084) is estimated
as the CPU is, on a GPU too: its step cannot run on one device (that is why it shards), and each
member holds its share of the layers' weights, gradients and moments, the rest whole, FSDP2's
gathered blocks, and on the primary its instance's whole weights. The same estimate says when the
layers must be sharded (`fitting_rows`): `--data-parallel on` shards them where one whole model's training
does not fit a device and a member's does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import UserError
from .devices import adamw, autocast
from .loss import causal_lm_loss

logger = logging.getLogger(__name__)

SAFETY = 0.9
UPPER = 4096
# Bytes per parameter: an instance's fp32 weights, gradients and two AdamW moments; and the peer's
# state where it shares the device (θ, m, Δ and the error-feedback residual, fp32: an upper bound,
# the residual is bf16 by default).
INSTANCE_BYTES = 16
STATE_BYTES = 16
# The norm-test statistics pass (node/training/instances.py `_ChunkSums`) holds, beside the step's
# gradients, the micro-batch gradient it is reading and its deviation from the mean: at most this
# many tensors of the largest parameter's size at once.
STATS_TENSORS = 3
# FSDP2 holds a sharded block's whole weights while it runs and the next one's prefetched, and in the
# backward pass their whole gradients too until the reduce-scatter: at most this many blocks' fp32
# values beyond a member's shards.
GATHERED_BLOCKS = 4
# A sharded group's primary keeps its instance's whole fp32 weights beside its shard (record 084).
WHOLE_WEIGHT_BYTES = 4


@dataclass(frozen=True)
class Sharded:
    """An instance's decoder layers sharded over the `members` of its data-parallel group (the
    smallest group where they differ: the largest share): the layers hold `layer_params` of the
    model's parameters, the largest of their blocks `block_params`."""

    members: int
    layer_params: int
    block_params: int


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); a conservative 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def saved_activation_bytes(
    model: torch.nn.Module,
    *,
    batch: int,
    seq_len: int,
    vocab_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Bytes autograd keeps for backward after one forward pass at this batch size (in training
    mode, autocast to `autocast_dtype`, as an instance's forward runs)."""
    total = 0
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        # Detached: an output saved for its own backward would otherwise hold its grad_fn, a
        # reference cycle through autograd that Python's collector cannot see, and the whole graph
        # (the logits, 370 MB at batch 1 for GPT-2 124M) would outlive the probe.
        return t.detach()

    device = next(model.parameters()).device
    x = torch.randint(0, vocab_size, (batch, seq_len), device=device)
    was_training = model.training
    model.train()  # activation checkpointing acts in training mode only
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, autocast_dtype):
            loss = causal_lm_loss(model, x)
        del loss
    finally:
        model.train(was_training)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # Parameters saved for backward are not activations: they exist at any batch size.
    for p in model.parameters():
        if p.untyped_storage().data_ptr() in seen and p.untyped_storage().data_ptr() in param_ptrs:
            total -= p.untyped_storage().nbytes()
            seen.discard(p.untyped_storage().data_ptr())
    return total


def static_bytes(
    model: torch.nn.Module, *, instances: int, state_on_device: bool, sharded: Sharded | None = None
) -> int:
    """Memory that does not grow with the batch: the weights, gradients and AdamW moments of the
    `instances` models this memory holds, the statistics pass's buffers, and the peer's state where
    it shares the device. With `sharded`, each of the models is a member of a group sharding its
    layers: its share of theirs, the rest whole, FSDP2's gathered blocks and the other parameters'
    running sum over a step's passes (the norm test's samples, `sharding.PassNorms`); and each
    group's primary (one per `sharded.members` members, at least one) its instance's whole weights."""
    n_params = sum(p.numel() for p in model.parameters())
    largest = max((p.numel() for p in model.parameters()), default=0)
    state = STATE_BYTES * n_params if state_on_device else 0
    stats = STATS_TENSORS * 4 * largest
    if sharded is None:
        return INSTANCE_BYTES * n_params * instances + stats + state
    others = n_params - sharded.layer_params
    member = member_bytes(n_params, sharded) + GATHERED_BLOCKS * 4 * sharded.block_params + 4 * others
    primaries = -(-instances // sharded.members)
    return member * instances + WHOLE_WEIGHT_BYTES * n_params * primaries + stats + state


def member_bytes(n_params: int, sharded: Sharded) -> int:
    """The weights, gradients and AdamW moments a member of a group sharding the layers holds of a
    model of `n_params`: its share of the layers' (the largest), the other parameters' whole."""
    share = -(-sharded.layer_params // sharded.members)
    return INSTANCE_BYTES * (n_params - sharded.layer_params + share)


def activation_bytes(
    model: torch.nn.Module, *, seq_len: int, vocab_size: int, autocast_dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """What a forward pass keeps for backward: (fixed, per sample) bytes, measured at batch 1 and 2."""
    a1, a2 = (
        saved_activation_bytes(
            model, batch=b, seq_len=seq_len, vocab_size=vocab_size, autocast_dtype=autocast_dtype
        )
        for b in (1, 2)
    )
    per_sample = max(a2 - a1, 1)
    return max(a1 - per_sample, 0), per_sample


def fitting_rows(
    model: torch.nn.Module,
    *,
    seq_len: int,
    vocab_size: int,
    budget_bytes: int,
    instances: int = 1,
    concurrent: int = 1,
    autocast_dtype: torch.dtype | None = None,
    state_on_device: bool = True,
    sharded: Sharded | None = None,
    activations: tuple[int, int] | None = None,
) -> int:
    """How many sequences per step fit `budget_bytes` (with the safety factor; 0 or less: not one)
    beside the static memory of all `instances` models, for each of the `concurrent` ones training at
    once: from the activation bytes a forward pass saves, measured (or `activations`, measured
    before: `activation_bytes`). A CPU's estimate, and a sharded group's member's (`sharded`) on
    any device."""
    static = static_bytes(model, instances=instances, state_on_device=state_on_device, sharded=sharded)
    fixed, per_sample = activations or activation_bytes(
        model, seq_len=seq_len, vocab_size=vocab_size, autocast_dtype=autocast_dtype
    )
    room = SAFETY * budget_bytes - static - concurrent * fixed
    return int(room // (concurrent * per_sample))


def b_max_of(rows: int) -> int:
    """b_max where `rows` fit (`fitting_rows`): at least 1 (switch mode then accumulates the rest),
    at most `UPPER`."""
    return max(1, min(rows, UPPER))


def cuda_b_max(try_step: Callable[[int], None], *, upper: int = UPPER) -> int:
    """Largest b in [1, upper] for which try_step(b) does not raise CUDA OOM (binary search), times
    the safety factor. UserError when not even b = 1 fits."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            try_step(mid)
            lo = mid
        except torch.cuda.OutOfMemoryError:
            hi = mid - 1
        finally:
            torch.cuda.empty_cache()
    if lo == 0:
        raise UserError(
            "--b-max: not even one sequence per step fits in GPU memory; try --activation-checkpointing,"
            " --precision bf16, a shorter --seq-len, fewer --instances, a smaller --model, or on a node"
            " with twice as many GPUs as instances --data-parallel shard"
        )
    return max(1, int(lo * SAFETY) if lo > 1 else lo)


def probe_b_max(
    model: torch.nn.Module,
    *,
    seq_len: int,
    vocab_size: int,
    instances: int,
    concurrent: int = 1,
    memory_budget_bytes: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    state_on_device: bool = True,
    sharded: Sharded | None = None,
    activations: tuple[int, int] | None = None,
) -> int:
    """b_max for one of the `instances` models of `model` on its device's memory (`concurrent` of
    them training at once; with `sharded`, members of groups sharding its layers), whose forward
    passes autocast to `autocast_dtype`; `state_on_device`: the peer's θ, m, Δ and residual share
    that memory (a CPU peer). The budget is the device's memory (`memory_budget`); `activations`:
    the estimate's, measured before (`activation_bytes`)."""
    device = next(model.parameters()).device
    if device.type == "cuda" and sharded is None:
        return _probe_cuda(
            model, seq_len=seq_len, vocab_size=vocab_size, instances=instances, autocast_dtype=autocast_dtype
        )
    budget = memory_budget(device, memory_budget_bytes)
    rows = fitting_rows(
        model,
        seq_len=seq_len,
        vocab_size=vocab_size,
        budget_bytes=budget,
        instances=instances,
        concurrent=concurrent,
        autocast_dtype=autocast_dtype,
        state_on_device=state_on_device,
        sharded=sharded,
        activations=activations,
    )
    b = b_max_of(rows)
    layout = f"{instances} model(s)" if sharded is None else f"{instances} member(s) of {sharded.members}"
    logger.info("b_max=%d (%s, budget %.1f GiB, %s)", b, device.type.upper(), budget / 2**30, layout)
    return b


def memory_budget(device: torch.device, given: int | None = None) -> int:
    """The memory a device's models may take: on a GPU what is free on it and what torch holds there
    now (the model's weights: the static memory counts them); on the CPU `given`, else half of what
    is available."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_allocated(device)
    return given or available_memory_bytes() // 2


def _probe_cuda(
    model: torch.nn.Module,
    *,
    seq_len: int,
    vocab_size: int,
    instances: int,
    autocast_dtype: torch.dtype | None,
) -> int:
    """The binary search on `model`'s device. Every instance's weights are already there; the probe's
    AdamW stands for this instance's, and what the others' gradients and moments and the statistics
    pass will take is allocated aside for the whole search."""
    device = next(model.parameters()).device
    n_params = sum(p.numel() for p in model.parameters())
    # Without the per-instance weights (already allocated) and this instance's own 12 bytes.
    aside = static_bytes(model, instances=instances, state_on_device=False) - INSTANCE_BYTES * n_params
    aside -= 4 * n_params * (instances - 1)
    try:
        reserved = torch.empty(aside, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        raise UserError(
            f"--instances: the gradients and AdamW state of {instances} instances of this model do not"
            f" fit on {torch.cuda.get_device_name(device)}; use fewer --instances or a smaller --model"
        ) from None
    optimizer = adamw(list(model.parameters()), lr=0.0)
    model.train()

    def try_step(b: int) -> None:
        x = torch.randint(0, vocab_size, (b, seq_len), device=device)
        try:
            with autocast(device, autocast_dtype):
                loss = causal_lm_loss(model, x)
            torch.autograd.backward(loss)
            optimizer.step()
            torch.cuda.synchronize(device)
        finally:  # also after an OOM: the next try starts without this one's gradients
            optimizer.zero_grad(set_to_none=True)

    # The weights wait on the host (a copy on the device would take the memory being measured).
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    try:
        b = cuda_b_max(try_step)
    finally:
        del reserved
        optimizer.state.clear()  # the probe's AdamW moments: the instance's own come at its first step
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(saved[k])
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()
    logger.info("b_max=%d (CUDA, %s)", b, torch.cuda.get_device_name(device))
    return b


def default_threads() -> int:
    """Intra-op threads: the CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
