"""The typed training configuration shared by the node, the swarm and the simulator.

Each knob is documented where it is declared, with the paper's name for it and the symptom that
tells you to change it. The algorithm parts are the protocol/ config classes themselves
(`OuterConfig`, `ScheduleConfig`, `HelocoConfig`), nested here so there is one tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ...protocol.algorithms.codecs import make_codec
from ...protocol.algorithms.downlink import Downlink, downlink_for
from ...protocol.algorithms.feedback import RESIDUAL_DTYPES
from ...protocol.algorithms.heloco import HelocoConfig
from ...protocol.algorithms.outer import OuterConfig
from ...protocol.algorithms.parts import DEFAULT_OUTLIER_FACTOR, Aggregate, check_outlier_factor
from ...protocol.algorithms.schedule import ScheduleConfig
from ...protocol.algorithms.scoring import Score
from ..model.devices import resolve_devices
from .instances import InnerConfig

DEFAULT_CODEC_CANDIDATES: tuple[str, ...] = (
    "fp16",
    "int8",
    "int4",
    "lowrank:4",
    "lowrank:8",
    "lowrank:16",
    "lowrank:32",
)


PUBLIC_AGGREGATE = "clip:0.5"
"""The aggregate rule of a public run when none is given (`adloco-node`): CenteredClip, whose answers
every member checks by their fixed point (`verify.check_clip`). Measured over the real p2pd with a
hostile fourth node at the claim limit (bench/results/robust_swarm_defaults.json): within 5 % of the
clean run where the mean was 29 % off; a private run, whose peers the run owner admits, keeps the
mean (exactly checked, no clipping of honest outliers), as do the simulator and `--offline`."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what one peer computes in a round.

    model: a preset name ("tiny-llama", ...), a transformers model type, or a config.json path.
        Presets and types take the tokenizer's vocabulary; a config.json must state the same size.
    tokenizer: None (or "bytes") for the byte tokenizer (vocab 256, no files); a tokenizer.json, a
        `save_pretrained` folder, or a model name in the local Hugging Face cache. Every peer of a
        run needs the same one (its fingerprint is part of the run's). A BPE tokenizer packs several
        bytes into a token (3.6 for an 8192-token BPE on the embedded corpus), so the same seq_len
        sees that much more text; make one for the run's corpus with `adloco-node tokenizer`.
    dataset: None for the embedded corpus (the Python standard library's source), a local file or
        folder, or a `datasets` name.
    seq_len: tokens per training sequence.
    batch_size: b_0, the initial per-instance batch (AdLoCo `initial_batch_size`). The norm test grows
        it; start small so the test, not this number, decides.
    instances: K_0, MIT instances per node (AdLoCo `num_init_trainers`). More instances give the
        variance test more samples and more data diversity per round, at K× the optimizer memory.
    inner_steps: H, optimizer steps per round (DiLoCo H). Larger H means fewer communications; if the
        validation loss stalls while the inner loss falls, the instances drift: lower H.
    codec: the pseudo-gradient codec ("none", "fp16", "int8", "int4", "lowrank:R[:fp16|int4]",
        "sparse[:K/C[:B]]": SparseLoCo's chunked top-k, K of every C values at B bits) or
        "adaptive" (DiLoCoX adaptive compression: cheapest of `codec_candidates` meeting
        `max_rel_error` and the byte budget the overlap window allows).
    max_rel_error: δ, the relative compression error bound of the adaptive chooser. If the loss
        lags an uncompressed run, lower it.
    heloco: HeLoCo correction of late pseudo-gradients; `correct_late=False` applies them as they are.
    staleness_weight: ρ(τ) for late contributions: "constant", "inv_sqrt" (Async DiLoCo), "tokens".
    max_staleness: contributions older than this many rounds are dropped rather than corrected
        (HeLoCo reports dropping can beat correcting beyond ~15).
    dylu: DyLU (Async DiLoCo's dynamic local updates): after each round a peer shortens its H to its
        speed relative to the fastest member of the group (from the step times every member
        reports), so a slow peer finishes with the others instead of arriving stale. Turn it on
        when a slow peer's contributions keep arriving late (τ > 0 every round).
    replay_mb: the averaged updates a peer keeps for laggards to replay (catch-up) are the last up to
        `HISTORY_ROUNDS` whose encoded bytes fit in this many MB (0 keeps none; a peer further behind
        than what others keep downloads the full state). Each costs about the codec's bytes per
        parameter (1 for int8), so for large models this bounds a real share of the node's memory.
    residual_dtype: how the error-feedback residual is kept between rounds: "int8" (1.02 bytes per
        parameter: a power-of-two scale per 256 values), "bfloat16" (2) or "float32" (4); "auto"
        (the default) is int8 for the int8 and int4 codecs, whose residual is at most half their
        step, and bf16 for the others. Δ + e is formed in fp32 either way. In the simulator bf16
        changed the validation loss by < 0.001 nats against fp32, and int8 by < 0.001 against bf16
        with the int8 and int4 codecs, but +0.08 (within the seeds' spread) with lowrank:2
        (docs/experiments.md).
    downlink: how an owner's average of a part travels back (protocol/algorithms/downlink.py):
        "encode" re-encodes it with the round's codec; "feedback" does so with owner-side error
        feedback (what the owner's encoding drops is sent in the owner's next round), same bytes;
        "gather" sends the contributions themselves (nothing lost, about n times the downlink bytes
        in a group of n; needs aggregate "mean"). "auto": feedback for a sparse codec, whose
        re-sparsified average drops most of the mass, encode for the others. If a sparse run's loss
        lags its uncompressed run by more than its uplink error explains, try gather. In a swarm
        (`checked_answers`) feedback is refused and auto gathers a sparse codec under the mean.
    checked_answers: every member checks its owners' answers (protocol/transport/verification.py):
        set by the swarm node, not a flag. An answer must then be checkable from the commitments,
        which an owner's private residual ("feedback") is not.
    ef_decay: β of the sender's error feedback (SparseLoCo, arXiv 2508.15706): each round the residual
        is scaled by β before Δ is added (1: plain error feedback). SparseLoCo runs β = 0.95 with
        the outer momentum off, the decaying residual standing in for it (`--ef-momentum`).
    aggregate: how an owner combines the contributions to its parts that pass the screening:
        "mean" (the weighted mean), "trimmed:β" (coordinate-wise, ⌊β·n⌋ of each end left out) or
        "clip:c" (CenteredClip, τ = c × the median distance from the coordinate-wise median); the
        robust rules bound what a few hostile peers can move (protocol/algorithms/parts.py).
    score: contribution scoring as Templar's Gauntlet does (issue 10 §3): "off", or "loss" /
        "loss:k": before the aggregate rule, each contribution's Δ is applied to θ (× the outer lr)
        on a batch its sender cannot choose, and one that raises the loss beyond k robust standard
        deviations below the median gain (default 3) is excluded (protocol/algorithms/scoring.py).
        Costs (contributors + 1) forward passes of 16 sequences per round where it runs. Turn it
        on when peers are not trusted and a sign-flipped or noise Δ at an honest norm gets past the
        aggregate rule (the loss jumps after rounds while the norm screening rejects nothing).
    outlier_factor: the owners' norm screening rejects a payload of a part whose norm per claimed
        token exceeds this many times the part's median (protocol/algorithms/parts.py; default 10,
        0 turns the norm test off, never the non-finite one). Lower it if scaled Δs get through
        (the loss jumps while no part is rejected); raise it if honest parts are rejected (the
        owners' "rejected part" warnings name peer, part and ratio).
    b_max: override the probed hardware batch limit (switch mode engages above it).
    memory_budget_gb: CPU memory for b_max probing (default: half of what is available).
    non_iid: give each peer a different part of the corpus (by top-level package).
    max_corpus_mb: an explicit cap on the corpus read (MB of source text; default: none, the whole
        corpus is tokenized once into the token cache and read lazily).
    data_cache_dir: where the token cache lives (default `~/.cache/adloco`); where the data is
        read, not what is computed. Point it at a disk with room for the tokenized corpus.
    overlap: DiLoCoX one-step-delay overlap. "off": every round starts from the new θ, after the
        averaging (the synchronous DiLoCo call order train → contribute → apply). "rebase",
        "overwrite", "mix": the instances train the next round while the last one is averaged, and
        when its update lands their progress is rebased onto the new θ, dropped, or mixed with it
        (`overlap_mix` of the local weights). Rebase keeps everything; if the loss oscillates under
        overlap, try mix. "auto": mix while the exchange fits in a local round (DiLoCoX's condition
        T_comm ≤ H·t_step, measured), else that round waits (the driver decides, `Peer.train_round(
        from_theta=True)`). The caller must then apply each update during or after the *next* local
        round (the swarm and the simulator do).
    device: where the instances train: "auto" (every visible GPU, else the CPU), "cpu", "cuda",
        "cuda:N", or a list ("cuda:0,cuda:1"): instance k trains on device k mod D, the first
        device's in the node's process, each other device's in a worker process of its own
        (`remote`). θ, the outer momentum, Δ, the error-feedback residual and the kept updates stay
        in host memory whatever the device (`devices.Placement`).
    data_parallel: with more devices than instances, the devices no instance holds train replicas
        of the instances, each instance data parallel over its devices (`parallel`); False leaves
        them idle (each instance then trains exactly as on one device, bit for bit).
    shard_layers: the members of each data-parallel group shard the decoder layers over the group
        (FSDP2, `sharding`: each holds 1/n of their weights, gradients and AdamW moments) instead of
        each holding the whole model; the batch test must then be the norm test.
    precision: the instances' forward passes: "auto" autocasts to bf16 on a CUDA GPU with native
        bf16 (Ampere or later) and runs fp32 elsewhere; "fp32" never autocasts; "bf16" autocasts
        also on a CPU (slower than fp32 on most CPUs). Master weights, gradients, AdamW state and θ
        stay fp32, so peers of different precisions average together. Try fp32 if the inner loss
        of a bf16 run diverges where an fp32 run's does not.
    activation_checkpointing: recompute each layer's activations in the backward pass instead of
        keeping them (transformers' activation/gradient checkpointing): about a third more compute
        for activation memory of one layer instead of all, so b_max grows. Turn it on when b_max
        is small (the log's "b_max=") and rounds run in switch mode (accumulation > 1).
    compile: torch.compile of each instance's layers (`model.compile_layers`): "auto" on a CUDA GPU,
        not on a CPU; "on", "off". The first steps of each batch size take the compile time (logged).
    """

    model: str | None = None
    tokenizer: str | None = None
    dataset: str | None = None
    text_field: str = "text"
    seq_len: int = 128
    batch_size: int = 8
    instances: int = 2
    inner_steps: int = 10
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    codec: str = "int8"
    codec_candidates: tuple[str, ...] = DEFAULT_CODEC_CANDIDATES
    max_rel_error: float = 0.1
    heloco: HelocoConfig = field(default_factory=HelocoConfig)
    correct_late: bool = True
    staleness_weight: Literal["constant", "inv_sqrt", "tokens"] = "inv_sqrt"
    max_staleness: int = 16
    dylu: bool = False
    replay_mb: float = 256.0
    residual_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    downlink: Literal["auto", "encode", "feedback", "gather"] = "auto"
    checked_answers: bool = False
    ef_decay: float = 1.0
    aggregate: str = "mean"
    score: str = "off"
    outlier_factor: float = DEFAULT_OUTLIER_FACTOR
    b_max: int | None = None
    memory_budget_gb: float | None = None
    non_iid: bool = False
    val_sequences: int = 32
    max_corpus_mb: float | None = None
    data_cache_dir: str | None = None
    seed: int = 0
    device: str = "auto"
    data_parallel: bool = True
    shard_layers: bool = False
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    activation_checkpointing: bool = False
    compile: Literal["auto", "on", "off"] = "auto"
    overlap: Literal["off", "auto", "rebase", "overwrite", "mix"] = "off"
    overlap_mix: float = 0.5

    def downlink_of(self, spec: str, aggregate: Aggregate | None = None) -> Downlink:
        """The downlink the rounds of codec `spec` use (`downlink.downlink_for`)."""
        rule = (aggregate or Aggregate.parse(self.aggregate)).rule
        return downlink_for(self.downlink, spec, checked=self.checked_answers, mean=rule == "mean")

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "instances", "inner_steps", "val_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.instances < self.schedule.merge.min_instances:
            raise ValueError(
                f"instances ({self.instances}) is below min_instances ({self.schedule.merge.min_instances}):"
                " raise instances or lower min_instances"
            )
        if self.b_max is not None and self.b_max < 1:
            raise ValueError(f"b_max must be >= 1, got {self.b_max}")
        for spec in (self.codec,) if self.codec != "adaptive" else self.codec_candidates:
            try:
                make_codec(spec)
            except ValueError as e:
                raise ValueError(f"codec: {e}") from None
        if not self.max_rel_error > 0:
            raise ValueError(f"max_rel_error must be > 0, got {self.max_rel_error}")
        if not (math.isfinite(self.replay_mb) and self.replay_mb >= 0):
            raise ValueError(f"replay_mb must be >= 0, got {self.replay_mb}")
        try:
            check_outlier_factor(self.outlier_factor)
            aggregate = Aggregate.parse(self.aggregate)
            Score.parse(self.score)
            for spec in (self.codec,) if self.codec != "adaptive" else self.codec_candidates:
                self.downlink_of(spec, aggregate)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if self.downlink == "gather" and aggregate.rule != "mean":
            raise ValueError(
                f"downlink gather sends the contributions for their mean, not for aggregate {self.aggregate};"
                " use downlink feedback or encode with a robust aggregate"
            )
        if not (math.isfinite(self.ef_decay) and 0 < self.ef_decay <= 1):
            raise ValueError(f"ef_decay must be in (0, 1], got {self.ef_decay} (SparseLoCo uses 0.95)")
        if self.residual_dtype not in ("auto", *RESIDUAL_DTYPES):
            raise ValueError(
                f"residual_dtype must be auto, float32, bfloat16 or int8, got {self.residual_dtype!r}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        for name in ("max_corpus_mb", "memory_budget_gb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.overlap not in ("off", "auto", "rebase", "overwrite", "mix"):
            raise ValueError(f"overlap must be off, auto, rebase, overwrite or mix, got {self.overlap!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.shard_layers and self.schedule.test == "augmented":
            raise ValueError(
                "the augmented batch test needs each sample's whole gradient, which sharded layers never"
                " hold: use --batch-test norm, or --data-parallel on"
            )
        if not 0 <= self.overlap_mix <= 1:
            raise ValueError(f"overlap_mix must be in [0, 1], got {self.overlap_mix}")
        try:
            resolve_devices(self.device)
        except ValueError as e:
            raise ValueError(f"device: {e}") from None


def residual_dtype(cfg: TrainConfig) -> str:
    """The residual dtype `cfg` means: its own, or for "auto" int8 with the uniform quantizers (int8,
    int4; what they leave is at most half a step) and bf16 with any other codec or the chooser."""
    if cfg.residual_dtype != "auto":
        return cfg.residual_dtype
    return "int8" if cfg.codec in ("int8", "int4") else "bfloat16"
