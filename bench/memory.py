"""Memory benchmark: peak resident memory per parameter of a node training the GPT-2 124M config.

Runs the real entry points as separate processes and reads each process's own high-water mark
(VmHWM in /proc/PID/status, the kernel's peak resident set size) just before it exits:

1. solo: `adloco-node --offline` for 2 rounds (one instance, fp32 AdamW, int8 codec);
2. networked: `adloco-node` with the same flags but networked, alone as the first peer of a new
   swarm (no --peers, no other node: its DHT process and p2pd run, every round goes through the
   hivemind averager as a group of one) for 3 rounds; the node process's peak, and separately its
   forked DHT process's and p2pd's (other processes, not counted in the node's);
3. swarm: `adloco-swarm --nodes 3` for 2 rounds (a bootstrap peer and 3 nodes over the real p2pd),
   the peak of each node process;
4. restart: the solo node for 2 rounds, then the same command again, resuming from the checkpoint
   it wrote, for 2 more: each run's peak, and beside it the largest anonymous resident memory
   (RssAnon, polled: what the process allocated, not pages of files it maps, such as the
   checkpoint it resumes from) seen in each.

Alongside, the bytes per parameter the method cannot avoid holding through a step (the floor:
instance weights, gradients, two AdamW moments), what it holds only at a round's boundary, mapped
from files between (θ and the outer momentum, record 082), and what it keeps on top by design in
files (the error-feedback residual), computed from the parameter count and the codec, and
the resident memory of a process that only imports torch and transformers and builds the model
(the interpreter and libraries' share, which does not scale with the model). Every figure is
measured when the script runs. From the repository root:

    python bench/memory.py                       # solo + 3-node swarm, ~5 min on 2 cores, nodes of 5-6 GB
    python bench/memory.py --modes solo --repeats 3 --out /tmp/memory.json
    python bench/memory.py --modes solo,networked --out /tmp/memory.json   # offline against networked
    python bench/memory.py --modes solo --node-arg=--residual-dtype --node-arg=float32
    python bench/memory.py --modes restart --repeats 2 --out bench/results/restart_memory_124m.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GPT2_124M = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}
TRAIN_ARGS = ["--seq-len", "128", "--batch-size", "2", "--inner-steps", "2", "--instances", "1"]
VOCAB = GPT2_124M["vocab_size"]
RESULTS = Path(__file__).resolve().parent / "results" / "memory.json"


def _hwm_bytes(pid: int, field: str = "VmHWM") -> int | None:
    """The process's peak resident set size so far (VmHWM), or another field of its status in bytes
    (RssAnon: its anonymous resident memory now); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, their children, ...)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").glob("*"))
        except FileNotFoundError:  # it exited while we looked
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except FileNotFoundError:
                continue
            for child in map(int, children):
                found.append(child)
                frontier.append(child)
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the name


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


