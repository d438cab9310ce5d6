"""Command-line flags for the training configuration, shared by `adloco-node` and `adloco-sim`."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace

import torch

from ...errors import UserError
from ..model.devices import resolve_device, resolve_devices, resolve_precision
from ..training.config import PUBLIC_AGGREGATE, TrainConfig


def finite_float(text: str) -> float:
    """argparse type for float flags: nan and inf pass float() but no knob means anything with them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def config_error(e: ValueError, args: argparse.Namespace) -> UserError:
    """A config validation error as a UserError that names the flag first, as every UserError does.

    Validation messages start with the field they reject ("seq_len must be >= 1", "outer lr must be
    > 0", "codec: unknown codec spec"); when that field (one or two words) is a flag's destination,
    the message is prefixed with the flag.
    """
    msg = str(e)
    words = re.match(r"([a-z_]+)(?: ([a-z_]+))?", msg)
    candidates = ["_".join(w for w in words.groups() if w), words[1]] if words else []
    for dest in candidates:
        if dest in vars(args):
            flag = "--" + dest.replace("_", "-")
            rest = msg[len(dest) :]
            return UserError(f"{flag}{rest}" if rest.startswith(":") else f"{flag}: {msg}")
    return UserError(msg)


def set_threads(threads: int | None) -> None:
    """Apply --threads (None: torch's default, all CPUs)."""
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"--threads: must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def check_device(spec: str) -> None:
    """Fail fast on a --device this machine does not have (torch would fail deep in model setup)."""
    if spec == "auto":
        return
    devices = resolve_devices(spec)  # the syntax is checked by TrainConfig
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in devices:
        if device.type == "cuda" and (device.index or 0) >= count:
            raise UserError(
                f"--device: {str(device)!r} is not available here ({count} CUDA devices); use auto or cpu"
            )
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise UserError(f"--device: {str(device)!r} is not available here; use auto or cpu")
        if device.type not in ("cpu", "cuda", "mps"):
            raise UserError(f"--device: a node trains on cpu, cuda or cuda:N, not {str(device)!r}")
    if len(devices) > 1 and len({d.type for d in devices}) > 1:
        raise UserError(f"--device: {spec!r} mixes kinds of device; list GPUs only, or the CPU only")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The model/data, local-training (AdLoCo) and outer-step/communication flag groups."""
    model = p.add_argument_group("model and data")
    model.add_argument("--model", default=None, help="preset, transformers model type, or config.json path")
    model.add_argument(
        "--tokenizer",
        default=None,
        help="bytes (default: vocab 256, no files), a tokenizer.json (`adloco-node tokenizer` makes one),"
        " a save_pretrained folder, or a model name in the local Hugging Face cache",
    )
    model.add_argument(
        "--dataset", default=None, help="local files or datasets name (default: embedded corpus)"
    )
    model.add_argument("--text-field", default="text", help="text column of a json/parquet/datasets source")
    model.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    model.add_argument("--non-iid", action="store_true", help="each peer gets a different part of the corpus")
    model.add_argument(
        "--max-corpus-mb",
        type=finite_float,
        default=None,
        help="explicit cap on the corpus read (default: none)",
    )
    model.add_argument(
        "--data-cache-dir",
        default=None,
        help="where the tokenized corpus is cached (default: ~/.cache/adloco)",
    )
    model.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    model.add_argument(
        "--device",
        default="auto",
        help="where the instances train: auto (every visible GPU, else the CPU), cpu, cuda, cuda:N, or a"
        " list (cuda:0,cuda:1: instance k on device k mod D, each further device in a worker process);"
        " θ and the outer state stay in host memory",
    )
    model.add_argument(
        "--data-parallel",
        choices=("on", "off", "shard"),
        default="on",
        help="with more devices than MIT instances, each instance trains data parallel over the"
        " devices no instance holds, each holding the whole model (on) or a shard of its decoder"
        " layers (shard: FSDP2, for a model whose training does not fit one device; the norm test; on"
        " chooses it where a whole model does not fit and a shard does);"
        " off leaves them idle",
    )
    model.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="the instances' forward passes: auto (bf16 autocast on GPUs with native bf16, else fp32),"
        " fp32, or bf16 (also on a CPU); weights, optimizer and θ stay fp32",
    )
    model.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass: ~1/3 more compute, a larger b_max",
    )
    model.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile each instance's layers: auto (on a CUDA GPU), on, off",
    )

    local = p.add_argument_group("local training (AdLoCo)")
    local.add_argument("--instances", type=int, default=2, help="K_0, MIT instances per peer")
    local.add_argument("--batch-size", type=int, default=8, help="b_0, initial per-instance batch")
    local.add_argument("--inner-steps", type=int, default=10, help="H, optimizer steps per round")
    local.add_argument(
        "--inner-steps-policy",
        choices=("fixed", "constant_tokens", "hide_comm"),
        default="fixed",
        help="H after each round: fixed; constant_tokens (H·Σb stays); hide_comm (the round hides the next"
        " exchange, from the members' step times and links)",
    )
    local.add_argument("--min-inner-steps", type=int, default=1, help="floor on H under the policies")
    local.add_argument(
        "--max-inner-steps", type=int, default=200, help="ceiling on H under hide_comm (200, measured)"
    )
    local.add_argument("--inner-lr", type=finite_float, default=4e-4, help="AdamW lr of the instances")
    local.add_argument("--b-max", type=int, default=None, help="hardware batch limit (default: probed)")
    local.add_argument(
        "--memory-budget-gb", type=finite_float, default=None, help="CPU memory for b_max probing"
    )
    local.add_argument("--batch-test", choices=("norm", "augmented", "none"), default="norm")
    local.add_argument("--eta", type=finite_float, default=0.8, help="η of the norm test")
    local.add_argument("--batch-cap", type=int, default=64, help="largest per-instance batch")
    local.add_argument("--merge-every", type=int, default=2, help="rounds between MIT merges")
    local.add_argument("--min-instances", type=int, default=1, help="MIT merges stop at this count")

    outer = p.add_argument_group("outer step and compression")
    outer.add_argument(
        "--outer-lr",
        type=finite_float,
        default=None,
        help="outer Nesterov lr η (default 0.7; async runs use less)",
    )
    outer.add_argument(
        "--outer-momentum",
        type=finite_float,
        default=None,
        help="outer Nesterov momentum μ; unset: 0.9, or 0 under --ef-momentum",
    )
    outer.add_argument(
        "--nesterov", choices=("n1", "n2"), default="n1", help="N1 PyTorch or N2 dampened form"
    )
    outer.add_argument(
        "--outer-delay",
        type=int,
        default=1,
        help="delayed Nesterov (Async DiLoCo): the momentum term every N rounds, Δ/N each round;"
        " 1: plain Nesterov; the same on every peer of a run",
    )
    outer.add_argument(
        "--codec",
        default="int8",
        help="none|fp16|int8|int4|lowrank:R[:fp16|int4]|sparse[:K/C[:B]]|adaptive (sparse: SparseLoCo's top K"
        " of every C values at B bits, default 64/4096:2). A public swarm run takes no low-rank codec, and a"
        " sparse one only under --aggregate mean: their answers would be checked by their norm alone",
    )
    outer.add_argument(
        "--downlink",
        choices=("auto", "encode", "feedback", "gather"),
        default=TrainConfig.downlink,
        help="how an owner's average travels back: re-encoded, re-encoded with owner-side error feedback,"
        " or the contributions gathered (n times the bytes, nothing lost); auto: feedback for sparse",
    )
    outer.add_argument(
        "--ef-momentum",
        type=finite_float,
        default=None,
        metavar="BETA",
        help="SparseLoCo: the error-feedback residual stands in for the outer momentum: it decays by BETA"
        " each round (0.95 in the paper) and the outer step has no momentum of its own",
    )
    outer.add_argument(
        "--residual-dtype",
        choices=("auto", "float32", "bfloat16", "int8"),
        default=TrainConfig.residual_dtype,
        help="how the error-feedback residual is kept between rounds: int8 (1.02 B/param), bfloat16"
        " (2) or float32 (4); auto: int8 with the int8 and int4 codecs, bfloat16 otherwise",
    )
    outer.add_argument(
        "--aggregate",
        default=None,
        help="how owners combine contributions: mean, trimmed:β (coordinate-wise trimmed mean) or"
        " clip:c (CenteredClip); the robust rules bound what hostile peers can move (default:"
        f" {PUBLIC_AGGREGATE} in a public run, mean in a private run, offline and in the simulator)",
    )
    outer.add_argument(
        "--outlier-factor",
        type=finite_float,
        default=TrainConfig.outlier_factor,
        help="owners reject a part whose norm per claimed token exceeds this many times the part's"
        " median (0: no norm test; non-finite values are always rejected)",
    )
    outer.add_argument(
        "--score",
        default=TrainConfig.score,
        help="contribution scoring (Templar's Gauntlet): off, or loss[:k]: exclude a Δ that raises the"
        " loss on a batch its sender cannot choose, k robust deviations below the median gain (k=3)",
    )
    outer.add_argument(
        "--max-rel-error", type=finite_float, default=0.1, help="δ of the adaptive codec chooser"
    )
    outer.add_argument(
        "--overlap",
        choices=("off", "auto", "rebase", "overwrite", "mix"),
        default="auto",
        help="DiLoCoX one-step-delay overlap: train the next round while this one is averaged, then mix"
        " the local weights with the new θ (or rebase the local progress onto it, or overwrite it); auto"
        " overlaps (mix) only while the last exchange fit in a local round; off waits for every update",
    )
    outer.add_argument(
        "--overlap-mix", type=finite_float, default=0.5, help="local weights' share under --overlap mix"
    )

    late = p.add_argument_group("late contributions (HeLoCo)")
    late.add_argument("--no-correction", action="store_true", help="apply late pseudo-gradients uncorrected")
    late.add_argument(
        "--heloco-c-ok",
        type=finite_float,
        default=0.2,
        help="HeLoCo keeps a late tensor as it is when cos(Δ, m) ≥ this (our default; the paper gives"
        " none): raise it to correct more, -1 corrects nothing",
    )
    late.add_argument("--staleness-weight", choices=("constant", "inv_sqrt", "tokens"), default="inv_sqrt")
    late.add_argument("--max-staleness", type=int, default=16, help="drop contributions older than this")
    late.add_argument(
        "--dylu", action="store_true", help="shorten H to this peer's speed relative to the fastest peer"
    )
    late.add_argument(
        "--replay-mb",
        type=finite_float,
        default=256.0,
        help="memory for the averaged updates kept for laggards to replay (the last up to 8 that fit;"
        " a peer further behind downloads the full state)",
    )


def outer_momentum(args: argparse.Namespace) -> float:
    """--outer-momentum, 0 under --ef-momentum (the residual is the momentum); both: UserError."""
    if args.ef_momentum is None:
        return TrainConfig().outer.momentum if args.outer_momentum is None else float(args.outer_momentum)
    if args.outer_momentum:
        raise UserError(
            "--ef-momentum: the error-feedback residual stands in for the outer momentum; leave"
            f" --outer-momentum out (got {args.outer_momentum}) or drop --ef-momentum"
        )
    if not 0 < args.ef_momentum <= 1:
        raise UserError(f"--ef-momentum: must be in (0, 1], got {args.ef_momentum} (SparseLoCo uses 0.95)")
    return 0.0


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The typed config from parsed flags; a contradiction raises UserError with the fix."""
    base = TrainConfig()
    try:
        cfg = replace(
            base,
            model=args.model,
            tokenizer=args.tokenizer,
            dataset=args.dataset,
            text_field=args.text_field,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            instances=args.instances,
            inner_steps=args.inner_steps,
            inner=replace(base.inner, lr=args.inner_lr),
            outer=replace(
                base.outer,
                lr=base.outer.lr if args.outer_lr is None else args.outer_lr,
                momentum=outer_momentum(args),
                convention=args.nesterov,
                delay=args.outer_delay,
            ),
            schedule=replace(
                base.schedule,
                test=args.batch_test,
                eta=args.eta,
                batch_cap=args.batch_cap,
                inner_steps_policy=args.inner_steps_policy,
                min_inner_steps=args.min_inner_steps,
                max_inner_steps=args.max_inner_steps,
                merge=replace(
                    base.schedule.merge, merge_every=args.merge_every, min_instances=args.min_instances
                ),
            ),
            codec=args.codec,
            downlink=args.downlink,
            ef_decay=1.0 if args.ef_momentum is None else args.ef_momentum,
            max_rel_error=args.max_rel_error,
            aggregate=TrainConfig.aggregate if args.aggregate is None else args.aggregate,
            outlier_factor=args.outlier_factor,
            score=args.score,
            correct_late=not args.no_correction,
            heloco=replace(base.heloco, c_ok=args.heloco_c_ok),
            staleness_weight=args.staleness_weight,
            max_staleness=args.max_staleness,
            dylu=args.dylu,
            replay_mb=args.replay_mb,
            residual_dtype=args.residual_dtype,
            b_max=args.b_max,
            memory_budget_gb=args.memory_budget_gb,
            non_iid=args.non_iid,
            max_corpus_mb=args.max_corpus_mb,
            data_cache_dir=args.data_cache_dir,
            seed=args.seed,
            device=args.device,
            data_parallel=args.data_parallel != "off",
            shard_layers=args.data_parallel == "shard",
            precision=args.precision,
            activation_checkpointing=args.activation_checkpointing,
            compile=args.compile,
            overlap=args.overlap,
            overlap_mix=args.overlap_mix,
        )
    except ValueError as e:
        raise config_error(e, args) from None
    check_device(cfg.device)
    resolve_precision(cfg.precision, resolve_device(cfg.device))
    return cfg
