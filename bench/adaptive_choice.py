"""`--codec adaptive`'s choice at GPT-2 124M: the averaged Δ̄ read a tensor at a time (`Payloads`,
what the node passes) against the same Δ̄ decoded whole first (what it passed before stop 66).

Both ways run in a process of their own each (the peak resident memory, VmHWM, is the process's),
on the same int8 payloads of a Gaussian Δ̄ of GPT-2 124M's parameter shapes (a scale per tensor, as
bench/codecs.py's), with the node's default candidates and error bound, and print the choice,
its measured error, the memory the choice added over what the process held with the payloads
loaded, and its wall time (median over --repeats processes). From the repository root:

    python bench/adaptive_choice.py --repeats 3 --out bench/results/adaptive_choice_124m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from adloco.node.training.config import TrainConfig
from adloco.protocol.algorithms.adaptive import Payloads, choose_codec
from adloco.protocol.algorithms.codecs import decode_tensors, encode_tensors, make_codec

MODES = ("payloads", "decoded")


def _status(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field))
    return int(line.split()[1]) * 1024


def gpt2_124m_delta(seed: int = 0) -> dict[str, torch.Tensor]:
    """A Gaussian Δ̄ of GPT-2 124M's parameter shapes (the tied head once), a scale per tensor."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=generator) * 10 ** -(2 + i % 3)
        for i, (name, p) in enumerate(model.named_parameters())
    }


def child(mode: str, path: Path) -> None:
    """Choose over the saved payloads one way; print what it took as JSON."""
    torch.set_num_threads(1)
    payloads: dict[str, bytes] = torch.load(path)
    cfg = TrainConfig()
    before = _status("VmRSS:")
    t0 = time.perf_counter()
    tensors = Payloads(payloads) if mode == "payloads" else decode_tensors(payloads)
    choice = choose_codec(tensors, candidates=cfg.codec_candidates, max_rel_error=cfg.max_rel_error)
    seconds = time.perf_counter() - t0
    added = _status("VmHWM:") - before
    print(
        json.dumps(
            {"spec": choice.spec, "rel_error": choice.rel_error, "added_bytes": added, "seconds": seconds}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--payloads", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.payloads)
        return
    delta = gpt2_124m_delta()
    params = sum(t.numel() for t in delta.values())
    payloads = encode_tensors(make_codec("int8"), delta)
    del delta
    result: dict[str, object] = {"params": params, "codec": "int8", "runs": {}}
    with tempfile.TemporaryDirectory(prefix="adloco-adaptive-") as tmp:
        path = Path(tmp) / "payloads.pt"
        torch.save(payloads, path)
        runs: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # (alternated: a drift of the machine's load falls on both)
                cmd = [sys.executable, __file__, "--child", mode, "--payloads", str(path)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result["runs"] = runs
    for mode in MODES:
        added = statistics.median(float(str(r["added_bytes"])) for r in runs[mode])
        seconds = statistics.median(float(str(r["seconds"])) for r in runs[mode])
        choices = {(r["spec"], r["rel_error"]) for r in runs[mode]}
        print(
            f"{mode}: added {added / 2**30:.2f} GiB ({added / params:.1f} B/param), {seconds:.1f} s"
            f" (medians of {args.repeats}); chose {sorted(choices)}",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
