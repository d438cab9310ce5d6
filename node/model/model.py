"""The model every peer trains: a transformers causal LM built from a config, randomly initialised.

`build_model` accepts a preset name (the embedded default `tiny-llama` and two larger Llama sizes that
train on a CPU), a local `config.json` (or a directory holding one), or a bare transformers model type
such as "gpt2", which takes that library's default config. Presets and bare types take the
tokenizer's vocabulary size; a config file states its own, which must be the tokenizer's. Nothing is
downloaded: weights come from `torch.manual_seed(seed)`, so every peer given the same spec and seed
starts from bit-identical parameters. `model_fingerprint` identifies the architecture so peers of
different models never mix; `config_from_json` rebuilds the config a checkpoint recorded.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from ...errors import UserError
from .loss import COMPILED_MARK, TiedEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-llama"

# Llama sizes measured on this project's 2-core reference machine (docs: DESIGN.md §5). The MLP is
# 4·d wide so the counts match the measured 0.6M / 4.3M / 14M; untied embeddings as in Llama.
PRESETS: dict[str, dict[str, int]] = {
    "tiny-llama": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "small-llama": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8},
    "base-llama": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6},
}

# Shown in the error for an unknown --model; any key of transformers' causal-LM mapping works.
EXAMPLE_MODEL_TYPES = ("llama", "gpt2", "mistral", "qwen2", "gpt_neox", "opt", "bloom")

# Training in fp32 with AdamW holds ~16 bytes per parameter (weights, grads, two moments); building
# alone holds 4. Refusing a model whose weights alone exceed half the host memory turns a bare
# "llama" (transformers' default is 6.5B parameters) into a clear error instead of an OOM kill.
_MAX_WEIGHT_SHARE_OF_RAM = 0.5

# CPU, 2 threads, AdamW, batch 8x128, best of 6 alternating runs: tiny-llama sdpa 36.5 vs eager
# 39.0 ms/step, small-llama 196 vs 208 ms/step. Architectures without sdpa fall back to eager.
ATTN_IMPLEMENTATION = "sdpa"


def build_model(
    spec: str | None = None, *, vocab_size: int = 256, seed: int = 0, max_seq_len: int = 1024
) -> PreTrainedModel:
    """Build a randomly initialised causal LM in fp32 on the CPU.

    Args:
        spec: None or a preset name (`PRESETS`), a path to a config.json or a directory holding one,
            or a transformers model type ("llama", "gpt2", ...) for that type's default config.
        vocab_size: the tokenizer's vocabulary size; presets and bare types use it, a config file
            must state the same.
        seed: the same seed gives bit-identical weights on every machine with the same torch, whatever
            its vector unit and thread count (`PortableInit`).
        max_seq_len: the longest sequence a preset must support (its position limit).

    Raises:
        UserError: unknown spec, unreadable config, a config file whose vocab_size is not the
            tokenizer's, or a model too large for this host.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = resolve_config(spec, vocab_size=vocab_size, max_seq_len=max_seq_len)
    # fp32 master weights whatever a config.json says; mixed precision is the trainer's business.
    config.dtype = torch.float32
    _check_size(config, spec)
    from transformers import AutoModelForCausalLM

    # fork_rng keeps the caller's global RNG stream untouched by the initialisation.
    with torch.random.fork_rng(devices=[]), PortableInit():
        torch.manual_seed(seed)
        try:
            model: PreTrainedModel = AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION
            )
        except ValueError:  # an architecture without sdpa support
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _tie_lookup_gradient(model)
    _fused_tanh_gelu(model)
    logger.info(
        "model %s: %s, %.2fM parameters",
        spec or DEFAULT_MODEL,
        config.model_type,
        count_parameters(model) / 1e6,
    )
    return model


