"""Cross-tokenizer scoring: SmolLM2's real tokenizer (49,152 tokens, from the offline GGUF) as
the teacher's against the locally trained test tokenizer as the student's."""

from __future__ import annotations

import math

import pytest
import torch

from opd.chat import ChatFormat, render_context
from opd.schema import TinyArchConfig
from opd.generation.hf import HFEngine
from opd.models import TokenizerMismatchError, check_tokenizers_match, load_tokenizer, save_model, smollm2_tokenizer_dir, tiny_qwen3
from opd.supervision.cross_tokenizer import CrossTokenizerScorer, aligned_teacher_logprobs, token_end_offsets
from opd.supervision.teacher_view import score_trajectories, unpack_scores
from tests.unit.test_chat import ten_turn_trajectory

ARCH = TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(smollm2_tokenizer_dir())


@pytest.fixture(scope="module")
def smollm2_teacher_dir(smollm2_tokenizer, tmp_path_factory):
    """A tiny random Qwen3 over SmolLM2's vocabulary: a teacher of another tokenizer."""
    directory = tmp_path_factory.mktemp("smollm2-teacher")
    save_model(tiny_qwen3(smollm2_tokenizer, ARCH, seed=1), smollm2_tokenizer, directory)
    return str(directory)


def test_mismatch_error_says_what_differs(tokenizer, smollm2_tokenizer):
    with pytest.raises(TokenizerMismatchError) as caught:
        check_tokenizers_match(tokenizer, smollm2_tokenizer)
    message = str(caught.value)
    assert "vocabulary sizes differ: student 300, teacher 49152" in message
    assert "tokens only the teacher has" in message and "tokens only the student has" in message
    assert "same tokens with different ids: " in message  # e.g. '!' (student 5, teacher 17)
    assert "pad_token differs: student '<|endoftext|>', teacher '<|im_end|>'" in message
    assert caught.value.problems and message.endswith("(same tokenizer).")


def test_span_alignment_by_hand():
    # "go to the kitchen": student "go|_to|_the|_kitchen", teacher "go_to|_the|_kit|chen".
    student_ends, teacher_ends = [2, 5, 9, 17], [5, 9, 13, 17]
    behaviour = [-1.0, -2.0, -0.5, -3.0]
    teacher = [-1.5, -0.25, -2.0, -0.5]
    got = aligned_teacher_logprobs(student_ends, behaviour, teacher_ends, teacher, 17)
    # spans (0,5]: 2 student tokens / 1 teacher token; (5,9]: 1/1; (9,17]: 1/2
    expected = [-1.0 + (-1.5 + 3.0) / 2, -2.0 + (-1.5 + 3.0) / 2, -0.25, -2.5]
    assert got == pytest.approx(expected)
    assert sum(got) == pytest.approx(sum(teacher))  # the whole text's logprob is preserved


def test_token_end_offsets_follow_the_decoded_text(smollm2_tokenizer, tokenizer):
    for tok in (tokenizer, smollm2_tokenizer):
        ids = tok.encode("Around you: left wall, down H.<|im_end|>", add_special_tokens=False)
        text, ends = token_end_offsets(tok, ids)
        assert text == "Around you: left wall, down H.<|im_end|>"
        assert ends == sorted(ends) and ends[-1] == len(text) and len(ends) == len(ids)
        for i in range(len(ids)):
            assert tok.decode(ids[: i + 1], skip_special_tokens=False) == text[: ends[i]]


def test_translation_keeps_text_and_the_action_span(tokenizer, fmt, smollm2_tokenizer):
    traj = ten_turn_trajectory(tokenizer, fmt)
    translated, alignment = CrossTokenizerScorer(tokenizer, smollm2_tokenizer).translate(traj)
    decode_s = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    decode_t = lambda ids: smollm2_tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for turn, teacher_turn, (_, teacher_ends, length) in zip(traj.turns, translated.turns, alignment):
        assert decode_t(teacher_turn.prompt_ids) == decode_s(turn.prompt_ids)
        assert decode_t(teacher_turn.response_ids) == decode_s(turn.response_ids)
        assert decode_t(teacher_turn.action_ids) == decode_s(turn.action_ids)
        assert decode_s(turn.action_ids).strip() == turn.action_text
        assert teacher_turn.response_ids[-1] == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert len(teacher_ends) == len(teacher_turn.response_ids) and teacher_ends[-1] == length
    assert max(max(t.response_ids) for t in translated.turns) >= 300, "ids of the teacher's vocabulary, not the student's"


@pytest.mark.parametrize("view", ["state_grounded", "full"])
def test_cross_scores_sum_to_the_teachers_logprob_of_each_response(tokenizer, fmt, smollm2_tokenizer, smollm2_teacher_dir, view):
    """Per turn, the aligned per-token scores add up to the teacher's logprob of the response
    text, computed by an ordinary forward (no packing) on the teacher-token context."""
    traj = ten_turn_trajectory(tokenizer, fmt)
    engine = HFEngine.from_pretrained(smollm2_teacher_dir)
    scorer = CrossTokenizerScorer(tokenizer, smollm2_tokenizer)
    flat = scorer.score(engine, [traj], view)[0].logprobs
    assert len(flat) == traj.num_response_tokens and all(math.isfinite(x) for x in flat)
    translated, _ = scorer.translate(traj)
    teacher_fmt = ChatFormat.from_tokenizer(smollm2_tokenizer)
    per_turn = unpack_scores(traj, flat)
    for t, turn in enumerate(translated.turns):
        context = render_context(translated, t, view, teacher_fmt)
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(torch.tensor([context + turn.response_ids])).logits[0].float(), -1)
        n = len(context)
        reference = sum(logp[n - 1 + k, tok].item() for k, tok in enumerate(turn.response_ids))
        assert sum(per_turn[t]) == pytest.approx(reference, abs=1e-3)


def test_cross_scoring_with_the_same_tokenizer_is_plain_scoring(tokenizer, fmt, tiny_model_dir):
    """Where both tokenisations agree every span is one token: the plain per-token scores."""
    traj = ten_turn_trajectory(tokenizer, fmt)
    engine = HFEngine.from_pretrained(tiny_model_dir)
    cross = CrossTokenizerScorer(tokenizer, tokenizer).score(engine, [traj], "state_grounded")[0].logprobs
    plain = score_trajectories(engine, [traj], "state_grounded", fmt)[0].logprobs
    assert cross == pytest.approx(plain, abs=1e-4)
