"""Shared by the simulator benchmarks: run a grid of `adloco-sim` runs, a few at a time."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def sim_curves(runs: Sequence[Sequence[str]], *, jobs: int) -> list[list[float]]:
    """The validation loss after each round of one `adloco-sim` run per argument list (each in a
    fresh output folder; `--quiet --threads 1` added), `jobs` runs at a time."""

    def one(index: int, args: Sequence[str], work: Path) -> list[float]:
        out = work / str(index)
        sim = [sys.executable, "-m", "adloco.node.cli.sim"]
        cmd = [*sim, *args, "--quiet", "--threads", "1", "--out", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return [float(r["val_loss"]) for r in json.loads((out / "results.json").read_text())]

    with tempfile.TemporaryDirectory(prefix="adloco-simgrid-") as tmp, ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda item: one(item[0], item[1], Path(tmp)), enumerate(runs)))
