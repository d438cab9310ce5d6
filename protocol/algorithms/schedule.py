"""Schedule consensus: every peer computes the next round's schedule from the same gathered reports.

The schedule S_r holds, per MIT instance slot, the agreed batch b (AdLoCo stage 2), plus the inner
steps H and the codec. At the end of round r each peer gathers one `PeerReport` (report.py) per group member
(batch-test statistics per slot, its b_max, tokens, staleness) as all-reduce metadata, and calls
`next_schedule`, a deterministic function of (S_r, reports, config) that ignores report order, so
peers agree on S_{r+1} without another message (DESIGN.md §3 step 8). Switch mode (micro-batch and
accumulation per peer) is derived locally from the agreed b and each peer's own b_max.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .batchtest import BatchTest, GradStats, next_batch, pool_stats
from .merge import MergePolicy, choose_merge
from .report import PeerReport
from .switch import BatchPlan, plan_batch

__all__ = [
    "Schedule",
    "ScheduleConfig",
    "accumulation_for",
    "next_schedule",
    "swarm_accumulation",
]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What every peer of round `round` runs.

    batch: b per MIT instance slot (samples per optimizer step per peer). inner_steps: H, optimizer
    steps per round. codec: name of the pseudo-gradient codec. base_samples: the samples per round
    H·Σb that the "constant_tokens" policy holds; 0 until that policy pins it from the schedule it
    first sees.
    """

    round: int
    batch: tuple[int, ...]
    inner_steps: int
    codec: str = "none"
    base_samples: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", tuple(self.batch))
        _require_int("Schedule.round", self.round, minimum=0)
        if not self.batch:
            raise ValueError("Schedule.batch needs at least one instance slot")
        for b in self.batch:
            _require_int("Schedule.batch entry", b, minimum=1)
        _require_int("Schedule.inner_steps", self.inner_steps, minimum=1)
        _require_int("Schedule.base_samples", self.base_samples, minimum=0)
        if not isinstance(self.codec, str) or not self.codec:
            raise ValueError(f"Schedule.codec must be a non-empty string, got {self.codec!r}")

    @property
    def instances(self) -> int:
        """K, the number of MIT instance slots."""
        return len(self.batch)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, ints, str) for the DHT record and JSON/msgpack."""
        return {
            "round": self.round,
            "batch": list(self.batch),
            "inner_steps": self.inner_steps,
            "codec": self.codec,
            "base_samples": self.base_samples,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Inverse of `to_dict`; raises ValueError on missing, unknown or invalid fields."""
        _check_keys(
            "Schedule", data, required={"round", "batch", "inner_steps"}, optional={"codec", "base_samples"}
        )
        if not isinstance(data["batch"], (list, tuple)):
            raise ValueError(f"Schedule.batch must be a list, got {type(data['batch']).__name__}")
        return cls(**{**data, "batch": tuple(data["batch"])})


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How the schedule evolves; must be identical on all peers (it belongs in the run fingerprint).

    test: AdLoCo `sampling_method`: "norm" (norm test), "augmented" (augmented inner-product test)
        or "none" (constant batch). Use "augmented" if the norm test keeps b small while the loss
        plateaus noisily; "none" for a DiLoCo baseline.
    eta: η of the norm test (AdLoCo `ETA` 0.8; AdAdaGrad 0.1–0.5). Smaller η grows b faster: lower it
        if the loss is noisy between rounds, raise it if b races to batch_cap in the first rounds.
    theta: ϑ of the inner-product test (AdAdaGrad README 0.5). Lower grows b faster.
    nu: ν of the orthogonality test (AdAdaGrad README 1.0). Lower grows b faster.
    batch_cap: upper bound on b (research/algorithms.md §2.10.6). Raise it if b sits at the cap
        while the batch test still asks for more; lower it if rounds get too slow.
    batch_scope: "local" tests each peer's own b: every inner step is a local step, so its noise
        depends on b alone. "swarm" is AdLoCo's per-node form: b is a share of a global batch P·b
        over the P peers that reported statistics for the slot, so T is divided by P and b grows P
        times slower. Try "swarm" if b hits batch_cap early and rounds get slow in a large swarm.
    merge: when MIT instances merge (AdLoCo `merge_frequency`, and a floor on the instance count).
    inner_steps_policy: "fixed" keeps H. "constant_tokens" shrinks H as Σb grows so that H·Σb stays
        at the first schedule's value (research/algorithms.md §8: growing b also grows the size of Δ
        and the time per round). Use it if rounds get slower and slower as b grows.
        "hide_comm" sets H each round so that the local round hides the next exchange (DiLoCoX's
        T_comm ≤ H·t_step) from the members' reported step times and links and the codec's payload
        (`report.hiding_inner_steps`, computed by each peer from the same reports); with overlap the
        exchange then costs no compute time. Use it where rounds wait on the link.
    min_inner_steps: floor on H under "constant_tokens" and "hide_comm". Raise it if communication
        starts to dominate the round time.
    max_inner_steps: ceiling on H under "hide_comm": 200, the largest H measured within 2 % of
        H = 10's val loss at the same tokens (bench/h_bound.py; 500, DiLoCo's own H, was 7 % worse
        there). Past it the local models drift apart for longer than this scale was shown to
        tolerate; a link too slow for it gets a harsher codec instead (`--codec adaptive`) or waits.
    """

    test: BatchTest = "norm"
    eta: float = 0.8
    theta: float = 0.5
    nu: float = 1.0
    batch_cap: int = 512
    batch_scope: Literal["local", "swarm"] = "local"
    merge: MergePolicy = field(default_factory=MergePolicy)
    inner_steps_policy: Literal["fixed", "constant_tokens", "hide_comm"] = "fixed"
    min_inner_steps: int = 1
    max_inner_steps: int = 200

    def __post_init__(self) -> None:
        if self.test not in ("norm", "augmented", "none"):
            raise ValueError(f"test must be 'norm', 'augmented' or 'none', got {self.test!r}")
        for name in ("eta", "theta", "nu"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        _require_int("batch_cap", self.batch_cap, minimum=1)
        if self.batch_scope not in ("local", "swarm"):
            raise ValueError(f"batch_scope must be 'local' or 'swarm', got {self.batch_scope!r}")
        if not isinstance(self.merge, MergePolicy):
            raise ValueError(f"merge must be a MergePolicy, got {self.merge!r}")
        if self.inner_steps_policy not in ("fixed", "constant_tokens", "hide_comm"):
            raise ValueError(
                "inner_steps_policy must be 'fixed', 'constant_tokens' or 'hide_comm',"
                f" got {self.inner_steps_policy!r}"
            )
        _require_int("min_inner_steps", self.min_inner_steps, minimum=1)
        _require_int("max_inner_steps", self.max_inner_steps, minimum=self.min_inner_steps)


def next_schedule(
    current: Schedule,
    reports: Sequence[PeerReport],
    cfg: ScheduleConfig,
    *,
    codec: str | None = None,
    hiding_steps: int | None = None,
) -> tuple[Schedule, tuple[int, int] | None]:
    """Return (S_{r+1}, merge) from S_r and the reports gathered at the end of round r.

    Deterministic and independent of the order of `reports`. Steps:
    1. Reports whose slot count differs from S_r (made under another schedule) are ignored.
    2. Per slot, the peers' statistics are pooled (`pool_stats`) and b goes through the batch test.
    3. The merge decision (`choose_merge`) uses demand = the new b per slot and round = S_r.round + 1,
       the number of rounds completed, so with merge_every = 2 merges follow the 2nd, 4th, 6th ...
       round (AdLoCo: `outer_step % merge_frequency == 0` with 1-based outer steps).
    4. On a merge the survivor's b becomes min(batch_cap, b_survivor + b_victim), taking over the
       victim's compute share, and the victim slot is removed; later slots shift down by one.
    5. H follows cfg.inner_steps_policy; under "hide_comm" it is `hiding_steps` where the caller
       could work it out (`report.hiding_inner_steps`), else H stays.
    `merge` is (victim, survivor) in S_r's slot indices, or None.
    """
    # Sorting is for reproducible logs; pool_stats does not depend on order anyway.
    ordered = sorted(reports, key=lambda r: (r.peer_id, json.dumps(r.to_dict(), sort_keys=True)))
    usable = [r for r in ordered if len(r.slot_stats) == current.instances]
    batch = [
        _slot_batch(current.batch[k], [r.slot_stats[k] for r in usable], cfg)
        for k in range(current.instances)
    ]
    merge = choose_merge([float(b) for b in batch], round=current.round + 1, policy=cfg.merge)
    if merge is not None:
        victim, survivor = merge
        batch[survivor] = min(cfg.batch_cap, batch[survivor] + batch[victim])
        del batch[victim]
    base_samples = current.base_samples
    inner_steps = current.inner_steps
    if cfg.inner_steps_policy == "constant_tokens":
        if base_samples == 0:
            base_samples = current.inner_steps * sum(current.batch)
        total = sum(batch)
        # Round half up in integers so every peer gets the same H.
        inner_steps = max(cfg.min_inner_steps, (2 * base_samples + total) // (2 * total))
    elif cfg.inner_steps_policy == "hide_comm" and hiding_steps is not None:
        inner_steps = max(cfg.min_inner_steps, min(cfg.max_inner_steps, hiding_steps))
    nxt = Schedule(
        round=current.round + 1,
        batch=tuple(batch),
        inner_steps=inner_steps,
        codec=current.codec if codec is None else codec,
        base_samples=base_samples,
    )
    return nxt, merge


def accumulation_for(schedule: Schedule, b_max: int) -> tuple[BatchPlan, ...]:
    """Return this peer's switch-mode plan (micro-batch, accumulation) for every slot."""
    return tuple(plan_batch(b, b_max) for b in schedule.batch)


def swarm_accumulation(schedule: Schedule, reports: Sequence[PeerReport]) -> int:
    """Return the largest accumulation any reporting peer needs for this schedule (1 with no reports).

    Informational: the peer with the smallest b_max sets how long a round takes.
    """
    return max((plan.accum for r in reports for plan in accumulation_for(schedule, r.b_max)), default=1)


def _slot_batch(batch: int, stats: Sequence[GradStats | None], cfg: ScheduleConfig) -> int:
    pooled = pool_stats(stats)
    peers = sum(s is not None for s in stats)
    return next_batch(
        pooled,
        batch,
        test=cfg.test,
        eta=cfg.eta,
        theta=cfg.theta,
        nu=cfg.nu,
        cap=cfg.batch_cap,
        global_factor=max(1, peers) if cfg.batch_scope == "swarm" else 1,
    )


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_keys(what: str, data: Mapping[str, Any], *, required: set[str], optional: set[str]) -> None:
    missing = required - data.keys()
    unknown = data.keys() - required - optional
    if missing or unknown:
        raise ValueError(f"{what}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
