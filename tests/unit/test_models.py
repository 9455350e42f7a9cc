"""Tokenizer checks and the tiny-model factory."""

from __future__ import annotations

import pytest

from opd.schema import TinyArchConfig
from opd.models import TokenizerMismatchError, check_tokenizers_match, load_model, save_model, tiny_qwen3, train_chat_tokenizer


def test_matching_tokenizers_pass(tokenizer):
    check_tokenizers_match(tokenizer, tokenizer)


def test_a_teacher_with_another_tokenizer_is_named_precisely(tokenizer):
    other = train_chat_tokenizer(["completely different corpus about chemistry and titration"], vocab_size=280)
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizers_match(tokenizer, other)
    message = str(err.value)
    assert message.startswith("the teacher's tokenizer differs from the student's: vocabulary sizes differ: student 300, teacher 280")
    assert "tokens only the student has" in message and "same tokens with different ids" in message
    assert "Use a teacher from the student's model family" in message


def test_tiny_qwen3_is_seeded_and_round_trips_through_safetensors(tokenizer, tmp_path):
    arch = TinyArchConfig(hidden_size=64, num_layers=1, num_heads=1, intermediate_size=64)
    a, b, c = tiny_qwen3(tokenizer, arch, seed=1), tiny_qwen3(tokenizer, arch, seed=1), tiny_qwen3(tokenizer, arch, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all((sa[k] == sb[k]).all() for k in sa)
    assert any((sa[k] != sc[k]).any() for k in sa)
    assert a.config.head_dim == 64 and a.config.vocab_size == len(tokenizer)
    save_model(a, tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    # Every file of the directory is as readable as config.json (transformers wrote the weights 0600:
    # an exported model then failed to load for anyone else; issue 54, item 8).
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes
    loaded = load_model(str(tmp_path)).state_dict()
    assert all((loaded[k] == sa[k]).all() for k in sa)


def test_cpu_copy_carries_a_tied_tensor_once(tiny_model_dir):
    """The LM head tied to the embeddings is one copy under both names, so a pickle (Ray's object
    store) carries its bytes once; every value equals the model's."""
    import pickle

    import torch

    from opd.models import cpu_copy

    state = load_model(tiny_model_dir).state_dict()
    copy = cpu_copy(state)
    assert copy.keys() == state.keys() and all(torch.equal(copy[k], state[k]) for k in state)
    assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"]
    assert copy["lm_head.weight"].data_ptr() != state["lm_head.weight"].data_ptr()  # a copy, not a view
    embed_bytes = state["lm_head.weight"].numel() * 4
    separate = len(pickle.dumps({k: v.clone() for k, v in state.items()}))
    assert len(pickle.dumps(copy)) == pytest.approx(separate - embed_bytes, rel=0.01)
    restored = pickle.loads(pickle.dumps(copy))
    assert restored["lm_head.weight"] is restored["model.embed_tokens.weight"]


def test_a_tiny_qwen3_pads_its_embedding_to_arch_vocab_size(tokenizer):
    arch = TinyArchConfig(hidden_size=64, num_layers=1, num_heads=1, intermediate_size=64, vocab_size=len(tokenizer) + 100)
    model = tiny_qwen3(tokenizer, arch, seed=0)
    assert model.config.vocab_size == len(tokenizer) + 100
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) + 100
    with pytest.raises(ValueError, match="bootstrap.arch.vocab_size"):
        tiny_qwen3(tokenizer, TinyArchConfig(vocab_size=len(tokenizer) - 1), seed=0)