def _tie_lookup_gradient(model: PreTrainedModel) -> None:
    """Where the input embedding is the output one (GPT-2, Bloom), its lookup becomes a
    `TiedEmbedding`: the lookup's gradient rows are added in place to the fused head's gradient of
    the same weight, instead of a second V x D tensor being formed at the end of the backward pass
    when every other gradient is held too (1.2 B/param at GPT-2 124M). Same module, same weight (the
    class is swapped in place, so the tie and every name stay as they were)."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and inputs.weight is outputs.weight and TiedEmbedding.plain(inputs):
        inputs.__class__ = TiedEmbedding


def _fused_tanh_gelu(model: PreTrainedModel) -> None:
    """Replace transformers' `gelu_new` (GPT-2's activation: the tanh approximation written as five
    tensor operations, each saving its input for the backward pass) by PyTorch's fused kernel of the
    same formula, which saves only its input: 160 MB less held per forward pass at GPT-2 124M with
    batch 3 x 128 (1.3 B/param), outputs equal to within 5e-7. The config still says `gelu_new`, so
    an exported model loads as before."""
    from transformers.activations import NewGELUActivation

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, NewGELUActivation):
                setattr(module, name, TanhGELU())


class TanhGELU(torch.nn.Module):
    """GELU's tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), in one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh")


def check_model(spec: str | None, *, vocab_size: int = 256, max_seq_len: int = 1024) -> None:
    """What `build_model` would refuse, refused without building it (no weights are allocated):
    for callers that must fail on bad input before they start other processes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = resolve_config(spec, vocab_size=vocab_size, max_seq_len=max_seq_len)
    config.dtype = torch.float32
    _check_size(config, spec)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass (`--activation-checkpointing`).

    transformers' own switch (`activation_checkpointing_enable`, called `gradient_checkpointing_enable`
    before transformers 5), with torch's non-reentrant checkpoint: it saves each layer's inputs and
    replays the layer's forward, random state included, in the backward pass. Raises UserError for
    an architecture that does not support it.
    """
    if not model.supports_gradient_checkpointing:
        raise UserError(
            f"--activation-checkpointing: {type(model).__name__} does not support it; run without it"
        )
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # No key/value cache in training; the models would otherwise turn it off with a warning.
    model.config.use_cache = False


COMPILE_MODES = ("auto", "on", "off")


def resolve_compile(spec: str, device: torch.device) -> bool:
    """Whether the instances' layers run through torch.compile (`--compile`): auto compiles on a
    CUDA GPU, where the fused kernels pay for the compile time many times over in every round, and
    not on a CPU, where Inductor's C++ kernels must first be built by the host's compiler and the
    step is bound by the matrix products anyway (bench/overhead.py --compile on measures both).

    Compiling needs a compiler on the host (`compile_missing`): without one, auto stays eager with a
    warning and on is a UserError, rather than a node that fails at its first step."""
    if spec not in COMPILE_MODES:
        raise UserError(f"--compile: expected one of {', '.join(COMPILE_MODES)}, got {spec!r}")
    wanted = spec == "on" or (spec == "auto" and device.type == "cuda")
    missing = compile_missing(device) if wanted else None
    if missing is None:
        return wanted
    if spec == "on":
        raise UserError(f"--compile on: {missing}; install it or run with --compile off")
    logger.warning("layers not compiled (--compile auto): %s; install it to train faster", missing)
    return False


