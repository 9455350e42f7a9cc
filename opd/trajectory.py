"""The data that flows: :class:`Turn`, :class:`Trajectory` and :class:`TokenBatch`.

Turns hold token ids exactly as sampled. A context is rebuilt by concatenating ids (see
:mod:`opd.chat`), never by decoding and re-encoding text, so no token drift occurs across turns.

Example:
    >>> turn = Turn(prompt_ids=[1, 2], response_ids=[7, 3], response_logprobs=[-0.1, -0.2],
    ...             action_start=0, action_end=1, action_text="up")
    >>> turn.action_ids
    [7]
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass
class Turn:
    """One student turn.

    Attributes:
        prompt_ids: tokens appended to the context just before this turn's response: at turn 0
            the system and task messages, later the observation message; both end with the
            assistant header that opens the response.
        response_ids: the sampled response, exactly as generated (ends with the end-of-message
            token unless the token budget ran out).
        response_logprobs: the behaviour policy's logprob of each response token.
        action_start, action_end: ``response_ids[action_start:action_end]`` is the action the
            environment executed (the response without reasoning and end token).
        action_text: the decoded action sent to the environment.
        observation: the environment's answer to the action (text).
        reward, terminated, truncated: from ``env.step``.
        info: the JSON-safe subset of the step's info (success, valid_action, expert_action...).
        executed_action_ids: set when the executed action was not sampled inside this response
            (ActFirst: a fast action-only turn acted, the full response was generated after);
            then :attr:`action_ids` is these ids, and the state-grounded view shows them.
        trained: whether this turn's response carries loss; a turn outside a depth
            curriculum's window (:mod:`opd.curriculum`) is context only, as the student played it.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    action_start: int = 0
    action_end: int = 0
    action_text: str = ""
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    executed_action_ids: list[int] | None = None
    trained: bool = True

    @property
    def action_ids(self) -> list[int]:
        """The ids of the executed action (a span of the response unless set apart)."""
        if self.executed_action_ids is not None:
            return self.executed_action_ids
        return self.response_ids[self.action_start : self.action_end]


@dataclass
class Trajectory:
    """One multi-turn episode of the student in one task.

    Attributes:
        task: the task id (from the environment's split).
        turns: the turns in order.
        success: the environment's success flag at the end.
        end_reason: ``success``, ``failure`` (terminated unsuccessfully), ``truncated`` (turn
            budget), ``context_limit``, ``depth_limit`` (a forward depth curriculum's horizon,
            :mod:`opd.curriculum`) or ``env_error`` (the environment raised; see ``error``).
        error: the exception text when ``end_reason == "env_error"``.
        initial_info: the JSON-safe subset of ``env.reset``'s info (e.g. the expert's action in
            the first state: turn ``t``'s state has ``turns[t - 1].info``, turn 0's has this).
        initial_observation: ``env.reset``'s observation (the task), as text.
    """

    task: str
    turns: list[Turn] = field(default_factory=list)
    success: bool = False
    end_reason: str = ""
    error: str = ""
    initial_info: dict[str, Any] = field(default_factory=dict)
    initial_observation: str = ""

    def state_infos(self) -> list[dict[str, Any]]:
        """The info of the state each turn acted in: ``[initial_info, turns[0].info, ...]``."""
        return [self.initial_info, *(t.info for t in self.turns[:-1])][: len(self.turns)]

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)


