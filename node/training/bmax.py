"""b_max: the largest micro-batch one optimizer step fits in memory (AdLoCo's hardware batch limit).

On CUDA it is found by binary search over real forward+backward+AdamW steps, treating an
out-of-memory error as "does not fit" (AdLoCo `utils/max_batch_calculator.py`, with the same 0.9
safety factor). On CPU an OOM kills the process instead of raising, so we measure instead: the bytes
autograd saves for backward at batch 1 and 2 (exactly, with saved-tensor hooks) give the activation
memory per sample, and b_max is what fits into a memory budget after weights, gradients and AdamW
state. Switch mode (gradient accumulation) takes over above b_max.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

SAFETY = 0.9
UPPER = 4096


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


def saved_activation_bytes(model: torch.nn.Module, *, batch: int, seq_len: int, vocab_size: int) -> int:
    """Bytes autograd keeps for backward after one forward pass at this batch size."""
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    del loss
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # Parameters saved for backward are not activations: they exist at any batch size.
    for p in model.parameters():
        if p.untyped_storage().data_ptr() in seen and p.untyped_storage().data_ptr() in param_ptrs:
            total -= p.untyped_storage().nbytes()
            seen.discard(p.untyped_storage().data_ptr())
    return total


def cpu_b_max(
    model: torch.nn.Module, *, seq_len: int, vocab_size: int, budget_bytes: int, instances: int = 1
) -> int:
    """b_max on CPU from measured activation bytes per sample and a memory budget for all instances."""
    n_params = sum(p.numel() for p in model.parameters())
    # fp32 weights + gradients + AdamW's two moments, per instance.
    static = 16 * n_params * instances
    a1 = saved_activation_bytes(model, batch=1, seq_len=seq_len, vocab_size=vocab_size)
    a2 = saved_activation_bytes(model, batch=2, seq_len=seq_len, vocab_size=vocab_size)
    per_sample = max(a2 - a1, 1)
    fixed = max(a1 - per_sample, 0)
    room = SAFETY * budget_bytes - static - fixed
    b_max = int(room // per_sample) if room > 0 else 1
    return max(1, min(b_max, UPPER))


def cuda_b_max(try_step: Callable[[int], None], *, upper: int = UPPER) -> int:
    """Largest b in [1, upper] for which try_step(b) does not raise CUDA OOM (binary search)."""
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
    return max(1, int(lo * SAFETY) if lo > 1 else lo)


def probe_b_max(
    model: torch.nn.Module,
    *,
    seq_len: int,
    vocab_size: int,
    instances: int,
    memory_budget_bytes: int | None = None,
) -> int:
    """b_max for `model` on its device; the budget (CPU) defaults to half of available memory."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return _probe_cuda(model, seq_len=seq_len, vocab_size=vocab_size)
    budget = memory_budget_bytes or available_memory_bytes() // 2
    b = cpu_b_max(model, seq_len=seq_len, vocab_size=vocab_size, budget_bytes=budget, instances=instances)
    logger.info("b_max=%d (CPU, budget %.1f GiB, %d instance(s))", b, budget / 2**30, instances)
    return b


def _probe_cuda(model: torch.nn.Module, *, seq_len: int, vocab_size: int) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    device = next(model.parameters()).device

    def try_step(b: int) -> None:
        x = torch.randint(0, vocab_size, (b, seq_len), device=device)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        b = cuda_b_max(try_step)
    finally:
        model.load_state_dict(state)
        optimizer.zero_grad(set_to_none=True)
    logger.info("b_max=%d (CUDA, %s)", b, torch.cuda.get_device_name(device))
    return b


def default_threads() -> int:
    """Intra-op threads: the CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
