"""`adloco-bench`: every benchmark of issue 11 in one run, written as docs/results.json and docs/results.md.

Each section is a module of this folder with `run(quick, seeds, out) -> dict`; the harness runs the
selected ones in turn (one at a time: the figures are timings on a shared machine), each into its own
folder under the output, and keeps what each returned under its name in results.json, beside `meta`
(seeds, commit, machine, durations). results.md is generated from that JSON alone: the goals against
what was measured, then each section's table and plots. A section that fails is recorded with its
error and the others still run; one not built yet is recorded as such. Nothing is copied from an
earlier run, except the GPU figures of bench/results/ (this machine has no GPU), which the overhead
section shows as stored measurements with their date and commit.

    adloco-bench                                # the full run into docs/ (docs/results.md: its duration)
    adloco-bench --quick --out /tmp/bench       # every section at toy size, about 3 minutes (CI runs it)
    adloco-bench --sections comm,overhead   # those sections again; the others kept from results.json
    adloco-bench --adopt comm=DIR/comm.json # a section its module ran elsewhere (bench/comm.py --out DIR)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
STORED = Path(__file__).resolve().parent / "results"
SECTIONS = ("comm", "convergence", "heterogeneity", "system", "overhead", "memory", "scale")
# The keys of results.json that issue 11 names, per section (None where not measured).
KEYS: dict[str, tuple[str, ...]] = {
    "comm": ("ddp_bytes_per_token", "best_bytes_per_token", "ratio_vs_ddp", "val_loss_gap_pct"),
    "convergence": (
        "diloco_rounds_to_target",
        "adloco_rounds_to_target",
        "diloco_time_to_target_s",
        "adloco_time_to_target_s",
    ),
    "heterogeneity": (
        "async_nesterov_val_loss",
        "heloco_val_loss",
        "sync_val_loss_at_fixed_time",
        "heloco_val_loss_at_fixed_time",
        "tau_mean",
    ),
    "system": (
        "utilization_overlap_10mbit",
        "utilization_no_overlap_10mbit",
        "utilization_overlap_100mbit",
        "allreduce_s_vs_hivemind_ratio",
    ),
    "overhead": ("pct", "codec_gb_per_s"),
    "memory": ("bytes_per_param",),
    "scale": ("sim_peers_max", "swarm_nodes_max"),
}


class NotBuilt(Exception):
    """A section whose benchmark does not exist yet."""


# ---- sections ------------------------------------------------------------------------------------


def section_comm(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    from . import comm

    return comm.run(quick, seeds, out)


def _optional_section(module: str, quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    """A section whose module another change may not have landed yet."""
    import importlib

    try:
        mod = importlib.import_module(f"{__package__}.{module}")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.{module}":
            raise
        raise NotBuilt(f"bench/{module}.py is not built yet") from e
    result: dict[str, Any] = mod.run(quick, seeds, out)
    return result


def section_convergence(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    return _optional_section("convergence", quick, seeds, out)


def section_heterogeneity(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    return _optional_section("heterogeneity", quick, seeds, out)


def section_system(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    """Utilization behind shaped links (bench/system.py) and the all-reduce against hivemind's own
    averager (bench/allreduce.py), one section."""
    from . import system

    try:
        result = system.run(quick, seeds, out)
    except system.Unavailable as e:
        raise NotBuilt(f"needs network namespaces: {e}") from e
    try:
        if quick:  # its own tests run it at toy size (tests/test_allreduce_bench.py)
            raise NotBuilt("--quick leaves the comparison with hivemind's averager out")
        allreduce = _optional_section("allreduce", quick, seeds, out)
    except NotBuilt as e:
        result["skipped"] = {"allreduce_s_vs_hivemind_ratio": str(e)}
    else:
        result["allreduce"] = allreduce
        result["allreduce_s_vs_hivemind_ratio"] = allreduce.get("allreduce_s_vs_hivemind_ratio")
    if quick:  # one run at 100 Mbit/s: the 10 Mbit/s figures are the full run's
        result.setdefault("skipped", {}).update(
            {
                "utilization_overlap_10mbit": "--quick runs 100 Mbit/s only",
                "utilization_no_overlap_10mbit": "--quick runs 100 Mbit/s only",
            }
        )
    return result


def section_scale(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    from . import scale

    return scale.run(quick, seeds, out)


def section_overhead(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    """The node's inner steps against a bare loop and the codecs' speed (bench/overhead.py) on this
    machine's CPU, or its GPU if it has one; beside it the stored GPU runs of bench/results/."""
    import torch

    from . import overhead

    cuda = torch.cuda.is_available()
    if quick:
        result = overhead.run(seq_len=32, batch_size=4, inner_steps=2, reps=1, codec_mb=1, codec_reps=1)
    elif cuda:
        result = overhead.run(
            model="gpt2-124m", device="cuda", precision="bf16", seq_len=1024, batch_size=8, reps=5
        )
    else:
        result = overhead.run(model="base-llama", seq_len=128, batch_size=8, inner_steps=10, reps=9)
    result["pct"] = result["overhead_pct"]
    # The default codec's encode (int8), the one every round runs; every codec is in the table.
    result["codec_gb_per_s"] = result["codec"]["codecs"]["int8"]["encode_gb_per_s"]
    result["stored_gpu_runs"] = _stored_gpu_runs()
    (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _stored_gpu_runs() -> list[dict[str, Any]]:
    """The GPU measurements kept in bench/results/ (gpu*.json, overhead_cuda*.json), as they are."""
    runs = []
    for path in sorted(STORED.glob("overhead_cuda*.json")) + sorted(STORED.glob("gpu*.json")):
        try:
            runs.append({"file": str(path.relative_to(ROOT)), **json.loads(path.read_text())})
        except (OSError, ValueError):
            continue
    return runs


def section_memory(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    """Peak resident memory per parameter of a solo node training GPT-2 124M (bench/memory.py), as a
    separate process: its high-water mark must not include this one's."""
    if quick:
        raise NotBuilt("skipped by --quick: one GPT-2 124M node takes minutes and ~6 GB")
    path = out / "memory.json"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("memory.py")), "--modes", "solo", "--out", str(path)],
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(path.read_text())
    result["bytes_per_param"] = result["solo"]["bytes_per_param"]
    return result


