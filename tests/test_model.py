"""Model building, fingerprints and evaluation (node/model.py, data.evaluate)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest
import torch

from adloco.errors import UserError
from adloco.node.data.sampling import evaluate
from adloco.node.model import model as model_module
from adloco.node.model.model import (
    DEFAULT_MODEL,
    PRESETS,
    build_model,
    count_parameters,
    model_fingerprint,
    resolve_config,
)


def _tiny_llama_dir(tmp_path: Path, *, vocab_size: int) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path)
    return tmp_path


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_default_model_size_and_seeded_init() -> None:
    model = build_model()
    assert model.config.model_type == "llama" and DEFAULT_MODEL == "tiny-llama"
    assert 500_000 < count_parameters(model) < 700_000
    assert model.dtype == torch.float32
    assert _same_weights(model, build_model(DEFAULT_MODEL, seed=0))
    assert not _same_weights(model, build_model(seed=1))


def test_init_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_preset_sizes() -> None:
    for name, lo, hi in (("small-llama", 4.0e6, 4.6e6), ("base-llama", 13e6, 15.5e6)):
        config = resolve_config(name)
        assert config.hidden_size == PRESETS[name]["hidden_size"]
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            assert lo < count_parameters(AutoModelForCausalLM.from_config(config)) < hi
    assert resolve_config(None, max_seq_len=2048).max_position_embeddings == 2048


def test_config_file_and_directory(tmp_path: Path) -> None:
    folder = _tiny_llama_dir(tmp_path, vocab_size=100)
    from_dir = build_model(str(folder), vocab_size=100, seed=3)
    from_file = build_model(str(folder / "config.json"), vocab_size=100, seed=3)
    assert from_dir.config.vocab_size == 100
    assert _same_weights(from_dir, from_file)


@pytest.mark.parametrize("tokenizer_vocab", [50, 256])
def test_a_config_file_must_state_the_tokenizers_vocabulary(tmp_path: Path, tokenizer_vocab: int) -> None:
    # Neither grown (ids past the table) nor kept larger (a wasted, probably wrong table): refused.
    folder = _tiny_llama_dir(tmp_path, vocab_size=100)
    with pytest.raises(
        UserError,
        match=rf"--model: .* has vocab_size 100, the tokenizer has {tokenizer_vocab} tokens"
        rf'.*"vocab_size": {tokenizer_vocab}',
    ):
        build_model(str(folder), vocab_size=tokenizer_vocab)


def test_presets_and_bare_types_take_the_tokenizers_vocabulary() -> None:
    assert resolve_config("tiny-llama", vocab_size=777).vocab_size == 777
    assert resolve_config("bloom", vocab_size=777).vocab_size == 777


def test_bad_config_paths(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--model: directory .* has no config\.json"):
        build_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="--model: cannot read"):
        build_model(str(tmp_path / "config.json"))


def test_bare_model_type_takes_the_library_default_with_our_vocab() -> None:
    model = build_model("bloom")  # transformers' default bloom config is tiny (hidden 64, 2 layers)
    assert model.config.model_type == "bloom" and model.config.vocab_size == 256
    assert cast(torch.nn.Embedding, model.get_input_embeddings()).weight.shape[0] == 256


def test_unknown_and_oversized_models_are_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        UserError, match=r"--model: no such file or transformers model type 'lama'.*llama, gpt2"
    ):
        build_model("lama")
    # A bare "llama" is transformers' 6.5B default; pretend this host has 1 MB rather than build it.
    monkeypatch.setattr(model_module, "_physical_memory_bytes", lambda: 1_000_000)
    with pytest.raises(UserError, match=r"--model: 'tiny-llama' \(llama\) has 1M parameters.*too large"):
        build_model("tiny-llama")


def test_fingerprint_tracks_architecture_not_values(tmp_path: Path) -> None:
    a, b = build_model(seed=0), build_model(seed=1)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert len(model_fingerprint(a)) == 64
    assert model_fingerprint(a) != model_fingerprint(build_model(vocab_size=300))
    assert model_fingerprint(a) != model_fingerprint(
        build_model(str(_tiny_llama_dir(tmp_path, vocab_size=256)))
    )
    assert model_fingerprint(a) != model_fingerprint(build_model("bloom"))


def test_fresh_model_loss_is_near_uniform() -> None:
    model = build_model()
    model.train()
    batches = torch.randint(0, 256, (10, 32), generator=torch.Generator().manual_seed(0))
    loss = evaluate(model, batches, micro_batch=4)
    assert abs(loss - math.log(256)) < 0.3
    assert model.training  # mode restored
    assert loss == pytest.approx(evaluate(model, batches, micro_batch=10), rel=1e-5)


def test_one_training_step_lowers_the_loss() -> None:
    model = build_model()
    x = torch.arange(64).repeat(4, 1) % 7
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = evaluate(model, x, micro_batch=4)
    for _ in range(5):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    assert evaluate(model, x, micro_batch=4) < before - 0.5
