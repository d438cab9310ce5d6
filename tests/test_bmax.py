"""b_max probing: the CPU estimate from measured activation bytes, and the CUDA binary search rule."""

from __future__ import annotations

import gc

import pytest
import torch

from adloco.errors import UserError
from adloco.node.model.bmax import cpu_b_max, cuda_b_max, saved_activation_bytes
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


def test_cpu_b_max_follows_the_budget(model: torch.nn.Module) -> None:
    small = cpu_b_max(model, seq_len=64, vocab_size=256, budget_bytes=64 << 20)
    large = cpu_b_max(model, seq_len=64, vocab_size=256, budget_bytes=512 << 20)
    assert 1 <= small < large
    # Two instances hold two copies of weights, gradients and AdamW state: less room.
    assert cpu_b_max(model, seq_len=64, vocab_size=256, budget_bytes=64 << 20, instances=2) <= small
    # A budget below the static memory still gives 1 (switch mode then accumulates everything).
    assert cpu_b_max(model, seq_len=64, vocab_size=256, budget_bytes=1 << 20) == 1


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
