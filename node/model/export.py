"""Export: a checkpointed peer state as a Hugging Face model folder that transformers loads as it is.

`export_pretrained(state, out)` rebuilds the model from the transformers config the checkpoint
recorded (`Peer.state_dict`'s `model_config`), puts θ into its parameters by name, and writes what
`save_pretrained` writes (config.json, model.safetensors in fp32, generation_config.json) plus the
tokenizer files the checkpoint kept: the run's transformers tokenizer, or for the byte tokenizer an
equivalent transformers tokenizer (256 byte symbols, id = byte value, no merges). Then
`AutoModelForCausalLM.from_pretrained(out)` computes the node's logits at θ and
`AutoTokenizer.from_pretrained(out)` gives the ids the run trained on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import UserError
from ...protocol.algorithms.pseudograd import tensors_hash
from ..data.state import mapping
from .model import config_from_json, count_parameters


@dataclass(frozen=True)
class ExportInfo:
    """What was exported: the round and θ hash of the state, the model's type and size, the files."""

    round: int
    theta_hash: str
    model_type: str
    parameters: int
    files: tuple[str, ...]


def check_exportable(state: Mapping[str, Any]) -> None:
    """Raise unless `state` is a peer state `export_pretrained` can write.

    UserError for a checkpoint written before checkpoints recorded the model config and tokenizer
    (it loads for training, but cannot be exported); ValueError for a malformed or corrupt state
    (θ not matching its hash), so a checkpoint loader can fall back to the previous one.
    """
    if not isinstance(state.get("model_config"), str) or "tokenizer_files" not in state:
        raise UserError(
            "this checkpoint was written by an adloco-node that did not record the model config and"
            " tokenizer; resume the run with this version until it writes a checkpoint, then export"
        )
    names, theta = state.get("names"), state.get("theta")
    if not isinstance(names, list) or not isinstance(theta, list) or len(names) != len(theta):
        raise ValueError("peer state: names and theta do not match")
    if not all(isinstance(t, torch.Tensor) for t in theta) or tensors_hash(theta) != state.get("theta_hash"):
        raise ValueError("peer state: theta does not match its hash")
    for name in mapping(state["tokenizer_files"], "tokenizer files"):
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise ValueError(f"peer state: bad tokenizer file name {name!r}")


def export_pretrained(state: Mapping[str, Any], out: Path) -> ExportInfo:
    """Write `state` (a `Peer.state_dict`, e.g. from a checkpoint) as a Hugging Face folder `out`.

    `out` must not exist or be empty. Raises UserError for an unusable `out` or an old checkpoint,
    ValueError for a malformed state.
    """
    check_exportable(state)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's per-shard bar; the CLI prints one line
    config = config_from_json(state["model_config"])
    model = AutoModelForCausalLM.from_config(config)
    _load_theta(model, state["names"], state["theta"])
    _prepare_out(out)
    files: dict[str, bytes] = dict(state["tokenizer_files"])
    for name, data in files.items():
        if not isinstance(data, bytes):
            raise ValueError(f"peer state: tokenizer file {name!r} is not bytes")
        (out / name).write_bytes(data)
    if files:
        # Loading it back proves the files are a tokenizer. Its EOS is the one the run separated
        # documents with, so generate() stops there, whatever a preset or type default said.
        tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        if tokenizer.eos_token_id is not None:
            model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out))
    return ExportInfo(
        round=int(state["round"]),
        theta_hash=str(state["theta_hash"]),
        model_type=str(config.model_type),
        parameters=count_parameters(model),
        files=tuple(sorted(p.name for p in out.iterdir())),
    )


def _load_theta(model: torch.nn.Module, names: list[Any], theta: list[torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    if sorted(map(str, names)) != sorted(params):
        missing = sorted(set(params) - set(map(str, names)))[:3]
        raise ValueError(f"peer state: θ does not name the recorded model's parameters (e.g. {missing})")
    with torch.no_grad():
        for name, value in zip(names, theta, strict=True):
            param = params[name]
            if value.shape != param.shape:
                raise ValueError(
                    f"peer state: θ {name} is {tuple(value.shape)}, the model's {tuple(param.shape)}"
                )
            param.copy_(value)


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out: {out} exists and is not an empty folder; choose a new one")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out: cannot create {out}: {e.strerror or e}") from None


def describe(info: ExportInfo, out: Path) -> str:
    """One line on what was written and how to load it."""
    return (
        f"wrote {out}: {info.model_type}, {info.parameters / 1e6:.2f}M parameters, θ of round {info.round}"
        f" (hash {info.theta_hash[:12]}); files {', '.join(info.files)}. Load it with"
        f" AutoModelForCausalLM.from_pretrained({json.dumps(str(out))})"
    )
