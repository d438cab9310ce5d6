"""Sampling the corpus: per-peer shards, the token streams instances train on, validation windows.

`shard_corpus` deals the training documents into disjoint (peer, instance) shards from sorted hashes,
a `TokenSampler` draws seeded random windows from one shard's token stream (an MIT merge
concatenates two streams), `validation_batches` cuts fixed, evenly spaced windows every peer
evaluates on identically, and `evaluate` measures a model's loss on them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from ...errors import UserError
from .corpus import Corpus, Document, hash_hex


class TokenSampler:
    """Random windows of `seq_len` tokens from the concatenation of a shard's documents.

    Windows are drawn uniformly (with replacement) from a `torch.Generator` seeded with `seed`, so
    the batches depend only on the documents, the seed and the sequence of calls. The model uses
    `labels=input_ids` and shifts internally.
    """

    def __init__(self, docs: Sequence[torch.Tensor], *, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise UserError(f"--seq-len: must be positive, got {seq_len}")
        self.stream = torch.cat([d.reshape(-1) for d in docs]) if docs else torch.empty(0, dtype=torch.int64)
        self.seq_len = seq_len
        if self.stream.numel() < seq_len:
            raise UserError(
                f"--seq-len: {seq_len} is larger than the data: this shard has {self.stream.numel()} tokens; "
                "use a shorter sequence, fewer peers or instances, or a larger dataset"
            )
        self._offsets = torch.arange(seq_len)
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        """Tokens in the shard."""
        return int(self.stream.numel())

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Return a (batch_size, seq_len) int64 tensor of windows."""
        high = self.stream.numel() - self.seq_len + 1
        starts = torch.randint(0, high, (batch_size,), generator=self._generator)
        return self.stream[starts[:, None] + self._offsets].long()

    def merged_with(self, other: TokenSampler) -> TokenSampler:
        """Return a sampler over both shards that continues this one's random stream.

        Used when two MIT instances merge: the survivor takes over the victim's data.
        """
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot merge samplers of seq_len {self.seq_len} and {other.seq_len}")
        merged = TokenSampler([self.stream, other.stream], seq_len=self.seq_len, seed=0)
        merged.set_state(self.get_state())
        return merged

    def get_state(self) -> torch.Tensor:
        """Return the generator state, for checkpoints."""
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Restore a state from `get_state`."""
        self._generator.set_state(state)


def shard_corpus(
    corpus: Corpus,
    *,
    peer_index: int,
    num_peers: int,
    instance_index: int,
    num_instances: int,
    non_iid: bool = False,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Return the token tensors of one (peer, instance) shard of the training documents.

    The num_peers × num_instances shards are disjoint and together cover the training set. IID:
    documents in seed-dependent hash order are dealt to the least-loaded shard. Non-IID: whole
    groups (top-level packages), largest first, go to the least-loaded peer, so each peer sees
    different packages; a peer's documents are then dealt IID among its instances. With fewer
    documents than shards, the token stream is cut into contiguous pieces instead.
    """
    if not (0 <= peer_index < num_peers and 0 <= instance_index < num_instances):
        raise ValueError(
            f"shard ({peer_index}, {instance_index}) outside {num_peers} peers x {num_instances} instances"
        )
    docs = corpus.train_docs
    if non_iid:
        peer_docs = _non_iid_peer_docs(docs, peer_index=peer_index, num_peers=num_peers)
        if peer_docs is None:
            return _contiguous_piece(
                docs, peer_index * num_instances + instance_index, num_peers * num_instances
            )
        return _iid_shard(peer_docs, index=instance_index, count=num_instances, seed=seed)
    return _iid_shard(
        docs, index=peer_index * num_instances + instance_index, count=num_peers * num_instances, seed=seed
    )


def _iid_shard(docs: Sequence[Document], *, index: int, count: int, seed: int) -> list[torch.Tensor]:
    if len(docs) < count:
        return _contiguous_piece(docs, index, count)
    order = sorted(range(len(docs)), key=lambda i: hash_hex(f"{seed}:{docs[i].name}"))
    bins = _deal_least_loaded([int(docs[i].tokens.numel()) for i in order], count)
    return [docs[order[j]].tokens for j in sorted(bins[index])]


def _non_iid_peer_docs(docs: Sequence[Document], *, peer_index: int, num_peers: int) -> list[Document] | None:
    """The documents of this peer's groups; documents stand in for groups when groups are too few."""
    if len(docs) < num_peers:
        return None
    by_group: dict[str, list[Document]] = {}
    for doc in docs:
        by_group.setdefault(doc.group, []).append(doc)
    if len(by_group) < num_peers:
        by_group = {doc.name: [doc] for doc in docs}
    sizes = {g: sum(int(d.tokens.numel()) for d in ds) for g, ds in by_group.items()}
    names = sorted(by_group, key=lambda g: (-sizes[g], g))
    bins = _deal_least_loaded([sizes[g] for g in names], num_peers)
    return [doc for j in sorted(bins[peer_index], key=lambda j: names[j]) for doc in by_group[names[j]]]


def _deal_least_loaded(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Give each item, in order, to the bin with the fewest tokens so far (ties: lowest bin)."""
    heap = [(0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for item, size in enumerate(sizes):
        load, b = heapq.heappop(heap)
        bins[b].append(item)
        heapq.heappush(heap, (load + max(size, 1), b))
    return bins


def _contiguous_piece(docs: Sequence[Document], index: int, count: int) -> list[torch.Tensor]:
    stream = torch.cat([d.tokens for d in docs]) if docs else torch.empty(0, dtype=torch.int64)
    n = stream.numel()
    return [stream[index * n // count : (index + 1) * n // count]]


def validation_batches(corpus: Corpus, *, seq_len: int, num_sequences: int, seed: int = 0) -> torch.Tensor:
    """Return fixed (num_sequences, seq_len) int64 windows of the validation documents.

    Windows are evenly spaced over the concatenated validation set, shifted by an offset derived
    from `seed` with integer arithmetic only, so every peer evaluates on identical tokens.
    """
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    if not corpus.val_docs:
        raise UserError("--val-percent: the corpus has no validation documents; use a value above 0")
    stream = torch.cat([d.tokens for d in corpus.val_docs])
    span = stream.numel() - seq_len + 1
    if span <= 0:
        raise UserError(
            f"--seq-len: {seq_len} is larger than the validation set ({stream.numel()} tokens); "
            "use a shorter sequence or a larger --val-percent"
        )
    offset = int(hash_hex(f"val:{seed}")[:8], 16) % max(1, span // num_sequences)
    starts = torch.tensor([i * span // num_sequences + offset for i in range(num_sequences)])
    return stream[starts[:, None] + torch.arange(seq_len)].long()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: torch.Tensor, *, micro_batch: int) -> float:
    """Return the mean next-token cross-entropy (nats) of `model` over the rows of `batches`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for chunk in torch.split(batches, micro_batch):
            x = chunk.to(device)
            total += float(model(input_ids=x, labels=x).loss) * x.shape[0]
            count += x.shape[0]
    finally:
        model.train(was_training)
    return total / max(count, 1)