def compile_missing(device: torch.device) -> str | None:
    """What torch.compile lacks on this host for `device`, None if nothing: Triton builds its GPU
    kernels' launcher as a Python C extension (a C compiler and Python's headers); Inductor builds
    CPU kernels with a C++ compiler. CC and CXX name a compiler as they do for those builds."""
    if device.type == "cuda":
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
        if not cc or not shutil.which(cc):
            return "no C compiler (gcc or clang) for Triton's kernel launcher"
        header = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not header.exists():
            return f"no Python headers ({header}: the python3-dev package) for Triton's kernel launcher"
        return None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        return "no C++ compiler (g++ or clang++) for Inductor's CPU kernels"
    return None


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each of the model's repeated layers in place (`nn.Module.compile`); return how many.

    The layers are the modules transformers names as not to be split (`_no_split_modules`: GPT-2's
    blocks, Llama's decoder layers): every layer shares one compiled graph (the parameters are its
    inputs), so compiling costs the time of one layer whatever the depth, and what stays eager is
    the embedding, the final norm and the fused loss head (`loss.causal_lm_loss`, already a few large
    matrix products). Inductor fuses each layer's norms, activation, residual adds and dropout into
    a few kernels, and the attention stays PyTorch's flash/efficient kernel (sdpa). Hooks on the
    parameters (the batch test's) and activation checkpointing work as before. A deep copy of the
    model is not compiled (`nn.Module.__getstate__` drops it): compile the copy again if it trains.
    A model without such a list stays eager (0).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        layer.compile()
    setattr(model, COMPILED_MARK, True)  # and the loss head's softmax terms (`loss.causal_lm_loss`)
    return len(layers)


class PortableInit(TorchFunctionMode):
    """Random fills of float32 CPU tensors drawn the same on every CPU kernel path.

    torch's float32 `normal_` has an AVX2 kernel that draws other values than its scalar one
    (ATEN_CPU_CAPABILITY=default), and the scale and shift of `normal_`/`uniform_` may be fused into
    an FMA or not; so a seeded model had another θ_0 on a machine without AVX2, and its peers never
    agreed (issue 9 §3). Inside this mode both draw N(0, 1) or U(0, 1) in float64, where torch has
    one scalar kernel and the unit scale and zero shift round exactly, then scale and shift in float64
    and round to float32 once. Same generator, same distribution; other values than torch's.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        signature = _fill_signature(func)
        if signature is not None:
            renamed = {{"from": "low", "to": "high"}.get(k, k): v for k, v in kwargs.items()}
            call = signature.bind(*args, **renamed)
            call.apply_defaults()
            tensor, first, second, generator = call.arguments.values()
            if getattr(tensor, "_is_hf_initialized", False):
                return tensor  # what transformers' wrappers of nn.init do: weights it already set
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and not tensor.is_cuda:
                return _portable_fill(tensor, func.__name__ == "normal_", first, second, generator)
        return func(*args, **kwargs)


def _signature(first: str, second: str) -> inspect.Signature:
    """(tensor, first, second, generator): the parameters of a torch random fill."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [
            inspect.Parameter("tensor", kind),
            inspect.Parameter(first, kind, default=0.0),
            inspect.Parameter(second, kind, default=1.0),
            inspect.Parameter("generator", kind, default=None),
        ]
    )


_NORMAL = _signature("mean", "std")
_UNIFORM_METHOD = _signature("low", "high")  # Tensor.uniform_'s "from" and "to", renamed
_UNIFORM_INIT = _signature("a", "b")


def _fill_signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """The signature of `func` if it is a random fill this mode draws itself: the Tensor methods, and
    nn.init's functions, which reach the mode under whatever name `torch.nn.init` holds then
    (transformers replaces them with wrappers of the same signature)."""
    name = getattr(func, "__name__", None)
    if name not in ("normal_", "uniform_"):
        return None
    if func is getattr(torch.Tensor, name):
        return _NORMAL if name == "normal_" else _UNIFORM_METHOD
    if func is getattr(torch.nn.init, name) or getattr(func, "__module__", "") == "torch.nn.init":
        return _NORMAL if name == "normal_" else _UNIFORM_INIT
    return None


def _portable_fill(
    tensor: torch.Tensor, normal: bool, first: float, second: float, generator: torch.Generator | None
) -> torch.Tensor:
    """N(first, second²) or U[first, second) into `tensor`: drawn in float64, rounded once."""
    draw = torch.empty(tensor.shape, dtype=torch.float64)
    if normal:
        draw.normal_(generator=generator).mul_(second).add_(first)
    else:
        draw.uniform_(generator=generator).mul_(second - first).add_(first)
    with torch.no_grad():
        return tensor.copy_(draw)


def resolve_config(spec: str | None, *, vocab_size: int = 256, max_seq_len: int = 1024) -> PretrainedConfig:
    """Return the transformers config `build_model` would use for `spec` (see there)."""
    name = spec or DEFAULT_MODEL
    if name in PRESETS:
        return _preset_config(name, vocab_size=vocab_size, max_seq_len=max_seq_len)
    path = Path(name).expanduser()
    if path.exists():
        config = _config_from_path(path, spec=name)
        _check_vocab(config, spec=name, vocab_size=vocab_size)
        return config
    config = _config_from_type(name)
    config.vocab_size = vocab_size
    _drop_out_of_vocab_token_ids(config)
    return config