RUNNERS: dict[str, Callable[[bool, list[int], Path], dict[str, Any]]] = {
    "comm": section_comm,
    "convergence": section_convergence,
    "heterogeneity": section_heterogeneity,
    "system": section_system,
    "overhead": section_overhead,
    "memory": section_memory,
    "scale": section_scale,
}


# ---- the run -------------------------------------------------------------------------------------


def meta(seeds: list[int], quick: bool) -> dict[str, Any]:
    """What the figures were measured with: commit, machine, seeds."""
    import torch

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "seeds": seeds,
        "quick": quick,
        "commit": commit + ("+dirty" if dirty else ""),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "started": _now(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def adopt(name: str, path: Path, out: Path) -> dict[str, Any]:
    """A section's result as its module's own `run()` wrote it outside the harness (on a machine with
    more cores, say), stamped with the file and the commit that last changed it; the plots beside
    it (named after the section, or all of a folder named after it) are copied to out/."""
    section: dict[str, Any] = json.loads(path.read_text())
    done = subprocess.run(
        ["git", "log", "-1", "--format=%H %cI", "--", str(path.resolve())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    commit, _, date = done.stdout.strip().partition(" ")
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", str(path.resolve())], cwd=ROOT, check=False
    ).returncode
    if dirty:  # changed since its last commit: that commit did not write it
        commit, date = "", ""
    out.mkdir(parents=True, exist_ok=True)
    for png in path.parent.glob("*.png"):
        if png.stem.startswith(name) or path.parent.name == name:
            (out / png.name).write_bytes(png.read_bytes())
    section = {key: section.get(key) for key in KEYS[name]} | section
    section["status"] = "measured"
    section["measured"] = {
        "adopted_from": os.path.relpath(path.resolve(), ROOT),
        "commit": commit or "not committed",
        "started": date or None,
        "seeds": section.get("seeds"),
        "quick": bool(section.get("quick", False)),
    }
    section.setdefault("duration_s", None)
    return section


def run_sections(
    names: list[str],
    *,
    quick: bool,
    seeds: list[int],
    out: Path,
    json_path: Path,
    adopted: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Run each section into out/<name>/; results.json's dict, written to `json_path` after every
    section (a run cut short keeps what it measured)."""
    results: dict[str, Any] = {"meta": meta(seeds, quick)}
    if not quick and set(names) != set(SECTIONS) - set(adopted or {}) and json_path.is_file():
        # A subset of the sections: the others stay as the last run measured them (each section
        # carries the commit and time it was measured at).
        kept = json.loads(json_path.read_text())
        results.update({k: v for k, v in kept.items() if k in SECTIONS and k not in names})
    for name, path in (adopted or {}).items():
        results[name] = adopt(name, path, out / name)
        print(f"adloco-bench: {name} adopted from {path}", flush=True)
    t_all = time.perf_counter()
    results["meta"]["duration_s"] = 0.0
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        print(f"adloco-bench: {name} ...", flush=True)
        stamp = {"commit": results["meta"]["commit"], "started": _now(), "seeds": seeds, "quick": quick}
        t0 = time.perf_counter()
        try:
            section = RUNNERS[name](quick, seeds, folder)
            status = "measured"
        except NotBuilt as e:
            section, status = {"reason": str(e)}, "not measured"
        except Exception as e:  # a failed section is reported; the others still run
            section, status = (
                {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()},
                "failed",
            )
        section = {key: section.get(key) for key in KEYS[name]} | section
        section["status"] = status
        section["duration_s"] = time.perf_counter() - t0
        section["measured"] = stamp
        results[name] = section
        print(f"adloco-bench: {name} {status} in {section['duration_s']:.0f} s", flush=True)
        results["meta"]["duration_s"] = time.perf_counter() - t_all
        _write_json(json_path, results)
    for name in SECTIONS:
        if name not in results:
            results[name] = {key: None for key in KEYS[name]} | {"status": "not run"}
    _write_json(json_path, results)
    return results


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adloco-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy sizes, one seed: checks the harness (CI)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: docs/)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (0 with --quick)")
    ap.add_argument("--sections", default=None, help=f"comma-separated: {', '.join(SECTIONS)} (default: all)")
    ap.add_argument(
        "--adopt",
        action="append",
        default=[],
        metavar="SECTION=FILE",
        help="take a section from the JSON its module's run() wrote elsewhere (marked as adopted)",
    )
    args = ap.parse_args(argv)
    adopted: dict[str, Path] = {}
    for item in args.adopt:
        name, _, file = item.partition("=")
        if name not in SECTIONS or not file:
            ap.error(f"--adopt {item!r}: expected SECTION=FILE with SECTION one of {', '.join(SECTIONS)}")
        try:
            if not isinstance(json.loads(Path(file).read_text()), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            ap.error(f"--adopt {item!r}: cannot read a section from {file}: {e}")
        adopted[name] = Path(file)
    default = [] if adopted else list(SECTIONS)
    names = default if args.sections is None else [n for n in args.sections.split(",") if n]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown or not (names or adopted):
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if set(names) & set(adopted):
        ap.error(f"--sections and --adopt both name {sorted(set(names) & set(adopted))}")
    if adopted and args.quick:
        ap.error("--adopt takes full runs; --quick runs toy sizes")
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    if args.out is None and args.quick:
        ap.error("--quick needs --out: toy figures never replace docs/results.*")
    out = (args.out or DOCS).resolve()
    # In docs/ the sections' files (JSON, plots) go to docs/bench/, beside results.json and results.md.
    sections_out = out / "bench" if args.out is None else out
    sections_out.mkdir(parents=True, exist_ok=True)
    from .report import write_markdown

    # SIGTERM unwinds as Ctrl-C does: each section's `finally` reaps its nodes and network namespaces
    # (without this, a killed run left its swarm training in the namespaces).
    signal.signal(signal.SIGTERM, _terminated)
    results = run_sections(
        names,
        quick=args.quick,
        seeds=seeds,
        out=sections_out,
        json_path=out / "results.json",
        adopted=adopted,
    )
    md = write_markdown(results, out / "results.md", figures=sections_out)
    print(f"adloco-bench: wrote {out / 'results.json'} and {md} in {results['meta']['duration_s']:.0f} s")
    failed = [n for n in names if results[n]["status"] == "failed"]
    if failed:
        print(
            f"adloco-bench: failed sections: {', '.join(failed)} (their errors are in results.json)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
