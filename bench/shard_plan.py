"""What a GPU node's memory estimate decides at real sizes: whether one whole model's training fits a
device, how many rows per step fit one member of a group sharding the layers (record 084, "When the
layers are sharded"), and so what `--data-parallel on` does, for GPT-2 124M to 1.5B and Llama 1B and
3B shapes on 24 GiB and 80 GiB devices.

An estimate, not a GPU measurement (no multi-GPU machine was lent): `bmax.fitting_rows` with the
budget a device of that size gives, each device holding one model (a GPU peer keeps θ on the host),
bf16 autocast at seq 1024. The parameters are counted on a model built on the meta device; the
activation bytes one forward pass saves are measured on this CPU (bf16 autocast, the node's fused
loss head) on the same shape with one and with two layers, and extended a layer at a time (a
layer's saved tensors do not depend on the depth). On a GPU the node searches the whole model's
b_max with real steps (`bmax._probe_cuda`), and measures the activations on the GPU itself; the
estimate is what decides whether to shard. This CPU's kernels save more than a GPU's: against the
b_max the H100 session probed (docs/experiments.md: GPT-2 124M 197, Llama 1.1B 28 on 80 GiB), the
rows here are fewer, so the table errs toward sharding.

    python bench/shard_plan.py --out bench/results/shard_plan.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from adloco.node.model import bmax
from adloco.node.training.sharding import shares

SEQ = 1024
GIB = 2**30
DEVICES_GIB = (24, 80)
MEMBERS = (2, 4, 8)
# (no attention dropout: with it this CPU's attention saves the whole attention matrix, 4× the rest of
# GPT-2 124M's saved bytes per row, where a GPU's flash kernel saves none)
GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "attn_pdrop": 0.0}
LLAMA = {"model_type": "llama", "vocab_size": 128256, "num_key_value_heads": 8, "tie_word_embeddings": True}
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2-124m": {**GPT2, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2-355m": {**GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16},
    "gpt2-774m": {**GPT2, "n_embd": 1280, "n_layer": 36, "n_head": 20},
    "gpt2-1.5b": {**GPT2, "n_embd": 1600, "n_layer": 48, "n_head": 25},
    "llama-1b": {
        **LLAMA,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "intermediate_size": 8192,
    },
    "llama-3b": {
        **LLAMA,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "intermediate_size": 8192,
    },
}


def _config(shape: dict[str, Any], layers: int | None = None) -> PretrainedConfig:
    fields = dict(shape)
    kind = fields.pop("model_type")
    key = "n_layer" if kind == "gpt2" else "num_hidden_layers"
    if layers is not None:
        fields[key] = layers
    return AutoConfig.for_model(kind, **fields)


def _activations(shape: dict[str, Any]) -> tuple[int, int]:
    """(fixed, per sample) saved bytes at the full depth, from one and two layers measured."""
    measured = []
    for layers in (1, 2):
        model = AutoModelForCausalLM.from_config(_config(shape, layers), attn_implementation="sdpa")
        measured.append(
            bmax.activation_bytes(
                model, seq_len=SEQ, vocab_size=shape["vocab_size"], autocast_dtype=torch.bfloat16
            )
        )
        del model
    depth = shape.get("n_layer", shape.get("num_hidden_layers"))
    (f1, p1), (f2, p2) = measured
    return f1 + (depth - 1) * (f2 - f1), p1 + (depth - 1) * (p2 - p1)


def plan(name: str, shape: dict[str, Any]) -> dict[str, Any]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(shape))
    params = sum(p.numel() for p in model.parameters())
    sharded = shares(model, 2)
    fixed, per_sample = _activations(shape)
    out: dict[str, Any] = {
        "params": params,
        "layer_share": round(sharded.layer_params / params, 3),
        "activations_fixed_gib": round(fixed / GIB, 3),
        "activations_per_row_gib": round(per_sample / GIB, 3),
        "devices": {},
    }
    for gib in DEVICES_GIB:

        def rows(layout: bmax.Sharded | None, budget: int = gib * GIB) -> int:
            return bmax.fitting_rows(
                model,
                seq_len=SEQ,
                vocab_size=shape["vocab_size"],
                budget_bytes=budget,
                state_on_device=False,
                sharded=layout,
                activations=(fixed, per_sample),
            )

        whole = rows(None)
        shards = {m: rows(replace(sharded, members=m)) for m in MEMBERS}
        out["devices"][f"{gib} GiB"] = {
            "whole_rows": max(whole, 0),
            "sharded_rows": {str(m): max(r, 0) for m, r in shards.items()},
            "data_parallel_on": "replicated"
            if whole >= 1
            else next((f"sharded over {m}" for m in MEMBERS if shards[m] >= 1), "does not fit"),
        }
    print(json.dumps({name: out}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--models", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {"seq_len": SEQ, "precision": "bf16 autocast", "models": {}}
    for name in args.models:
        result["models"][name] = plan(name, SHAPES[name])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| model | params | layers' share | device | whole: rows | sharded over 2 / 4 / 8: rows | on |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["models"].items():
        for device, d in r["devices"].items():
            shards = " / ".join(str(v) for v in d["sharded_rows"].values())
            print(
                f"| {name} | {r['params'] / 1e9:.2f}B | {r['layer_share']:.0%} | {device} |"
                f" {d['whole_rows']} | {shards} | {d['data_parallel_on']} |"
            )


if __name__ == "__main__":
    main()
