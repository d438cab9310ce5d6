"""Sampling the corpus: per-peer shards, the token streams instances train on, validation windows.

`shard_corpus` deals the training documents into disjoint (peer, instance) shards by their keys, a
`TokenSampler` draws seeded random windows from one shard's token stream (an MIT merge
concatenates two streams) and `restore_streams` rebuilds such streams for a resumed node,
`validation_batches` cuts fixed, evenly spaced windows every peer evaluates on identically, and
`evaluate` measures a model's loss on them. Streams are views of the token cache (`streams.py`):
a shard costs its piece table, not its tokens, and the sharding is vectorized over documents.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ...errors import UserError
from .corpus import Corpus, DocTable, hash_hex
from .state import malformed
from .streams import IntArray, TokenStream, digest

logger = logging.getLogger(__name__)

# Tokens of a stream kept in a sampler's state, at evenly spaced positions: enough to tell which
# shards an MIT-merged stream was built from (`restore_streams`) at a few KB.
_PROBES = 512
_MASK64 = (1 << 64) - 1


class TokenSampler:
    """Random windows of `seq_len` tokens from a shard's token stream.

    Windows are drawn uniformly (with replacement) from a `torch.Generator` seeded with `seed`, so
    the batches depend only on the stream, the seed and the sequence of calls. The model uses
    `labels=input_ids` and shifts internally. `docs` is a `TokenStream` (what `shard_corpus`
    returns) or token tensors, concatenated.
    """

    def __init__(self, docs: TokenStream | Sequence[torch.Tensor], *, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise UserError(f"--seq-len: must be positive, got {seq_len}")
        self.stream = docs if isinstance(docs, TokenStream) else TokenStream.of_tensors(docs)
        self.seq_len = seq_len
        if self.stream.num_tokens < seq_len:
            raise UserError(
                f"--seq-len: {seq_len} is larger than the data: this shard has {self.stream.num_tokens}"
                " tokens; use a shorter sequence, fewer peers or instances, or a larger dataset"
            )
        self._generator = torch.Generator().manual_seed(seed)
        self._sha256: str | None = None  # of the stream, which never changes once built

    @property
    def num_tokens(self) -> int:
        """Tokens in the shard."""
        return self.stream.num_tokens

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Return a (batch_size, seq_len) int64 tensor of windows."""
        high = self.stream.num_tokens - self.seq_len + 1
        starts = torch.randint(0, high, (batch_size,), generator=self._generator)
        return self.stream.windows(starts, self.seq_len)

    def merged_with(self, other: TokenSampler) -> TokenSampler:
        """Return a sampler over both shards that continues this one's random stream.

        Used when two MIT instances merge: the survivor takes over the victim's data.
        """
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot merge samplers of seq_len {self.seq_len} and {other.seq_len}")
        merged = TokenSampler(self.stream.concat(other.stream), seq_len=self.seq_len, seed=0)
        merged.set_state(self.get_state())
        return merged

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its stream (piece tables; a token file by its path) and its random position:
        how an instance on another device gets its data stream (`training.remote`)."""
        return (_rebuilt_sampler, (self.stream, self.seq_len, self.get_state(), self._sha256))

    def get_state(self) -> torch.Tensor:
        """Return the generator state, for checkpoints."""
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Restore a state from `get_state`."""
        self._generator.set_state(state)

    def state_dict(self) -> dict[str, Any]:
        """The random position (`rng`) and what identifies the stream it draws from (`stream`).

        `stream` (length, dtype, sha256 and the tokens at up to 512 evenly spaced positions, a few
        KB) is how `restore_streams` rebuilds a stream that MIT merges concatenated from several
        shards; `load_state_dict` restores only the position. The sha256 reads the whole stream
        once (in bounded chunks) and is kept.
        """
        if self._sha256 is None:
            self._sha256 = digest([self.stream])
        n = self.num_tokens
        return {
            "rng": self.get_state(),
            "stream": {
                "tokens": n,
                "dtype": self.stream.dtype,
                "sha256": self._sha256,
                "probe": torch.from_numpy(self.stream.take(_probe_positions(n))),
            },
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError if `load_state_dict(state)` would fail."""
        with malformed("sampler state"):
            rng = state["rng"]
            if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
                raise ValueError("sampler state: rng is not a byte tensor")
            try:
                torch.Generator().set_state(rng)
            except RuntimeError as e:
                raise ValueError(f"sampler state: {e}") from e

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the random sequence `state` was saved at, on this sampler's stream."""
        self.check_state_dict(state)
        self.set_state(state["rng"])


def _rebuilt_sampler(
    stream: TokenStream, seq_len: int, rng: torch.Tensor, sha256: str | None
) -> TokenSampler:
    sampler = TokenSampler(stream, seq_len=seq_len, seed=0)
    sampler.set_state(rng)
    sampler._sha256 = sha256
    return sampler


def shard_corpus(
    corpus: Corpus,
    *,
    peer_index: int,
    num_peers: int,
    instance_index: int,
    num_instances: int,
    non_iid: bool = False,
    seed: int = 0,
) -> TokenStream:
    """Return the token stream of one (peer, instance) shard of the training documents.

    The num_peers × num_instances shards are disjoint and together cover the training set. IID:
    the documents in seed-dependent key-hash order are cut into runs of about equal tokens, one per
    shard. Non-IID: whole groups (top-level packages, or blocks of dataset rows), largest first, go
    to the least-loaded peer, so each peer sees different packages (with fewer groups than peers,
    runs of consecutive documents instead); a peer's documents are then cut IID among its
    instances. With fewer documents than shards, the token stream is cut into contiguous pieces.
    Every decision depends on the documents' keys and sizes only, never on where they sit in the
    cache, so every peer computes the same shards whatever order its files were listed in.
    """
    docs, cut = _shard(
        corpus.train,
        peer_index=peer_index,
        num_peers=num_peers,
        instance_index=instance_index,
        num_instances=num_instances,
        non_iid=non_iid,
        seed=seed,
    )
    stream = corpus_stream(corpus, docs)
    if cut is None:
        return stream
    index, count = cut
    n = stream.num_tokens
    return stream.slice(index * n // count, (index + 1) * n // count)


def shard_documents(
    corpus: Corpus,
    *,
    peer_index: int,
    num_peers: int,
    instance_index: int,
    num_instances: int,
    non_iid: bool = False,
    seed: int = 0,
) -> DocTable | None:
    """The documents of the shard `shard_corpus` returns, in its order; None if it cuts documents."""
    docs, cut = _shard(
        corpus.train,
        peer_index=peer_index,
        num_peers=num_peers,
        instance_index=instance_index,
        num_instances=num_instances,
        non_iid=non_iid,
        seed=seed,
    )
    return docs if cut is None else None


def corpus_stream(corpus: Corpus, docs: DocTable) -> TokenStream:
    """The documents of `docs`, in that order, as one stream over the corpus's tokens."""
    return TokenStream.of(corpus.tokens, docs.start, docs.length)


def _shard(
    docs: DocTable,
    *,
    peer_index: int,
    num_peers: int,
    instance_index: int,
    num_instances: int,
    non_iid: bool,
    seed: int,
) -> tuple[DocTable, tuple[int, int] | None]:
    """The shard's documents, and (index, count) if the shard is piece `index` of `count` of their stream."""
    if not (0 <= peer_index < num_peers and 0 <= instance_index < num_instances):
        raise ValueError(
            f"shard ({peer_index}, {instance_index}) outside {num_peers} peers x {num_instances} instances"
        )
    index, count = peer_index * num_instances + instance_index, num_peers * num_instances
    if non_iid:
        peer_docs = _non_iid_peer_docs(docs, peer_index=peer_index, num_peers=num_peers)
        if peer_docs is None:
            return docs, (index, count)
        docs, index, count = peer_docs, instance_index, num_instances
    if len(docs) < count:
        return docs, (index, count)
    order = np.lexsort((docs.record, _mix(docs.key, seed)))
    bounds = _balanced_cut(docs.length[order], count)
    return docs.take(order[bounds[index] : bounds[index + 1]]), None


def _non_iid_peer_docs(docs: DocTable, *, peer_index: int, num_peers: int) -> DocTable | None:
    """The documents of this peer's groups; runs of documents stand in for groups when too few."""
    if len(docs) < num_peers:
        return None
    present, inverse = np.unique(docs.group, return_inverse=True)
    if present.size < num_peers:
        bounds = _balanced_cut(docs.length, num_peers)
        return docs.take(np.arange(bounds[peer_index], bounds[peer_index + 1]))
    sizes = np.zeros(present.size, dtype=np.int64)
    np.add.at(sizes, inverse, docs.length)
    # Largest first, ties by group index (group names are sorted for file corpora).
    names = sorted(range(present.size), key=lambda g: (-int(sizes[g]), int(present[g])))
    bins = _deal_least_loaded([int(sizes[g]) for g in names], num_peers)
    mine = np.array([names[j] for j in bins[peer_index]], dtype=np.int64)
    return docs.take(np.flatnonzero(np.isin(inverse, mine)))


def _deal_least_loaded(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Give each item, in order, to the bin with the fewest tokens so far (ties: lowest bin)."""
    heap = [(0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for item, size in enumerate(sizes):
        load, b = heapq.heappop(heap)
        bins[b].append(item)
        heapq.heappush(heap, (load + max(size, 1), b))
    return bins


def _balanced_cut(lengths: IntArray, count: int) -> IntArray:
    """Bounds 0 = b_0 < b_1 < ... < b_count = n cutting the items, in order, into `count` runs.

    Item i goes to the run its token midpoint falls in (equal shares of the total), then the bounds
    are pushed apart so that every run holds at least one item (n >= count). Integer arithmetic.
    """
    n = lengths.size
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if n else 0
    inner = np.arange(1, count, dtype=np.int64)
    targets = inner * (2 * total) // count
    bounds = np.searchsorted(2 * ends - lengths, targets, side="left").astype(np.int64)
    bounds = np.clip(bounds, inner, n - count + inner)
    bounds = np.maximum.accumulate(bounds - inner) + inner
    return np.concatenate([[0], bounds, [n]]).astype(np.int64)


def _mix(keys: np.ndarray[Any, np.dtype[np.uint64]], seed: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A seed-dependent permutation order of 64-bit keys (splitmix64 of key xor mixed seed)."""
    z = keys ^ np.uint64(_splitmix64(seed & _MASK64))
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return mixed


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def validation_stream(corpus: Corpus) -> TokenStream:
    """The validation documents as one stream, the same on every peer.

    Files come in path order (as before the token cache), data rows in key order.
    """
    return corpus_stream(corpus, corpus.val)


def validation_batches(corpus: Corpus, *, seq_len: int, num_sequences: int, seed: int = 0) -> torch.Tensor:
    """Return fixed (num_sequences, seq_len) int64 windows of the validation documents.

    Windows are evenly spaced over the validation stream (`validation_stream`), shifted by an
    offset derived from `seed` with integer arithmetic only, so every peer evaluates on identical
    tokens; only these windows are read.
    """
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    if not len(corpus.val):
        raise UserError("--val-percent: the corpus has no validation documents; use a value above 0")
    stream = validation_stream(corpus)
    span = stream.num_tokens - seq_len + 1
    if span <= 0:
        raise UserError(
            f"--seq-len: {seq_len} is larger than the validation set ({stream.num_tokens} tokens); "
            "use a shorter sequence or a larger --val-percent"
        )
    offset = int(hash_hex(f"val:{seed}")[:8], 16) % max(1, span // num_sequences)
    starts = torch.tensor([i * span // num_sequences + offset for i in range(num_sequences)])
    return stream.windows(starts, seq_len)


# Logits of one evaluation micro-batch at most this large (fp32): a 50k vocabulary at 128 tokens
# makes 26 MB per sequence, so 16 sequences at once would hold 400 MB for a 124M model.
EVAL_LOGITS_BYTES = 64 << 20


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: torch.Tensor,
    *,
    micro_batch: int,
    parameters: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """Return the mean next-token cross-entropy (nats) of `model` over the rows of `batches`.

    `parameters` (name → tensor) are evaluated in place of the model's own, which stay untouched
    (`torch.func.functional_call`, no copy of the model). Micro-batches are cut so that their logits
    stay within `EVAL_LOGITS_BYTES`.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab and batches.ndim == 2 and batches.shape[1]:
        micro_batch = max(1, min(micro_batch, EVAL_LOGITS_BYTES // (4 * vocab * batches.shape[1])))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        if parameters is None:
            out = model(input_ids=x, labels=x)
        else:
            inputs = {"input_ids": x, "labels": x}
            out = torch.func.functional_call(model, dict(parameters), args=(), kwargs=inputs)
        loss: torch.Tensor = out.loss
        return loss

    total, count = 0.0, 0
    try:
        for chunk in torch.split(batches, micro_batch):
            x = chunk.to(device)
            total += float(loss_of(x)) * x.shape[0]
            count += x.shape[0]
    finally:
        model.train(was_training)
    return total / max(count, 1)


# ---- restoring streams -----------------------------------------------------------------------------


def restore_streams(fresh: Sequence[TokenSampler], saved: Sequence[Mapping[str, Any]]) -> list[TokenSampler]:
    """Samplers over the streams of the saved sampler states, built from a fresh node's samplers.

    After MIT merges an instance's stream is its shard followed by the shards it absorbed. We find
    which fresh streams, in which order, make up each saved one (checked against its probes and
    sha256) and concatenate them as the merges did. When they cannot be matched (the node now trains
    another data shard, or another corpus), the fresh streams are merged as a state download merges
    instances (smallest first) and a warning says so: training goes on, on other data. The fresh
    samplers are not changed (a stream of one shard is its fresh sampler itself), and the random
    positions are not restored: `load_state_dict` each sampler with its saved state for that.
    Raises ValueError for a saved state without a well-formed `stream`, or more than `fresh`.
    """
    if len(saved) > len(fresh):
        raise ValueError(f"{len(saved)} saved streams, only {len(fresh)} fresh ones")
    with malformed("sampler state"):
        infos = [_stream_info(state["stream"]) for state in saved]
    plan = _stream_plan([s.stream for s in fresh], infos)
    if plan is None:
        logger.warning(
            "checkpoint data streams do not match this node's data shards (another --data-shard or"
            " dataset?); the instances resume on this node's shards"
        )
        plan = _fallback_plan([s.num_tokens for s in fresh], len(saved))
    samplers = []
    for group in plan:
        sampler = fresh[group[0]]
        for i in group[1:]:
            sampler = sampler.merged_with(fresh[i])
        samplers.append(sampler)
    return samplers


class _StreamInfo(NamedTuple):
    tokens: int
    dtype: str
    sha256: str
    probe: torch.Tensor


def _stream_info(stream: Mapping[str, Any]) -> _StreamInfo:
    info = _StreamInfo(stream["tokens"], stream["dtype"], stream["sha256"], stream["probe"])
    tokens_ok = isinstance(info.tokens, int) and not isinstance(info.tokens, bool) and info.tokens > 0
    if not (tokens_ok and isinstance(info.dtype, str) and isinstance(info.sha256, str)):
        raise ValueError("sampler state: stream tokens, dtype or sha256 malformed")
    if not isinstance(info.probe, torch.Tensor) or info.probe.dtype != torch.int64:
        raise ValueError("sampler state: stream probe is not an int64 tensor")
    return info


def _stream_plan(streams: Sequence[TokenStream], saved: Sequence[_StreamInfo]) -> list[list[int]] | None:
    """For each saved stream, the fresh streams it is made of, in order; None if one has no match."""
    plan: list[list[int]] = []
    used: set[int] = set()
    for info in saved:
        found = _decompose(streams, info, used)
        if found is None:
            return None
        used.update(found)
        plan.append(found)
    return plan


def _decompose(streams: Sequence[TokenStream], info: _StreamInfo, used: set[int]) -> list[int] | None:
    """The unused fresh streams whose concatenation, in this order, is the saved stream; None if none."""
    positions = _probe_positions(info.tokens)
    if info.probe.shape != positions.shape:
        return None

    def search(offset: int, chosen: list[int]) -> list[int] | None:
        if offset == info.tokens:
            parts = [streams[i] for i in chosen]
            ok = parts[0].dtype == info.dtype and digest(parts) == info.sha256
            return chosen if ok else None
        for i, stream in enumerate(streams):
            end = offset + stream.num_tokens
            if i in used or i in chosen or end > info.tokens:
                continue
            lo, hi = np.searchsorted(positions, [offset, end]).tolist()
            if not np.array_equal(stream.take(positions[lo:hi] - offset), info.probe[lo:hi].numpy()):
                continue
            found = search(end, [*chosen, i])
            if found is not None:
                return found
        return None

    return search(0, [])


def _fallback_plan(tokens: Sequence[int], count: int) -> list[list[int]]:
    """Merge the two smallest streams (the smaller one absorbed) until `count` are left."""
    groups = [[k] for k in range(len(tokens))]
    while len(groups) > count:
        order = sorted(range(len(groups)), key=lambda g: (sum(tokens[k] for k in groups[g]), g))
        victim, survivor = order[0], order[1]
        groups[survivor] = groups[survivor] + groups[victim]
        del groups[victim]
    return groups


def _probe_positions(length: int) -> IntArray:
    count = min(length, _PROBES)
    return np.arange(count, dtype=np.int64) * (length - 1) // max(count - 1, 1)
