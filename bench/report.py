"""docs/results.md from results.json: the goals of issue 11 against what was measured, then each
section's figures, tables and plots. Everything here is read from the JSON; nothing is typed in."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    section: str
    text: str
    # measured text and whether the goal is met (None: not measured), from the section's dict
    check: Callable[[dict[str, Any]], tuple[str, bool | None]]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(float(value)) else None


def _comm(s: dict[str, Any]) -> tuple[str, bool | None]:
    ratio, gap = _num(s.get("ratio_vs_ddp")), _num(s.get("val_loss_gap_pct"))
    if ratio is None or gap is None:
        return "–", None
    best = s.get("best", "?")
    text = f"{ratio:,.0f}× at {gap:+.2f} % ({best})"
    cheap = s.get("best_at_goal_ratio")  # the other end of a miss: the smallest gap at ≥ 5,000×
    if isinstance(cheap, dict) and _num(cheap.get("val_loss_gap_pct")) is not None and cheap["name"] != best:
        at, cheap_gap = cheap["ratio_vs_ddp"], cheap["val_loss_gap_pct"]
        text += f"; at ≥ 5,000×: {at:,.0f}× at {cheap_gap:+.2f} % ({cheap['name']})"
    return text, ratio >= 5000 and gap <= 2.0


def _ratio(a: str, b: str, goal: float, what: str) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    """a / b ≤ goal: `what` names the figure."""

    def check(s: dict[str, Any]) -> tuple[str, bool | None]:
        x, y = _num(s.get(a)), _num(s.get(b))
        if x is None or y is None or y == 0:
            return "–", None
        return f"{x:.4g} vs {y:.4g} {what}: {100 * (x / y - 1):+.1f} %", x / y <= goal

    return check


def _below(a: str, b: str) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    def check(s: dict[str, Any]) -> tuple[str, bool | None]:
        x, y = _num(s.get(a)), _num(s.get(b))
        if x is None or y is None:
            return "–", None
        return f"{x:.4f} vs {y:.4f}", x < y

    return check


def _at_least(key: str, goal: float, fmt: str) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    def check(s: dict[str, Any]) -> tuple[str, bool | None]:
        x = _num(s.get(key))
        return ("–", None) if x is None else (fmt.format(x), x >= goal)

    return check


def _at_most(key: str, goal: float, fmt: str) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    def check(s: dict[str, Any]) -> tuple[str, bool | None]:
        x = _num(s.get(key))
        return ("–", None) if x is None else (fmt.format(x), x <= goal)

    return check


GOALS = (
    Goal("comm", "≥ 5,000× fewer bytes per token than fp32 DDP at ≤ 2 % higher val loss", _comm),
    Goal(
        "convergence",
        "full AdLoCo reaches the target in ≥ 20 % fewer rounds than DiLoCo",
        _ratio("adloco_rounds_to_target", "diloco_rounds_to_target", 0.8, "rounds"),
    ),
    Goal(
        "convergence",
        "… and in ≥ 20 % less simulated time",
        _ratio("adloco_time_to_target_s", "diloco_time_to_target_s", 0.8, "s"),
    ),
    Goal(
        "heterogeneity",
        "HeLoCo ≥ 5 % lower val loss than async Nesterov at fixed tokens",
        _ratio("heloco_val_loss", "async_nesterov_val_loss", 0.95, "val loss"),
    ),
    Goal(
        "heterogeneity",
        "HeLoCo below sync DiLoCo at fixed simulated time",
        _below("heloco_val_loss_at_fixed_time", "sync_val_loss_at_fixed_time"),
    ),
    Goal(
        "system",
        "≥ 95 % compute utilization with overlap at 10 Mbit/s",
        _at_least("utilization_overlap_10mbit", 0.95, "{:.1%}"),
    ),
    Goal(
        "system",
        "all-reduce no slower than hivemind's DecentralizedAverager",
        _at_most("allreduce_s_vs_hivemind_ratio", 1.0, "{:.2f}×"),
    ),
    Goal(
        "overhead", "≤ 3 % inner-step overhead against a bare PyTorch loop", _at_most("pct", 3.0, "{:+.1f} %")
    ),
    Goal("scale", "64 simulated peers", _at_least("sim_peers_max", 64, "{:.0f}")),
    Goal("scale", "8 swarm nodes on this machine", _at_least("swarm_nodes_max", 8, "{:.0f}")),
)


def goals_table(results: dict[str, Any]) -> str:
    lines = ["| goal | measured | met |", "| --- | --- | --- |"]
    for goal in GOALS:
        section = results.get(goal.section, {})
        status = section.get("status", "not run")
        measured, met = goal.check(section) if status == "measured" else ("–", None)
        verdict = {True: "yes", False: "**no**", None: status}[met]
        if status == "measured" and met is None:
            verdict = "not measured"
        lines.append(f"| {goal.section}: {goal.text} | {measured} | {verdict} |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, dict) and {"median", "min", "max"} <= set(value):
        return f"{_fmt(value['median'])} ({_fmt(value['min'])}..{_fmt(value['max'])})"
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def dict_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of a list of flat-ish dicts (columns: the union of their keys, in order)."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _overhead(s: dict[str, Any]) -> list[str]:
    tps = s.get("tokens_per_s", {})
    out = [
        f"Model {s.get('model')} ({_fmt(s.get('params', 0) / 1e6)}M parameters) on {s.get('device')},"
        f" {s.get('precision')}, batch {s.get('batch_size')} × {s.get('seq_len')},"
        f" H = {s.get('inner_steps')},"
        f" median of {s.get('reps')} rounds per mode, alternating:",
        "",
        dict_table(
            [
                {"mode": name, "tokens/s": rate, "spread %": s.get("spread_pct", {}).get(name)}
                for name, rate in tps.items()
            ]
        ),
        "",
        f"Overhead (1 − node / bare of the same rep, median over the reps): {_fmt(s.get('overhead_pct'))} %"
        f" with the norm test, {_fmt(s.get('overhead_at_cap_pct'))} % with the batch at its cap (no test"
        f" left to take), {_fmt(s.get('overhead_batch_test_off_pct'))} % without a batch test. From each"
        f" mode's median instead (unpaired): {_fmt(s.get('overhead_unpaired_pct'))} % with the norm test.",
    ]
    codec = s.get("codec")
    if codec:
        out += [
            "",
            f"Codecs on one core ({_fmt(codec['bytes'] / 1e6)} MB of float32; memcpy"
            f" {_fmt(codec['memcpy_gb_per_s'])} GB/s):",
            "",
            dict_table([{"codec": name, **figures} for name, figures in codec["codecs"].items()]),
        ]
    for run in s.get("stored_gpu_runs", []):
        out += ["", f"Stored GPU measurement `{run['file']}` (not regenerated by this run):", ""]
        if "tokens_per_s" in run:
            out.append(
                dict_table([{"mode": k, "tokens/s": v} for k, v in run["tokens_per_s"].items()])
                + f"\n\n{run.get('model')} on {run.get('device')}: overhead {_fmt(run.get('overhead_pct'))} %"
            )
        elif "runs" in run:
            keep = (
                "model",
                "params",
                "activation_checkpointing",
                "b_max",
                "tokens_per_s",
                "peak_device_bytes_per_param",
            )
            out.append(dict_table([{k: r.get(k) for k in keep} for r in run["runs"]]))
    return out


def _section_body(name: str, s: dict[str, Any], figures: Path, md_dir: Path) -> list[str]:
    status = s.get("status")
    if status != "measured":
        why = s.get("reason") or s.get("error") or ""
        return [f"*{status}*{': ' + why if why else ''}"]
    lines: list[str] = []
    if name == "overhead":
        lines += _overhead(s)
    else:
        skip = ("status", "duration_s")
        headline = {k: s[k] for k in s if not isinstance(s[k], dict | list) and k not in skip}
        lines += [dict_table([headline]), ""]
        table = s.get("table")
        if isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
            lines += [dict_table(table)]
    for png in sorted((figures / name).glob("*.png")):
        rel = os.path.relpath(png, md_dir)
        lines += ["", f"![{png.stem}]({rel})"]
    return lines


TITLES = {
    "comm": "1. Communication (simulator, 4 peers)",
    "convergence": "2. Convergence (simulator)",
    "heterogeneity": "3. Heterogeneity (simulator, 5 peers, step times 1, 15, 15, 15, 15)",
    "system": "4. The real system (swarm behind shaped links)",
    "overhead": "5. Cost of the node",
    "memory": "5b. Memory per parameter (GPT-2 124M, solo node)",
    "scale": "6. Scale",
}


def write_markdown(results: dict[str, Any], path: Path, *, figures: Path) -> Path:
    meta = results["meta"]
    machine = meta["machine"]
    lines = [
        "# Results",
        "",
        "Generated by `adloco-bench`"
        + (" --quick (toy sizes: these figures check the harness, not the methods)" if meta["quick"] else "")
        + f" from commit `{meta['commit']}` on {machine['processor']} ({machine['cpus']} CPUs,"
        f" torch {machine['torch']}{', ' + machine['cuda'] if machine['cuda'] else ''}), seeds"
        f" {', '.join(map(str, meta['seeds']))}, started {meta['started']},"
        f" {meta.get('duration_s', 0):.0f} s."
        " Do not edit: run `adloco-bench` again. Every figure is a median over the seeds (or repeated"
        " rounds) with its spread; the narrative of earlier measurements is docs/experiments.md.",
        "",
        "## Goals (issue 11) against what was measured",
        "",
        goals_table(results),
        "",
    ]
    for name, title in TITLES.items():
        section = results.get(name)
        if section is None:
            continue
        duration, stamp = section.get("duration_s"), section.get("measured") or {}
        lines += [f"## {title}", ""]
        seeds = ", ".join(map(str, stamp.get("seeds") or []))
        if stamp.get("adopted_from"):
            lines += [
                f"(adopted from `{stamp['adopted_from']}`, written by its module's own run outside the"
                f" harness; that file's commit `{stamp.get('commit')}`, {stamp.get('started')};"
                f" seeds {seeds})",
                "",
            ]
        elif duration is not None and stamp:
            lines += [
                f"({duration:.0f} s; commit `{stamp.get('commit')}`, {stamp.get('started')}, seeds {seeds})",
                "",
            ]
        lines += _section_body(name, section, figures, path.parent)
        lines.append("")
    path.write_text("\n".join(lines))
    return path