@dataclass
class TokenRows:
    """One ``[V]`` row of values for each of some tokens of a ``[B, T]`` batch: ``values_NV[n]``
    belongs to the ``n``-th True entry of ``mask_BT`` in row-major order (row by row, left to
    right). A distribution over the vocabulary is needed only where a loss trains, so the exact
    estimators keep ``[N, V]`` at those ``N`` tokens instead of ``[B, T, V]`` at every position
    (on a single-turn batch of 32 rows at a 49k vocabulary: 82 positions of about 900, 16 MB in
    place of 176 MB).

    Attributes:
        mask_BT: bool, the tokens that hold a row.
        values_NV: ``[N, V]`` with ``N = mask_BT.sum()``; may carry gradient.
        fill: the value of every entry at the tokens that hold no row (see :meth:`dense`).

    Example:
        >>> rows = TokenRows(torch.tensor([[False, True, True]]), torch.tensor([[0.1, 0.9], [0.5, 0.5]]))
        >>> rows.at(torch.tensor([[False, False, True]])).tolist()
        [[0.5, 0.5]]
        >>> rows.dense()[0, 0].tolist()
        [0.0, 0.0]
    """

    mask_BT: torch.Tensor
    values_NV: torch.Tensor
    fill: float = 0.0

    def __post_init__(self) -> None:
        self.mask_BT = self.mask_BT.bool()
        if self.mask_BT.dim() != 2 or int(self.mask_BT.sum()) != self.values_NV.shape[0]:
            raise ValueError(f"TokenRows: {tuple(self.values_NV.shape)} values for a mask of shape "
                             f"{tuple(self.mask_BT.shape)} with {int(self.mask_BT.sum())} tokens set")

    @staticmethod
    def from_dense(values_BTV: torch.Tensor, mask_BT: torch.Tensor | None = None, fill: float = 0.0) -> "TokenRows":
        """The rows of ``values_BTV`` at ``mask_BT`` (default every position: no copy)."""
        if mask_BT is None:
            mask_BT = torch.ones(values_BTV.shape[:2], dtype=torch.bool, device=values_BTV.device)
            return TokenRows(mask_BT, values_BTV.reshape(-1, values_BTV.shape[-1]), fill)
        return TokenRows(mask_BT, values_BTV[mask_BT.bool()], fill)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, T, V)`` of the dense tensor these rows stand for."""
        return (*self.mask_BT.shape, self.values_NV.shape[-1])

    def dense(self) -> torch.Tensor:
        """``[B, T, V]``: the rows at their tokens, :attr:`fill` elsewhere (with the values' gradient)."""
        if bool(self.mask_BT.all()):
            return self.values_NV.reshape(self.shape)
        out = self.values_NV.new_full(self.shape, self.fill)
        return out.index_put(tuple(self.mask_BT.nonzero().T), self.values_NV)

    def index_of(self, mask_BT: torch.Tensor) -> torch.Tensor:
        """``[M]`` int64: for each of the ``M`` True entries of ``mask_BT`` (same ``[B, T]``, in
        row-major order), the index of its row in :attr:`values_NV`, -1 where it holds none."""
        index_BT = torch.full(self.mask_BT.shape, -1, dtype=torch.long, device=self.mask_BT.device)
        index_BT[self.mask_BT] = torch.arange(int(self.mask_BT.sum()), device=self.mask_BT.device)
        return index_BT[mask_BT.bool().to(self.mask_BT.device)]

    def at(self, mask_BT: torch.Tensor, part: slice | None = None) -> torch.Tensor:
        """``[M, V]``: the rows of the ``M`` True entries of ``mask_BT`` (same ``[B, T]``), in
        row-major order; a token that holds no row gets :attr:`fill`. With ``part``, only those
        of the ``M`` rows (a chunk)."""
        mask_BT = mask_BT.bool().to(self.mask_BT.device)
        if torch.equal(mask_BT, self.mask_BT):
            return self.values_NV if part is None else self.values_NV[part]
        index_M = self.index_of(mask_BT)
        if part is not None:
            index_M = index_M[part]
        held_M1 = (index_M >= 0)[:, None]
        picked_MV = self.values_NV[index_M.clamp(min=0)] if self.values_NV.shape[0] else \
            self.values_NV.new_zeros(index_M.shape[0], self.values_NV.shape[-1])
        return picked_MV if bool(held_M1.all()) else torch.where(held_M1, picked_MV, self.fill)

    def select_rows(self, index: torch.Tensor) -> "TokenRows":
        """The batch rows ``index`` (int64), in that order."""
        index = index.to(self.mask_BT.device)
        counts_B = self.mask_BT.sum(1)
        starts_B = counts_B.cumsum(0) - counts_B
        picked_counts = counts_B[index]
        total = int(picked_counts.sum())
        # For each kept value: its row's start, plus its offset within the row.
        first_N = torch.repeat_interleave(starts_B[index], picked_counts, output_size=total)
        begin_N = torch.repeat_interleave(picked_counts.cumsum(0) - picked_counts, picked_counts, output_size=total)
        offset_N = torch.arange(total, device=index.device) - begin_N
        return TokenRows(self.mask_BT[index], self.values_NV[(first_N + offset_N).to(self.values_NV.device)], self.fill)

    def narrow(self, width: int) -> "TokenRows":
        """The first ``width`` positions of every row (rows held beyond them are dropped)."""
        if not bool(self.mask_BT[:, width:].any()):
            return TokenRows(self.mask_BT[:, :width], self.values_NV, self.fill)
        keep_N = self.mask_BT.nonzero()[:, 1] < width
        return TokenRows(self.mask_BT[:, :width], self.values_NV[keep_N.to(self.values_NV.device)], self.fill)

    def to(self, device) -> "TokenRows":
        return TokenRows(self.mask_BT.to(device), self.values_NV.to(device), self.fill)

    @staticmethod
    def concat(parts: list["TokenRows | None"], rows: list[int], width: int) -> "TokenRows":
        """The batch rows of ``parts`` in order, masks right-padded to ``width``; a ``None`` part
        (a batch without these values) holds no rows for its ``rows[i]`` batch rows."""
        template = next(p for p in parts if p is not None)
        masks, values = [], []
        for part, n in zip(parts, rows):
            mask_BT = torch.zeros(n, width, dtype=torch.bool)
            if part is not None:
                mask_BT[:, : part.mask_BT.shape[1]] = part.mask_BT.cpu()
                values.append(part.values_NV)
            masks.append(mask_BT)
        return TokenRows(torch.cat(masks), torch.cat(values), template.fill)


@dataclass
class LinearHead:
    """An output head as a plain linear map, ``hidden @ weight.T + bias`` (``weight`` ``[V, H]``),
    applied in the weight's dtype and answered in float32: how a teacher's head travels once
    per run for ``scoring: hidden`` (:class:`HeadRows`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, hidden_MH: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(hidden_MH.device)
        bias = None if self.bias is None else self.bias.to(hidden_MH.device)
        return torch.nn.functional.linear(hidden_MH.to(weight.dtype), weight, bias).float()

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])


@dataclass
class HeadRows:
    """A log-softmax over the vocabulary at some tokens, kept as the final hidden states there
    (``[N, H]``, :class:`TokenRows`) and an output head, and computed only when read:
    ``log_softmax(head(hidden) / temperature)``. It answers as :class:`TokenRows` does (``at``,
    ``dense``, ``values_NV``...), so a loss reads either alike; the built-in divergences read it a
    chunk of ``chunk_rows`` rows at a time (:func:`opd.losses.divergence_per_token`), so the
    ``[N, V]`` rows are never all held at once.

    The student's rows in the trainer are these (with gradient through ``hidden`` and the head),
    and so are the teacher's under ``scoring: hidden``: its hidden states travel in the batch
    (``head`` is ``None`` there) and the trainer, which received the teacher's head once,
    attaches it (:meth:`with_head`).

    Attributes:
        hidden: ``[N, H]`` rows at the tokens of ``hidden.mask_BT``.
        head: ``[M, H] -> [M, V]`` float32 logits; ``None`` until attached.
        temperature: the logits are divided by it before the log-softmax.
        chunk_rows: rows computed at once by chunked readers (0: all).
        vocab_size: ``V`` (the head's outputs).
    """

    hidden: TokenRows
    head: Any = None
    temperature: float = 1.0
    chunk_rows: int = 0
    vocab_size: int = 0
    fill: float = 0.0

    @property
    def mask_BT(self) -> torch.Tensor:
        return self.hidden.mask_BT

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.mask_BT.shape, self.vocab_size)

    def with_head(self, head, chunk_rows: int | None = None) -> "HeadRows":
        return replace(self, head=head, chunk_rows=self.chunk_rows if chunk_rows is None else chunk_rows)

    def rows(self, index_M: torch.Tensor | slice) -> torch.Tensor:
        """``[M, V]`` float32: the log-softmax at rows ``index_M`` of :attr:`hidden`."""
        if self.head is None:
            raise ValueError("these rows hold hidden states without their output head (scoring: hidden): the "
                             "trainer attaches the teacher's head (HeadRows.with_head) before a loss reads them")
        logits_MV = self.head(self.hidden.values_NV[index_M])
        return torch.log_softmax(logits_MV.float() / self.temperature, dim=-1)

    @property
    def values_NV(self) -> torch.Tensor:
        """All ``[N, V]`` rows at once (what a loss that reads them whole pays)."""
        return self.rows(slice(None))

    def index_of(self, mask_BT: torch.Tensor) -> torch.Tensor:
        return self.hidden.index_of(mask_BT)

    def at(self, mask_BT: torch.Tensor, part: slice | None = None) -> torch.Tensor:
        """As :meth:`TokenRows.at`, computing only the rows asked for."""
        index_M = self.index_of(mask_BT)
        if part is not None:
            index_M = index_M[part]
        held_M1 = (index_M >= 0)[:, None]
        picked_MV = self.rows(index_M.clamp(min=0)) if int(self.mask_BT.sum()) else \
            self.hidden.values_NV.new_zeros(index_M.shape[0], self.vocab_size)
        return picked_MV if bool(held_M1.all()) else torch.where(held_M1, picked_MV, self.fill)

    def dense(self) -> torch.Tensor:
        return TokenRows(self.mask_BT, self.values_NV, self.fill).dense()

    def select_rows(self, index: torch.Tensor) -> "HeadRows":
        return replace(self, hidden=self.hidden.select_rows(index))

    def narrow(self, width: int) -> "HeadRows":
        return replace(self, hidden=self.hidden.narrow(width))

    def to(self, device) -> "HeadRows":
        return replace(self, hidden=self.hidden.to(device))

    @staticmethod
    def concat(parts: list["HeadRows | None"], rows: list[int], width: int) -> "HeadRows":
        template = next(p for p in parts if p is not None)
        hidden = TokenRows.concat([None if p is None else p.hidden for p in parts], rows, width)
        return replace(template, hidden=hidden)


Rows = TokenRows | HeadRows


@dataclass
class TokenBatch:
    """A padded batch of student sequences with per-token targets, as the losses see it.

    Every ``*_BT`` tensor has shape ``[B, T]``. Position ``t`` of a per-token tensor refers to
    the token ``input_ids_BT[:, t]`` predicted from tokens ``< t``; ``loss_mask_BT`` is 1.0 on the
    student's response tokens only (never on observation or prompt tokens) and 0.0 elsewhere,
    including at ``t = 0`` and on padding.

    Attributes:
        input_ids_BT: int64 token ids, right-padded.
        attention_mask_BT: int64, 1 on real tokens.
        loss_mask_BT: float32 mask of the tokens that are trained on.
        behaviour_logprobs_BT: float32 logprobs under the policy that sampled the tokens.
        teacher_logprobs_BT: float32 teacher logprobs of the same tokens (``sampled`` scoring).
        turn_index_BT: int64 turn number of each response token (-1 elsewhere).
        student_logprobs_BT: float32 logprobs under the current student, with gradient; set by
            the trainer (:meth:`with_student`) before the loss is called.
        teacher_topk_ids_BTK, teacher_topk_logprobs_BTK: ``topk`` scoring: the teacher's ``K``
            most likely ids at each response position and their logprobs (``-inf`` where a row
            has fewer than ``K`` entries, and off the response tokens).
        teacher_tail_logprob_BT: ``topk`` scoring: log of the teacher's mass outside its top-k.
        teacher_full_logprobs_NV: ``full`` scoring: the teacher's log-softmax over the whole
            vocabulary at the scored response tokens, as :class:`TokenRows` (``[N, V]``; a dense
            view is :attr:`teacher_full_logprobs_BTV`, 0 off those tokens); ``hidden`` scoring:
            the same as :class:`HeadRows` (the teacher's ``[N, H]`` final hidden states, its head
            attached by the trainer).
        advantage_B: float32 one advantage per sequence (e.g. GRPO's group-relative return,
            :func:`opd.losses.group_advantages`), for :func:`opd.losses.ppo_clip`.
        student_logprobs_NV: the student's float32 log-softmax over the vocabulary, with
            gradient, as :class:`TokenRows`: set by the trainer with ``student_logprobs_BT`` when a
            loss can read it, at the tokens the losses train on (every position when the recipe
            has a user's loss). :attr:`student_logprobs_BTV` is its dense ``[B, T, V]`` view.
            :class:`HeadRows` instead past ``trainer.vocab_chunk_tokens`` tokens (computed a
            chunk at a time by the built-in divergences).
        masks_BT: named float32 ``[B, T]`` token masks an algorithm adds beside ``loss_mask_BT``,
            for losses that train on other tokens (:meth:`restricted_to`). PivotOPD's ``pivot``
            (the response tokens of a failed episode's pivotal turn) and ``recovery`` (the
            self-teacher's responses, in rows with no ``loss_mask_BT`` tokens) are two.
        reference_logprobs_BT: float32 logprobs of the tokens under the frozen starting student
            (the weights training began from), at the rollout temperature; set by the trainer
            when a loss needs them (``needs_reference``, e.g. ``reference_kl``).
        position_ids_BT, branch_ids_BT: int64, packed rows only (e.g. ActFirst's one row per
            episode): a row is a trunk with branches (:func:`opd.supervision.teacher_view.pack_trajectory`),
            token t at position ``position_ids_BT[:, t]``, seeing the trunk before it and its own
            branch only (:func:`opd.generation.base.branch_attention_mask`). A trained token's
            predictor is still the token just before it in the row. ``None``: plain sequences.
        totals: normalisers of the whole optimizer batch, kept by :meth:`select` so a loss on a
            micro-batch is normalised as if it saw the whole batch: ``tokens``, ``turns``,
            ``sequences``, ``micro_batches`` and ``ranks`` (see :func:`opd.losses.reduce_tokens`).

    Every optional field is ``None`` when the run does not produce it.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    behaviour_logprobs_BT: torch.Tensor
    teacher_logprobs_BT: torch.Tensor
    turn_index_BT: torch.Tensor
    student_logprobs_BT: torch.Tensor | None = None
    teacher_topk_ids_BTK: torch.Tensor | None = None
    teacher_topk_logprobs_BTK: torch.Tensor | None = None
    teacher_tail_logprob_BT: torch.Tensor | None = None
    teacher_full_logprobs_NV: TokenRows | HeadRows | None = None
    advantage_B: torch.Tensor | None = None
    student_logprobs_NV: TokenRows | HeadRows | None = None
    masks_BT: dict[str, torch.Tensor] | None = None
    reference_logprobs_BT: torch.Tensor | None = None
    position_ids_BT: torch.Tensor | None = None
    branch_ids_BT: torch.Tensor | None = None
    totals: dict[str, float] | None = None

    def __len__(self) -> int:
        return int(self.input_ids_BT.shape[0])

    @property
    def teacher_full_logprobs_BTV(self) -> torch.Tensor | None:
        """:attr:`teacher_full_logprobs_NV` as a dense ``[B, T, V]`` tensor (0 off the scored tokens)."""
        return None if self.teacher_full_logprobs_NV is None else self.teacher_full_logprobs_NV.dense()

    @property
    def student_logprobs_BTV(self) -> torch.Tensor | None:
        """:attr:`student_logprobs_NV` as a dense ``[B, T, V]`` tensor with its gradient (0 where
        it was not computed)."""
        return None if self.student_logprobs_NV is None else self.student_logprobs_NV.dense()

    def _map(self, fn, rows_fn) -> "TokenBatch":
        """``fn`` applied to every tensor, the named masks included, and ``rows_fn`` to every
        :class:`TokenRows`."""
        def apply(value):
            if isinstance(value, torch.Tensor):
                return fn(value)
            if isinstance(value, (TokenRows, HeadRows)):
                return rows_fn(value)
            if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
                return {k: fn(v) for k, v in value.items()}
            return value

        return TokenBatch(**{f.name: apply(getattr(self, f.name)) for f in fields(self)})

    def select(self, rows: slice) -> "TokenBatch":
        """The rows ``rows`` of every tensor (a micro-batch)."""
        return self.select_rows(torch.arange(len(self))[rows])

    def select_rows(self, index: torch.Tensor) -> "TokenBatch":
        """The rows ``index`` (int64 ``[N]``) of every tensor, in that order."""
        return self._map(lambda t: t[index.to(t.device)], lambda r: r.select_rows(index))

    def narrow(self, width: int) -> "TokenBatch":
        """Every per-token tensor cut to its first ``width`` positions (drop shared padding)."""
        return self._map(lambda t: t[:, :width] if t.dim() >= 2 else t, lambda r: r.narrow(width))

    def micro_batches(self, max_rows: int, max_tokens: int = 0) -> list["TokenBatch"]:
        """The rows split by :func:`length_groups` (longest first, at most ``max_rows`` rows and
        ``max_tokens`` padded tokens each), each cut to its own longest row."""
        groups = length_groups(self.attention_mask_BT.sum(1).tolist(), max_rows, max_tokens)
        micro = [self.select_rows(torch.tensor(rows)) for rows in groups]
        return [m.narrow(int(m.attention_mask_BT.sum(1).max())) for m in micro]

    def to(self, device) -> "TokenBatch":
        """Every tensor moved to ``device``."""
        return self._map(lambda t: t.to(device), lambda r: r.to(device))

    def with_student(self, student_logprobs_BT: torch.Tensor,
                     student_logprobs: "TokenRows | torch.Tensor | None" = None) -> "TokenBatch":
        """This batch with the student's logprobs: ``[B, T]`` and, optionally, the distribution
        over the vocabulary as :class:`TokenRows` or a dense ``[B, T, V]`` tensor."""
        if isinstance(student_logprobs, torch.Tensor):
            student_logprobs = TokenRows.from_dense(student_logprobs)
        return replace(self, student_logprobs_BT=student_logprobs_BT, student_logprobs_NV=student_logprobs)

    def turn_keys_BT(self) -> torch.Tensor:
        """``[B, T]`` int64 id of each token's (sequence, turn) pair, unique across the batch."""
        rows_B1 = torch.arange(len(self), device=self.turn_index_BT.device)[:, None]
        width = int(self.turn_index_BT.max().clamp(min=0)) + 1
        return rows_B1 * width + self.turn_index_BT.clamp(min=0)

    def with_totals(self, micro_batches: int = 1, ranks: int = 1) -> "TokenBatch":
        """This batch with :attr:`totals` counted over it (call before splitting into micro-batches
        and among trainer ranks): ``micro_batches`` and ``ranks`` are what the training engine
        divides each micro-batch's gradient by (accumulation steps, data-parallel averaging).

        The counts of ``loss_mask_BT`` are ``tokens``, ``turns`` and ``sequences``; those of a
        named mask (:attr:`masks_BT`) are prefixed with its name, e.g. ``pivot:tokens`` (see
        :meth:`restricted_to`).
        """
        totals = {**self._counts(self.loss_mask_BT), "micro_batches": float(micro_batches), "ranks": float(ranks)}
        for name, mask_BT in (self.masks_BT or {}).items():
            totals.update({f"{name}:{k}": v for k, v in self._counts(mask_BT).items()})
        return replace(self, totals=totals)

    def _counts(self, mask_BT: torch.Tensor) -> dict[str, float]:
        mask_BT = mask_BT > 0
        return {
            "tokens": float(mask_BT.sum()),
            "turns": float(self.turn_keys_BT()[mask_BT].unique().numel()),
            "sequences": float(mask_BT.any(dim=1).sum()),
        }

    def restricted_to(self, name: str) -> "TokenBatch":
        """The batch as a loss on the tokens of the named mask ``name`` sees it: that mask as
        ``loss_mask_BT``, normalised by that mask's whole-batch counts."""
        mask_BT = (self.masks_BT or {}).get(name)
        if mask_BT is None:
            raise ValueError(f"the batch has no {name!r} token mask (it has {sorted(self.masks_BT or {})}); a loss "
                             "on it needs an algorithm whose batches carry it (e.g. pivot_opd: pivot, recovery)")
        totals = None
        if self.totals is not None:
            totals = {k: self.totals[f"{name}:{k}"] for k in ("tokens", "turns", "sequences")}
            totals["micro_batches"] = self.totals["micro_batches"]
            totals["ranks"] = self.totals.get("ranks", 1.0)
        return replace(self, loss_mask_BT=mask_BT, totals=totals)

    @staticmethod
    def concat(batches: list["TokenBatch"], pad_id: int) -> "TokenBatch":
        """The rows of ``batches`` in order, right-padded to the widest. A field (or named mask)
        one batch lacks is filled as padding (``advantage_B`` and masks with 0); ``totals`` are
        dropped (recount them)."""
        width = max(int(b.input_ids_BT.shape[1]) for b in batches)

        def stack(name: str, values: list[torch.Tensor | None]) -> torch.Tensor:
            template = next(v for v in values if v is not None)
            fill = pad_id if name == "input_ids_BT" else _FILL.get(name, 0)
            parts = []
            for b, v in zip(batches, values):
                if name.endswith("_B"):
                    parts.append(v if v is not None else torch.zeros(len(b), dtype=template.dtype))
                    continue
                part = torch.full((len(b), width, *template.shape[2:]), fill, dtype=template.dtype)
                if v is not None:
                    part[:, : v.shape[1]] = v
                parts.append(part)
            return torch.cat(parts)

        out = {}
        for f in fields(TokenBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "totals" or all(v is None for v in values):
                out[f.name] = None
            elif f.name.endswith("_NV"):
                kind = type(next(v for v in values if v is not None))
                if not all(v is None or isinstance(v, kind) for v in values):
                    raise ValueError(f"TokenBatch.concat: {f.name} is held as rows of logprobs in some batches and "
                                     "as hidden states in others")
                out[f.name] = kind.concat(values, [len(b) for b in batches], width)
            elif f.name == "masks_BT":
                names = list(dict.fromkeys(n for v in values for n in (v or {})))
                out[f.name] = {n: stack(f.name, [(v or {}).get(n) for v in values]) for n in names}
            else:
                out[f.name] = stack(f.name, values)
        return TokenBatch(**out)

    @staticmethod
    def from_rows(rows: list[dict[str, list]], pad_id: int) -> "TokenBatch":
        """Right-pad per-sequence lists (keys as the field names without suffix) into tensors.

        Rows with ``position_ids`` and ``branch_ids`` are packed (a trunk and branches, see
        :attr:`position_ids_BT`); a plain row in the same batch becomes a trunk alone."""
        width = max(len(r["input_ids"]) for r in rows)

        def pad(key: str, value: float | int, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full((len(rows), width), value, dtype=dtype)
            for i, r in enumerate(rows):
                if key in r:  # a missing key (e.g. no teacher scores for SFT) stays at its fill value
                    out[i, : len(r[key])] = torch.tensor(r[key], dtype=dtype)
            return out

        packed = {}
        if any("branch_ids" in r for r in rows):
            position_BT = pad("position_ids", 0, torch.long)
            for i, r in enumerate(rows):
                if "position_ids" not in r:  # a plain row among packed ones: a trunk alone
                    position_BT[i, : len(r["input_ids"])] = torch.arange(len(r["input_ids"]))
            packed = {"position_ids_BT": position_BT, "branch_ids_BT": pad("branch_ids", 0, torch.long)}
        return TokenBatch(
            input_ids_BT=pad("input_ids", pad_id, torch.long),
            attention_mask_BT=pad("attention_mask", 0, torch.long),
            loss_mask_BT=pad("loss_mask", 0.0, torch.float32),
            behaviour_logprobs_BT=pad("behaviour_logprobs", 0.0, torch.float32),
            teacher_logprobs_BT=pad("teacher_logprobs", 0.0, torch.float32),
            turn_index_BT=pad("turn_index", -1, torch.long),
            **packed,
        )


# Padding of each per-token field in :meth:`TokenBatch.concat` (0 unless named here).
_FILL = {"turn_index_BT": -1, "teacher_topk_logprobs_BTK": float("-inf")}


def length_groups(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices grouped for padded forwards: longest rows first, each group at most
    ``max_rows`` rows and, with ``max_tokens > 0``, at most ``max_tokens`` padded tokens (its
    rows times its longest row; a row longer than that goes alone).

    Padding a short row to a long one costs that row the long one's attention, which grows with
    the square of the length, so rows of very different lengths (one episode per row) are much
    cheaper in a few forwards of similar lengths than in one forward padded to the longest.

    Example:
        >>> length_groups([100, 2000, 300, 1900], max_rows=16, max_tokens=4096)
        [[1, 3], [2, 0]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is None or len(group) >= max_rows or (max_tokens > 0 and (len(group) + 1) * lengths[group[0]] > max_tokens):
            groups.append([i])
        else:
            group.append(i)
    return groups


def success_rate(trajs: list[Trajectory]) -> float:
    """The share of ``trajs`` that succeeded (0 for none)."""
    return sum(t.success for t in trajs) / max(len(trajs), 1)
