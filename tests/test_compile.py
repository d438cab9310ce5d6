"""`--compile`: the instances' layers through torch.compile train as the eager ones do (issue 27 §1).

On this machine's CPU: Inductor builds C++ kernels with the host's compiler. The GPU figures come
from bench/overhead.py --compile (bench/gpu_session.sh).
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import replace
from typing import Literal

import pytest
import torch

from adloco.errors import UserError
from adloco.node.data.corpus import Corpus
from adloco.node.model import model as model_module
from adloco.node.model.loss import COMPILED_MARK
from adloco.node.model.model import build_model, compile_layers, compile_missing, resolve_compile
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.switch import BatchPlan

# Dropout off (a compiled layer draws its dropout masks with other kernels than the eager one), the
# batch test's statistics on (its hooks and its split first step run through the compiled layers).
CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=3, b_max=4, max_corpus_mb=1)


# Inductor's CPU kernels need a C++ compiler (.ci/run installs g++): without one, say so and skip.
needs_compiler = pytest.mark.skipif(
    compile_missing(torch.device("cpu")) is not None,
    reason=f"{compile_missing(torch.device('cpu'))} (apt-get install g++)",
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers names as not to be split: the ones `compile_layers` compiles."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _peer(corpus: Corpus, compile: Literal["auto", "on", "off"]) -> Peer:
    return Peer(
        peer_id="a", index=0, num_peers=1, cfg=replace(CFG, compile=compile), corpus=corpus, vocab_size=256
    )


def test_auto_compiles_on_a_gpu_only_and_a_bad_value_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a host with the compilers and headers (this one has gcc; a CUDA host is what is assumed).
    monkeypatch.setattr(model_module, "compile_missing", lambda device: None)
    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile("on", torch.device("cpu")) is True
    assert resolve_compile("off", torch.device("cuda")) is False
    with pytest.raises(UserError, match="--compile"):
        resolve_compile("yes", torch.device("cpu"))
    with pytest.raises(ValueError, match="compile must be"):
        TrainConfig(compile="yes")  # type: ignore[arg-type]


def test_without_a_compiler_auto_stays_eager_and_on_is_a_user_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host without gcc (the CUDA image's runtime base has none): Triton would fail at the first
    step; auto trains eager with a warning instead, and --compile on says what is missing."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_missing(cuda) is not None and compile_missing(cpu) is not None
    with caplog.at_level(logging.WARNING):
        assert resolve_compile("auto", cuda) is False
    assert "no C compiler" in caplog.text
    with pytest.raises(UserError, match="--compile on: no C compiler"):
        resolve_compile("on", cuda)
    with pytest.raises(UserError, match="--compile on: no C\\+\\+ compiler"):
        resolve_compile("on", cpu)
    assert resolve_compile("off", cuda) is False and resolve_compile("auto", cpu) is False


def test_each_layer_is_compiled_and_a_copy_is_not() -> None:
    model = build_model("tiny-llama", vocab_size=256)
    layers = _layers(model)
    assert layers and compile_layers(model) == len(layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert getattr(model, COMPILED_MARK) is True
    # A deep copy (an instance's, a scorer's) calls its own weights: torch drops the compiled call.
    twin = copy.deepcopy(model)
    assert all(m._compiled_call_impl is None for m in twin.modules())


@pytest.mark.long
@needs_compiler
def test_a_compiled_peer_trains_the_eager_peers_round(corpus: Corpus) -> None:
    """Both instances of a compiled peer (the second one a compiled copy) run the round an eager
    peer's run from the same θ on the same data: the same losses, batch-test statistics and Δ to
    float rounding (the compiled kernels add in another order)."""
    eager, compiled = _peer(corpus, "off"), _peer(corpus, "on")
    assert not eager.compiled and compiled.compiled
    assert all(inst.model._compiled_call_impl is None for inst in eager.local_instances)
    for inst in compiled.local_instances:
        layers = _layers(inst.model)
        assert layers and all(m._compiled_call_impl is not None for m in layers)
    theta = [p.detach().clone() for p in eager.local_instances[0].params]
    plan = BatchPlan(micro=4, accum=1)  # the first step cut in two for the test's statistics
    for ea, ca in zip(eager.local_instances, compiled.local_instances, strict=True):
        ra = ea.run_round(theta, plan=plan, steps=3)
        rb = ca.run_round(theta, plan=plan, steps=3)
        assert rb.mean_loss == pytest.approx(ra.mean_loss, rel=1e-5)
        assert ra.stats is not None and rb.stats is not None and rb.stats.num_grads == ra.stats.num_grads == 2
        assert rb.stats.sq_dev_sum == pytest.approx(ra.stats.sq_dev_sum, rel=1e-3)
        assert rb.stats.mean_sq_norm == pytest.approx(ra.stats.mean_sq_norm, rel=1e-3)
        # Elementwise, AdamW's normalization turns a rounding difference in a near-zero gradient into
        # up to lr of Δ: compared tensor by tensor in norm instead.
        for da, db in zip(ra.delta, rb.delta, strict=True):
            assert float((db - da).norm()) <= 1e-3 * float(da.norm())