def _preset_config(name: str, *, vocab_size: int, max_seq_len: int) -> PretrainedConfig:
    from transformers import LlamaConfig

    sizes = PRESETS[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        intermediate_size=4 * sizes["hidden_size"],
        num_hidden_layers=sizes["num_hidden_layers"],
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_attention_heads"],
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _config_from_path(path: Path, *, spec: str) -> PretrainedConfig:
    from transformers import AutoConfig

    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"--model: directory {spec!r} has no config.json")
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(str(path), local_files_only=True)
        return config
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise UserError(
            f"--model: cannot read a transformers config from {spec!r}: {_one_line(exc)}"
        ) from exc


def _check_vocab(config: PretrainedConfig, *, spec: str, vocab_size: int) -> None:
    # Smaller would index past the embedding; larger (a padded table) is refused too: the weights are
    # random, so the padding buys nothing, and a vocabulary that differs from the tokenizer's is
    # far more often the wrong tokenizer than a deliberate padding (docs/decisions/ 019: tokenizers).
    ours = getattr(config, "vocab_size", None)
    if ours != vocab_size:
        raise UserError(
            f"--model: {spec!r} has vocab_size {ours}, the tokenizer has {vocab_size} tokens; use the"
            f' tokenizer the config was made for (--tokenizer), or set "vocab_size": {vocab_size}'
            " in the config"
        )


def config_from_json(text: str) -> PretrainedConfig:
    """The transformers config a `config.to_json_string()` recorded (a checkpoint's `model_config`).

    Raises ValueError for text that is not such a config.
    """
    from transformers import AutoConfig

    try:
        data = json.loads(text)
        model_type = data.pop("model_type")
        config: PretrainedConfig = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a recorded model config: {_one_line(exc)}") from exc
    return config


def _config_from_type(model_type: str) -> PretrainedConfig:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"--model: no such file or transformers model type {model_type!r}; presets: "
            f"{', '.join(PRESETS)}; known types include {', '.join(EXAMPLE_MODEL_TYPES)}, ...; "
            "or pass a path to a config.json"
        )
    return AutoConfig.for_model(model_type)


def _drop_out_of_vocab_token_ids(config: PretrainedConfig) -> None:
    # A default config's special ids (gpt2: 50256) point outside a shrunk vocabulary.
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, attr, None)


def _check_size(config: PretrainedConfig, spec: str | None) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    params = count_parameters(meta)
    ram = _physical_memory_bytes()
    if ram and params * 4 > _MAX_WEIGHT_SHARE_OF_RAM * ram:
        raise UserError(
            f"--model: {spec!r} ({config.model_type}) has {params / 1e6:.0f}M parameters, "
            f"{params * 4 / 2**30:.1f} GiB in fp32, too large for this host's {ram / 2**30:.0f} GiB; "
            f"use a preset ({', '.join(PRESETS)}) or a config.json with smaller sizes"
        )


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def model_fingerprint(model: torch.nn.Module) -> str:
    """Return a sha256 hex digest of the model type and every parameter's name, shape and dtype.

    Peers compare it before they average: a different architecture, size or vocabulary gives a
    different fingerprint. Values are not included, so it is stable while training.
    """
    config: Any = getattr(model, "config", None)
    digest = hashlib.sha256(str(getattr(config, "model_type", type(model).__name__)).encode())
    for name, param in sorted(model.named_parameters()):
        digest.update(f"|{name}:{tuple(param.shape)}:{param.dtype}".encode())
    return digest.hexdigest()


# Dense bf16 peak of the GPUs volunteers bring, in FLOP/s (the vendors' data sheets, no sparsity):
# what model FLOPs utilization (MFU) is measured against. A device not listed has no MFU figure.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def train_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one training token (forward and backward): 6·N for the weights' matrix products
    and 12·L·d·T for attention's (PaLM's appendix B, the count llm.c and nanoGPT report MFU with;
    the causal mask's halving is not taken off). N counts every parameter (embeddings too)."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * count_parameters(model) + 12.0 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` (`PEAK_BF16_FLOPS`), None for a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def count_parameters(model: torch.nn.Module) -> int:
    """Return the number of parameter elements (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters())


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