class PeakWatcher:
    """Polls the peak RSS of a process tree; remembers each process's last reading (VmHWM only grows,
    so the last reading before exit is the process's peak to within one poll of growth)."""

    def __init__(self, root: int, interval_s: float = 0.05) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peaks: dict[int, tuple[str, int]] = {}
        self.anon_peaks: dict[int, int] = {}  # (the largest RssAnon polled: a spike between polls is missed)
        self.parents: dict[int, int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in [self.root, *_descendants(self.root)]:
                hwm = _hwm_bytes(pid)
                if hwm is not None:
                    name = self.peaks.get(pid, (_cmdline(pid), 0))[0] or _cmdline(pid)
                    self.peaks[pid] = (name, hwm)
                    anon = _hwm_bytes(pid, "RssAnon") or 0
                    self.anon_peaks[pid] = max(self.anon_peaks.get(pid, 0), anon)
                    if pid not in self.parents:
                        self.parents[pid] = _parent(pid)
            time.sleep(self.interval_s)

    def stop(self) -> dict[int, tuple[str, int]]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def _run(cmd: list[str], *, cwd: Path, timeout_s: float) -> tuple[PeakWatcher, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = PeakWatcher(proc.pid)
    out, _ = proc.communicate(timeout=timeout_s)
    watcher.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return watcher, time.perf_counter() - t0


def make_tokenizer(work: Path) -> Path:
    """A byte-level BPE of GPT-2's vocabulary size on the embedded corpus (`adloco-node tokenizer`):
    the config's embedding needs a tokenizer of its size, as a run owner would make one."""
    out = work / "tokenizer.json"
    cmd = [
        sys.executable, "-m", "adloco.node.cli.entry", "tokenizer", "--vocab-size", str(VOCAB),
        "--min-frequency", "1", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=work)
    return out


def count_parameters(config: Path) -> int:
    from adloco.node.model.model import build_model

    model = build_model(str(config), vocab_size=VOCAB)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def library_baseline(config: Path) -> int:
    """Peak RSS of a process that imports the libraries and builds the model once (4 B/param)."""
    code = (
        "import sys, adloco.node.model.model as m;"
        "m.build_model(sys.argv[1], vocab_size=int(sys.argv[2])); print(open('/proc/self/status').read())"
    )
    cmd = [sys.executable, "-c", code, str(config), str(VOCAB)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _solo_command(config: Path, tokenizer: Path, work: Path, node_args: list[str], name: str) -> list[str]:
    """The offline node for 2 rounds, checkpointing into a folder of its own (`name`)."""
    return [
        sys.executable, "-m", "adloco.node.cli.entry", "--offline", "--rounds", "2",
        "--model", str(config), "--tokenizer", str(tokenizer), *TRAIN_ARGS,
        "--checkpoint-dir", str(work / f"ckpt-{name}-{time.time_ns()}"), *node_args,
    ]  # fmt: skip


def measure_solo(config: Path, tokenizer: Path, work: Path, node_args: list[str]) -> dict[str, float]:
    watcher, wall = _run(_solo_command(config, tokenizer, work, node_args, "solo"), cwd=work, timeout_s=1800)
    return {"peak_bytes": float(watcher.peaks[watcher.root][1]), "wall_s": wall}


def measure_restart(config: Path, tokenizer: Path, work: Path, node_args: list[str]) -> dict[str, float]:
    """The solo node for 2 rounds, then resumed from its checkpoint for 2 more: each run's peak and
    largest polled anonymous resident memory."""
    cmd = _solo_command(config, tokenizer, work, node_args, "restart")
    fresh, _ = _run(cmd, cwd=work, timeout_s=1800)
    resumed, wall = _run(cmd, cwd=work, timeout_s=1800)
    return {
        "fresh_peak_bytes": float(fresh.peaks[fresh.root][1]),
        "fresh_anon_peak_bytes": float(fresh.anon_peaks[fresh.root]),
        "restart_peak_bytes": float(resumed.peaks[resumed.root][1]),
        "restart_anon_peak_bytes": float(resumed.anon_peaks[resumed.root]),
        "restart_wall_s": wall,
    }


# One data shard of one, as the offline node trains (its batch sizes, hence its peaks, follow its data).
NETWORKED_ARGS = [
    "--run-id", "memory", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-nat-port-map",
    "--data-shards", "1", "--data-shard", "0",
]  # fmt: skip


def measure_networked(
    config: Path, tokenizer: Path, work: Path, node_args: list[str], rounds: int = 3
) -> dict[str, float]:
    """The node alone as the first peer of a new swarm: the solo flags without --offline, no --peers."""
    cmd = [
        sys.executable, "-m", "adloco.node.cli.entry", "--rounds", str(rounds), *NETWORKED_ARGS,
        "--control-port", "-1", "--model", str(config), "--tokenizer", str(tokenizer), *TRAIN_ARGS,
        "--checkpoint-dir", str(work / f"ckpt-networked-{time.time_ns()}"), *node_args,
    ]  # fmt: skip
    watcher, wall = _run(cmd, cwd=work, timeout_s=1800)
    peaks, parents = watcher.peaks, watcher.parents
    # The node forks its DHT process (hivemind), which starts p2pd: separate processes, each with
    # its own peak, reported apart from the node's.
    dht = [pid for pid, (name, _) in peaks.items() if parents.get(pid) == watcher.root and "p2pd" not in name]
    p2pd = [pid for pid, (name, _) in peaks.items() if "p2pd" in name]
    return {
        "peak_bytes": float(peaks[watcher.root][1]),
        "dht_peak_bytes": float(sum(peaks[pid][1] for pid in dht)),
        "p2pd_peak_bytes": float(sum(peaks[pid][1] for pid in p2pd)),
        "wall_s": wall,
    }


def measure_swarm(
    config: Path, tokenizer: Path, work: Path, nodes: int, node_args: list[str]
) -> dict[str, object]:
    out = work / f"swarm-{time.time_ns()}"
    cmd = [
        sys.executable, "-m", "adloco.node.cli.launcher", "--nodes", str(nodes), "--rounds", "2",
        "--out", str(out), "--tokenizer", str(tokenizer), "--", "--model", str(config), *TRAIN_ARGS,
        *node_args,
    ]  # fmt: skip
    watcher, wall = _run(cmd, cwd=work, timeout_s=3600)
    peaks, parents = watcher.peaks, watcher.parents
    # The launcher's children are the bootstrap peer and the nodes; each node forks its DHT
    # process (hivemind), whose resident set starts as the pages it inherits from the node.
    nodes = [
        pid for pid, (name, _) in peaks.items()
        if parents.get(pid) == watcher.root and "p2pd" not in name and "bootstrap" not in name
    ]  # fmt: skip
    forked = [
        pid for pid, (name, _) in peaks.items() if parents.get(pid) in nodes and "p2pd" not in name
    ]  # fmt: skip
    return {
        "node_peak_bytes": sorted(float(peaks[pid][1]) for pid in nodes),
        "forked_dht_peak_bytes": sorted(float(peaks[pid][1]) for pid in forked),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="solo,swarm", help="comma-separated: solo, networked, swarm, restart")
    ap.add_argument(
        "--repeats", type=int, default=1, help="solo, networked and restart runs (the median is reported)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the networked node")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument(
        "--node-arg", action="append", default=[], help="one more flag for every node (repeatable)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="adloco-memory-") as tmp:
        work = Path(tmp)
        config = work / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        tokenizer = make_tokenizer(work)
        params = count_parameters(config)
        print(f"GPT-2 124M config: {params:,} parameters", flush=True)
        floor = {"instance weights": 4, "gradients": 4, "AdamW moments": 8}
        at_boundary = {"theta": 4, "outer momentum": 4}
        residual_flag = _flag(args.node_arg, "--residual-dtype") or "auto"
        residual = {"float32": 4, "bfloat16": 2}.get(residual_flag, 1 + 4 / 256)  # auto: int8 for int8
        # (an int8 residual waits in a file, read a slice at a time; others stay in memory)
        by_design = {"error-feedback residual": residual}
        baseline = library_baseline(config)
        result: dict[str, object] = {
            "params": params,
            "train_args": TRAIN_ARGS,
            "node_args": args.node_arg,
            "allocator_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_"))},
            "floor_bytes_per_param": floor,
            "mapped_held_at_round_boundary_bytes_per_param": at_boundary,
            "by_design_bytes_per_param": by_design,
            "libraries_and_one_model_bytes": baseline,
        }
        print(f"libraries + one model build: {baseline / 2**30:.2f} GiB ({baseline / params:.1f} B/param)")
        if "solo" in modes:
            runs = [measure_solo(config, tokenizer, work, args.node_arg) for _ in range(args.repeats)]
            peak = statistics.median(r["peak_bytes"] for r in runs)
            result["solo"] = {"runs": runs, "median_peak_bytes": peak, "bytes_per_param": peak / params}
            print(
                f"solo: peak {peak / 2**30:.2f} GiB = {peak / params:.1f} B/param"
                f" (median of {len(runs)}; runs {[round(r['peak_bytes'] / params, 1) for r in runs]})",
                flush=True,
            )
            _write(args.out, result)  # kept if the swarm run fails
        if "networked" in modes:
            runs = [
                measure_networked(config, tokenizer, work, args.node_arg, args.rounds)
                for _ in range(args.repeats)
            ]
            peak = statistics.median(r["peak_bytes"] for r in runs)
            result["networked"] = {"runs": runs, "median_peak_bytes": peak, "bytes_per_param": peak / params}
            print(
                f"networked, first peer alone: peak {peak / 2**30:.2f} GiB = {peak / params:.1f} B/param"
                f" (median of {len(runs)}; runs {[round(r['peak_bytes'] / params, 1) for r in runs]});"
                f" its DHT process {[round(r['dht_peak_bytes'] / 2**30, 2) for r in runs]} GiB, p2pd"
                f" {[round(r['p2pd_peak_bytes'] / 2**30, 2) for r in runs]} GiB",
                flush=True,
            )
            _write(args.out, result)
        if "restart" in modes:
            runs = [measure_restart(config, tokenizer, work, args.node_arg) for _ in range(args.repeats)]
            keys = (
                "fresh_peak_bytes",
                "fresh_anon_peak_bytes",
                "restart_peak_bytes",
                "restart_anon_peak_bytes",
            )
            summary = {key: statistics.median(r[key] for r in runs) / params for key in keys}
            result["restart"] = {"runs": runs, "median_bytes_per_param": summary}
            print(
                "restart, B/param (median of {}): fresh start peak {:.1f}, anonymous {:.1f}; resumed peak"
                " {:.1f}, anonymous {:.1f}".format(len(runs), *summary.values()),
                flush=True,
            )
            _write(args.out, result)
        if "swarm" in modes:
            swarm = measure_swarm(config, tokenizer, work, args.nodes, args.node_arg)
            node_peaks = swarm["node_peak_bytes"]
            assert isinstance(node_peaks, list)
            forked = swarm["forked_dht_peak_bytes"]
            assert isinstance(forked, list)
            result["swarm"] = {**swarm, "bytes_per_param": [p / params for p in node_peaks]}
            print(
                f"swarm of {args.nodes}: node peaks {[round(p / 2**30, 2) for p in node_peaks]} GiB ="
                f" {[round(p / params, 1) for p in node_peaks]} B/param; their forked DHT processes"
                f" {[round(p / 2**30, 2) for p in forked]} GiB; {swarm['wall_s']:.0f} s",
                flush=True,
            )
    _write(args.out, result)
    print(f"wrote {args.out}")


def _flag(args: list[str], name: str) -> str | None:
    """The value given to `name` in `args` (as `name value` or `name=value`), None if absent."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _write(out: Path, result: dict[str, object]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
