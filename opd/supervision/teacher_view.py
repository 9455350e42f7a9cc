"""Build the teacher's view of every turn of a trajectory and score the student's responses.

Turn t's response ``y_t`` is scored under ``render_context(traj, t, view)``. Those contexts
extend one another, so all turns of a trajectory are packed into one sequence:

    trunk:   prompt_0 | shown_0 close_0 | prompt_1 | shown_1 close_1 | ... | prompt_{T-1}
    branch t:          y_t, placed right after prompt_t, visible only to itself

where ``shown_k`` is ``y_k`` in the ``full`` view and the executed action ``a_k`` in the
``state_grounded`` view. When ``y_t`` equals ``shown_t`` (the ``full`` view, or a response
with no reasoning) the response is scored straight off the trunk and needs no branch. One
forward then yields every turn's teacher logprobs: the cost is one pass over the trunk plus the
responses, instead of T passes over ever longer contexts.

The scores come back to the trainer on the student's own rows: :func:`with_teacher_scores`
places them on the tokens they grade, whatever the rows' layout.

Example:
    >>> request = pack_trajectory(traj, "state_grounded", fmt)  # doctest: +SKIP
    >>> per_turn = unpack_scores(traj, engine.score([request])[0].logprobs)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import replace

import torch

from opd.chat import ChatFormat, render_context
from opd.generation.base import ScoreRequest, TokenScores
from opd.trajectory import HeadRows, TokenBatch, TokenRows, Trajectory


def pack_trajectory(traj: Trajectory, view: str, fmt: ChatFormat) -> ScoreRequest:
    """One packed :class:`ScoreRequest` that scores every response of ``traj`` in ``view``."""
    ids: list[int] = []
    pos: list[int] = []
    branch: list[int] = []
    target: list[int] = []
    source: list[int] = []
    trunk_len = 0  # position of the next trunk token

    def extend(tokens: list[int], branch_id: int, start_pos: int) -> int:
        ids.extend(tokens)
        pos.extend(range(start_pos, start_pos + len(tokens)))
        branch.extend([branch_id] * len(tokens))
        return start_pos + len(tokens)

    for t, turn in enumerate(traj.turns):
        trunk_len = extend(turn.prompt_ids, 0, trunk_len)
        shown, closing = fmt.shown_and_close_ids(turn, view)
        last = t + 1 == len(traj.turns)
        on_trunk = shown == turn.response_ids
        if on_trunk:
            first = len(ids)
            trunk_len = extend(turn.response_ids, 0, trunk_len)
        else:
            first = len(ids)
            extend(turn.response_ids, t + 1, trunk_len)
        for k in range(len(turn.response_ids)):
            target.append(first + k)
            # The first response token is predicted by the last prompt token, which sits just
            # before the response in the packed order whether the response is a branch or not.
            source.append(first + k - 1)
        if last:
            break
        trunk_len = extend(([] if on_trunk else shown) + closing, 0, trunk_len)
    return ScoreRequest(ids, pos, branch, target, source)


def packed_row(traj: Trajectory, fmt: ChatFormat, view: str = "state_grounded") -> tuple[dict[str, list], list[int]]:
    """``traj`` packed in ``view`` as a training row for :meth:`TokenBatch.from_rows`, with
    ``turn_index`` t on the tokens of each response ``y_t`` and ``loss_mask`` 1.0 there where the
    turn is trained (:attr:`Turn.trained`); also returns those tokens' indices in the row, turns
    in order (where per-token values go)."""
    packed = pack_trajectory(traj, view, fmt)
    n = len(packed.input_ids)
    row = {"input_ids": packed.input_ids, "attention_mask": [1] * n, "loss_mask": [0.0] * n,
           "behaviour_logprobs": [0.0] * n, "turn_index": [-1] * n,
           "position_ids": packed.position_ids, "branch_ids": packed.branch_ids}
    turn_of = [t for t, turn in enumerate(traj.turns) for _ in turn.response_ids]
    for t, i in zip(turn_of, packed.target_index):
        row["loss_mask"][i] = float(traj.turns[t].trained)
        row["turn_index"][i] = t
    return row, packed.target_index


def naive_requests(traj: Trajectory, view: str, fmt: ChatFormat) -> list[ScoreRequest]:
    """One unpacked request per turn: the reference that packing must reproduce (and the
    baseline of the prefix-sharing benchmark)."""
    requests = []
    for t, turn in enumerate(traj.turns):
        context = render_context(traj, t, view, fmt)
        ids = context + turn.response_ids
        n = len(ids)
        targets = list(range(len(context), n))
        requests.append(ScoreRequest(ids, list(range(n)), [0] * n, targets, [i - 1 for i in targets]))
    return requests


def unpack_scores(traj: Trajectory, flat: list[float]) -> list[list[float]]:
    """Split a packed request's flat logprobs back into one list per turn."""
    out, i = [], 0
    for turn in traj.turns:
        out.append(flat[i : i + len(turn.response_ids)])
        i += len(turn.response_ids)
    return out


