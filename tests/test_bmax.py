"""b_max probing: the CPU estimate from measured activation bytes, and the CUDA binary search rule."""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import torch

from adloco.errors import UserError
from adloco.node.model.bmax import (
    SAFETY,
    activation_bytes,
    b_max_of,
    cuda_b_max,
    fitting_rows,
    saved_activation_bytes,
    static_bytes,
)
from adloco.node.model.model import build_model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(None, seed=0)


def test_activation_bytes_grow_linearly_with_batch(model: torch.nn.Module) -> None:
    a1, a2, a4 = (saved_activation_bytes(model, batch=b, seq_len=64, vocab_size=256) for b in (1, 2, 4))
    assert 0 < a1 < a2 < a4
    per_sample = a2 - a1
    assert a4 - a2 == pytest.approx(2 * per_sample, rel=0.05)
    # Activations, not parameters: the tiny model's 0.6M fp32 weights (2.4 MB) are excluded.
    assert per_sample < 2 * a1


def test_probing_leaves_no_graph_behind(model: torch.nn.Module) -> None:
    def graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    before = graph_tensors()
    saved_activation_bytes(model, batch=2, seq_len=64, vocab_size=256)
    assert graph_tensors() == before  # the forward's graph (its logits...) is gone with the probe


def test_the_estimated_b_max_follows_the_budget(model: torch.nn.Module) -> None:
    small = b_max_of(fitting_rows(model, seq_len=64, vocab_size=256, budget_bytes=64 << 20))
    large = b_max_of(fitting_rows(model, seq_len=64, vocab_size=256, budget_bytes=512 << 20))
    assert 1 <= small < large
    # Two instances hold two copies of weights, gradients and AdamW state: less room.
    assert fitting_rows(model, seq_len=64, vocab_size=256, budget_bytes=64 << 20, instances=2) <= small
    # A budget below the static memory still gives 1 (switch mode then accumulates everything).
    assert fitting_rows(model, seq_len=64, vocab_size=256, budget_bytes=1 << 20) < 1
    assert b_max_of(fitting_rows(model, seq_len=64, vocab_size=256, budget_bytes=1 << 20)) == 1


@pytest.mark.parametrize("fits_up_to", [1, 7, 100, 4096])
def test_cuda_search_finds_the_largest_fitting_batch(fits_up_to: int) -> None:
    tried: list[int] = []

    def try_step(b: int) -> None:
        tried.append(b)
        if b > fits_up_to:
            raise torch.cuda.OutOfMemoryError("simulated")

    if not torch.cuda.is_available():
        torch.cuda.empty_cache = lambda: None  # no-op without CUDA anyway
    b = cuda_b_max(try_step)
    assert b == max(1, int(fits_up_to * 0.9) if fits_up_to > 1 else fits_up_to)
    assert len(tried) <= 13  # log2(4096) + 1 probes


def test_cuda_search_says_so_when_not_even_one_sequence_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    def try_step(b: int) -> None:
        raise torch.cuda.OutOfMemoryError("simulated")

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(UserError, match="--b-max: not even one sequence"):
        cuda_b_max(try_step)


def test_fitting_rows_says_whether_one_sequence_fits_beside_the_static_memory(model: torch.nn.Module) -> None:
    """The line `--data-parallel on` shards at: one sequence's activations (measured) beside the
    static memory, the safety factor taken off the budget."""
    fixed, per_sample = activation_bytes(model, seq_len=64, vocab_size=256)
    need = static_bytes(model, instances=1, state_on_device=True) + fixed + per_sample
    kwargs: dict[str, Any] = {"seq_len": 64, "vocab_size": 256}
    assert fitting_rows(model, **kwargs, budget_bytes=math.ceil(need / SAFETY) + 1) == 1
    assert fitting_rows(model, **kwargs, budget_bytes=math.floor(need / SAFETY) - 64) == 0
    # two models training at once: both models' static memory, both one's activations
    two: dict[str, Any] = {"instances": 2, "concurrent": 2}
    need_two = static_bytes(model, instances=2, state_on_device=True) + 2 * (fixed + per_sample)
    assert fitting_rows(model, **kwargs, **two, budget_bytes=math.ceil(need / SAFETY) + 1) < 1
    assert fitting_rows(model, **kwargs, **two, budget_bytes=math.floor(need_two / SAFETY) - 64) == 0
    assert fitting_rows(model, **kwargs, **two, budget_bytes=math.ceil(need_two / SAFETY) + 1) == 1
