"""The simulator's compute model from a measured step-time curve (issue 27 §3).

Without a curve a simulated peer computes for `sec_per_sample` seconds per training sequence: time
linear in the batch, as on a CPU. A GPU's step time grows far less than linearly until the device
is full (GPT-2 124M on an H200: 49.5 ms at 8 sequences of 1024 tokens, 82 ms at 16, 301 ms at 64;
bench/results/step_curve_124m_h200.json), which is what makes larger batches and more instances
cheap. A `StepCurve` holds such a measurement (`bench/step_curve.py` writes it) and gives the time of
a round from its forward and backward passes by micro-batch size (`LocalRound.passes`).

Each pass is counted at the measured time of a whole step of its size, the optimizer's share
included: for accumulated micro-batches this overstates the time by the optimizer step (a few
percent of a step at 124M) per extra pass.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import UserError


@dataclass(frozen=True)
class StepCurve:
    """Seconds of one inner step against its batch size: (batch, seconds) points, batch increasing.

    Between two points the time is linear in the batch; below the first point it is the first
    point's (a step is never faster than the smallest one measured); past the last it grows in
    proportion to the batch (the device is full there: the measured curves are linear by then).
    """

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step curve needs at least one (batch, seconds) point")
        batches = [b for b, _ in self.points]
        if any(b < 1 for b in batches) or any(a >= b for a, b in itertools.pairwise(batches)):
            raise ValueError(f"step curve batches must be >= 1 and increasing, got {batches}")
        if not all(math.isfinite(s) and s > 0 for _, s in self.points):
            raise ValueError(f"step curve times must be finite and > 0, got {[s for _, s in self.points]}")

    @classmethod
    def load(cls, path: str | Path) -> StepCurve:
        """The curve of a `bench/step_curve.py` JSON file; UserError for a missing or malformed one."""
        try:
            data = json.loads(Path(path).read_text())
            points = tuple(sorted((int(p["batch"]), float(p["step_s"])) for p in data["points"]))
            label = f"{data.get('model', '?')} on {data.get('device', '?')}, seq {data.get('seq_len', '?')}"
            return cls(points, source=label)
        except OSError as e:
            raise UserError(f"--step-curve: cannot read {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"--step-curve: {path} is not a step curve (bench/step_curve.py): {e}") from None

    def step_s(self, batch: int) -> float:
        """Seconds of one step of `batch` sequences."""
        batches = [b for b, _ in self.points]
        i = bisect.bisect_left(batches, batch)
        if i < len(batches) and batches[i] == batch:
            return self.points[i][1]
        if i == 0:
            return self.points[0][1]
        if i == len(batches):
            last_b, last_s = self.points[-1]
            return last_s * batch / last_b
        (b0, s0), (b1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def round_s(self, passes: Mapping[int, int]) -> float:
        """Seconds of a round of `passes` (micro-batch size → how many forward and backward passes)."""
        return sum(n * self.step_s(micro) for micro, n in passes.items())