def score_trajectories(engine, trajs: list[Trajectory], view: str, fmt: ChatFormat, batch_size: int = 16,
                       mode: str = "sampled", top_k: int = 0, batch_tokens: int = 0) -> list[TokenScores]:
    """The teacher's scores of every response token of each trajectory, turns in order
    (``TokenScores.logprobs`` has ``traj.num_response_tokens`` entries)."""
    requests = [pack_trajectory(traj, view, fmt) for traj in trajs]
    return engine.score(requests, batch_size=batch_size, mode=mode, top_k=top_k, batch_tokens=batch_tokens) if requests else []


def with_teacher_scores(batch: TokenBatch, positions: list[list[int]], scores: list[TokenScores]) -> TokenBatch:
    """``batch`` with the teacher's scores of row ``b`` on its tokens ``positions[b]`` (the k-th
    score on the k-th position): ``teacher_logprobs_BT`` always, and, where the scores carry them,
    ``topk``'s ids, logprobs and tail mass (``-inf`` / 0 elsewhere) and ``full``'s distribution
    (as :class:`~opd.trajectory.TokenRows`, ``[N, V]`` at those tokens), or ``hidden``'s final
    hidden states in its place (as :class:`~opd.trajectory.HeadRows` without their head).

    Shapes: ``positions[b]`` has ``len(scores[b].logprobs)`` entries, indices into ``[0, T)``.
    """
    B, T = batch.input_ids_BT.shape
    teacher_BT = batch.teacher_logprobs_BT.clone()
    for b, (index, score) in enumerate(zip(positions, scores)):
        teacher_BT[b, index] = torch.tensor(score.logprobs)
    fields: dict = {"teacher_logprobs_BT": teacher_BT}
    if scores and scores[0].topk_ids is not None:
        K = scores[0].topk_ids.shape[1]
        ids_BTK = torch.zeros(B, T, K, dtype=torch.long)
        logp_BTK = torch.full((B, T, K), float("-inf"))
        tail_BT = torch.zeros(B, T)
        for b, (index, score) in enumerate(zip(positions, scores)):
            ids_BTK[b, index] = score.topk_ids
            logp_BTK[b, index] = score.topk_logprobs
            tail_BT[b, index] = score.tail_logprob
        fields.update(teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK, teacher_tail_logprob_BT=tail_BT)
    if scores and scores[0].full_logprobs is not None:
        # [N, V] rows at the scored tokens only (TokenRows), in row-major order.
        mask_BT = torch.zeros(B, T, dtype=torch.bool)
        rows = []
        for b, (index, score) in enumerate(zip(positions, scores)):
            mask_BT[b, index] = True
            rows.append(_in_token_order(score.full_logprobs, index))
        if int(mask_BT.sum()) != sum(len(index) for index in positions):
            raise ValueError("with_teacher_scores: a row's positions repeat a token")
        fields["teacher_full_logprobs_NV"] = TokenRows(mask_BT, torch.cat(rows))
    if scores and scores[0].hidden is not None:
        # scoring: hidden: the same rows as the final hidden states, [N, H]; the trainer holds the head.
        mask_BT = torch.zeros(B, T, dtype=torch.bool)
        rows = []
        for b, (index, score) in enumerate(zip(positions, scores)):
            mask_BT[b, index] = True
            rows.append(_in_token_order(score.hidden, index))
        fields["teacher_full_logprobs_NV"] = HeadRows(TokenRows(mask_BT, torch.cat(rows)))
    return replace(batch, **fields)


def _in_token_order(rows_N: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``rows_N`` (one per position of ``index``) in the order of their positions; the rows
    themselves (no copy) when they already are, as a trajectory's scores usually are."""
    if all(a < b for a, b in zip(index, index[1:])):
        return rows_N
    return rows_N[sorted(range(len(index)), key=index.__getitem__)]

