"""Sampled scoring by a teacher whose tokenizer differs from the student's.

The student's token ids mean nothing to such a teacher, so each trajectory is carried over as
text and the scores are carried back over aligned text spans:

1. **Translate.** Every prompt is decoded with the student's tokenizer (markup included) and
   encoded with the teacher's. A response is encoded in three pieces, the text before the
   executed action, the action and the text after it, so the action is a whole span in both
   tokenisations and the ``state_grounded`` view shows the teacher exactly the action.
2. **Score** the translated trajectory with the usual packed, prefix-shared forward.
3. **Align.** The character offsets of both tokenisations of a response split it into
   *spans*: the stretches between the boundaries both tokenisations share. The teacher's
   logprob of a span is the sum over its teacher tokens (the chain rule), and the student's
   the sum over its own tokens. Each student token ``i`` of span ``g`` (``n_g`` tokens) gets

       teacher_i = behaviour_i + (T_g - B_g) / n_g,

   so that the teacher logprobs of a span sum to ``T_g``: the sampled reverse-KL advantage
   ``teacher_i - behaviour_i`` is the span's log-ratio shared equally by its tokens. Where both
   tokenisations agree (most whole words), a span is one token and this is the plain per-token
   score.

Departure: the student's text is re-tokenised, so the teacher scores the text, not the exact
ids; two tokenisations of one text are treated as one event.

Example:
    >>> scorer = CrossTokenizerScorer(student_tokenizer, teacher_tokenizer)  # doctest: +SKIP
    >>> scores = scorer.score(engine, trajs, "state_grounded", batch_size=16)  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from opd.chat import ChatFormat
from opd.generation.base import TokenScores
from opd.supervision.teacher_view import score_trajectories, unpack_scores
from opd.trajectory import Trajectory


def token_end_offsets(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The decoded text of ``ids`` and the character offset at which each token ends.

    Decoding grows one token at a time; a token whose bytes do not complete a character yet
    (a split UTF-8 sequence decodes to U+FFFD) shares the end of the token that completes it.
    """
    ends: list[int] = []
    pending = 0
    previous = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        stable = text.startswith(previous) and not text.endswith("\ufffd")
        pending += 1
        if stable or i + 1 == len(ids):
            ends += [len(text)] * pending
            pending, previous = 0, text
    return previous, ends


def _encode_with_ends(tokenizer, text: str, offset: int) -> tuple[list[int], list[int]]:
    if not text:
        return [], []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [offset + end for _, end in enc["offset_mapping"]]


def span_index(ends: list[int], bounds: list[int]) -> list[int]:
    """For each token end offset, the span ``(bounds[g], bounds[g + 1]]`` holding it."""
    return [max(0, bisect.bisect_left(bounds, end) - 1) for end in ends]


def aligned_teacher_logprobs(student_ends: list[int], behaviour: list[float], teacher_ends: list[int],
                             teacher: list[float], length: int) -> list[float]:
    """Per student token, the teacher logprob under the span rule of the module docstring.

    Args:
        student_ends, teacher_ends: character offset where each token ends (same text).
        behaviour: the student's logprob of each of its tokens; ``teacher`` the teacher's of its own.
        length: length of the text.
    """
    bounds = sorted(({0, length} | set(student_ends)) & ({0, length} | set(teacher_ends)))
    n_spans = max(1, len(bounds) - 1)
    teacher_sum = [0.0] * n_spans
    behaviour_sum = [0.0] * n_spans
    count = [0] * n_spans
    student_span = span_index(student_ends, bounds)
    for g, lp in zip(span_index(teacher_ends, bounds), teacher):
        teacher_sum[min(g, n_spans - 1)] += lp
    for g, lp in zip(student_span, behaviour):
        behaviour_sum[g] += lp
        count[g] += 1
    return [lp + (teacher_sum[g] - behaviour_sum[g]) / count[g] for g, lp in zip(student_span, behaviour)]


class CrossTokenizerScorer:
    """Scores student trajectories with a teacher of another tokenizer (see the module docstring)."""

    def __init__(self, student_tokenizer, teacher_tokenizer):
        self.student_tok = student_tokenizer
        self.teacher_tok = teacher_tokenizer
        self.teacher_fmt = ChatFormat.from_tokenizer(teacher_tokenizer)

    def _text_to_teacher(self, ids: list[int]) -> list[int]:
        text = self.student_tok.decode(ids, skip_special_tokens=False)
        return self.teacher_tok.encode(text, add_special_tokens=False)

    def translate(self, traj: Trajectory) -> tuple[Trajectory, list[tuple[list[int], list[int], int]]]:
        """The trajectory in teacher ids, and per turn (student ends, teacher ends, text length)."""
        turns, alignment = [], []
        for turn in traj.turns:
            text, student_ends = token_end_offsets(self.student_tok, turn.response_ids)
            cut_start = student_ends[turn.action_start - 1] if turn.action_start > 0 else 0
            cut_end = student_ends[turn.action_end - 1] if turn.action_end > 0 else 0
            ids: list[int] = []
            teacher_ends: list[int] = []
            bounds = []
            for piece_start, piece_end in ((0, cut_start), (cut_start, cut_end), (cut_end, len(text))):
                piece_ids, piece_ends = _encode_with_ends(self.teacher_tok, text[piece_start:piece_end], piece_start)
                ids += piece_ids
                teacher_ends += piece_ends
                bounds.append(len(ids))
            turns.append(replace(
                turn,
                prompt_ids=self._text_to_teacher(turn.prompt_ids),
                response_ids=ids,
                response_logprobs=[0.0] * len(ids),
                action_start=bounds[0],
                action_end=bounds[1],
            ))
            alignment.append((student_ends, teacher_ends, len(text)))
        return replace(traj, turns=turns), alignment

    def score(self, engine, trajs: list[Trajectory], view: str, batch_size: int = 16,
              batch_tokens: int = 0) -> list[TokenScores]:
        """Teacher logprobs of every student response token, as :func:`score_trajectories` gives
        for a teacher that shares the tokenizer."""
        translated = [self.translate(traj) for traj in trajs]
        raw = score_trajectories(engine, [t for t, _ in translated], view, self.teacher_fmt, batch_size,
                                 batch_tokens=batch_tokens)
        out = []
        for traj, (teacher_traj, alignment), scores in zip(trajs, translated, raw):
            flat: list[float] = []
            per_turn = unpack_scores(teacher_traj, scores.logprobs)
            for turn, (student_ends, teacher_ends, length), teacher_lp in zip(traj.turns, alignment, per_turn):
                flat += aligned_teacher_logprobs(student_ends, list(turn.response_logprobs), teacher_ends, teacher_lp, length)
            out.append(TokenScores(flat))
        return out
