"""What decides θ gives the same bits on every CPU kernel path and thread count (issue 9 §3).

The subprocess test runs bench/kernel_paths.py: fresh processes with ATEN_CPU_CAPABILITY=default,
other thread counts, MKL on its AVX2 kernels and numpy without SIMD decode the same payloads, apply
them as `Peer._apply` does and run the adaptive chooser; every digest must equal the reference's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from adloco.protocol.algorithms.adaptive import relative_error
from adloco.protocol.algorithms.codecs import decode, make_codec
from adloco.protocol.algorithms.fixed_order import fixed_order_sum

from background import collect, kernel_paths

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("restore_threads")
def test_relative_error_is_the_same_bits_for_every_thread_count() -> None:
    # torch's own float64 sum of these squares differs in its last bit between 1 and 2 threads.
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 1e-3
    x_hat = decode(make_codec("int4").encode("x", x))
    errors = set()
    for threads in (1, 2, 3, 4):
        torch.set_num_threads(threads)
        errors.add(relative_error(x, x_hat).hex())
    assert len(errors) == 1, errors


def test_fixed_order_sum_is_accurate() -> None:
    x = torch.randn(333_333, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e3
    exact = math.fsum(x.tolist())
    assert fixed_order_sum(x) == pytest.approx(exact, rel=1e-13, abs=1e-9)
    assert fixed_order_sum(torch.tensor([1.5])) == 1.5
    assert fixed_order_sum(torch.zeros(0)) == 0.0
    assert fixed_order_sum(x[::3]) == pytest.approx(math.fsum(x[::3].tolist()), rel=1e-13, abs=1e-9)


def test_decode_outer_step_and_codec_choice_agree_across_kernel_paths(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # bench/kernel_paths.py --size small with five variants, started with the session in the
    # background (tests/background.py).
    run = collect(request, request.node.nodeid, lambda: tmp_path, kernel_paths)
    returncode, stdout, stderr = run.result(timeout=540)
    assert returncode == 0, stderr[-3000:]
    report = json.loads(stdout)
    capabilities = {v["capability"] for v in report["variants"].values()}
    assert "DEFAULT" in capabilities and len(capabilities) >= 2, report["variants"]
    assert {v["threads"] for v in report["variants"].values()} >= {1, 3}, report["variants"]
    # A low-rank codec's error is measured through an encode (matrix products with thousands of
    # terms, a QR) that is MKL's to order: known to differ in its last digits (docs/experiments.md).
    differ = {k: v for k, v in report["differences"].items() if not k.startswith("error lowrank")}
    assert differ == {}, json.dumps(differ, indent=1)
    assert len({tuple(c) for c in report["choices"].values()}) == 1, report["choices"]
