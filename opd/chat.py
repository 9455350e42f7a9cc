"""Token-in/token-out rendering of the student's and the teacher's views of a trajectory.

Messages use ChatML (``<|im_start|>role\\n ... <|im_end|>\\n``), the template of Qwen3 and
SmolLM2. Each message is encoded once, on its own; a context is the concatenation of message ids
and of the response ids *exactly as sampled*. Nothing is ever decoded and re-encoded, so the
ids the student was conditioned on at turn t are the ids it is trained on (no token drift).

Two views of turn t (docs/supervision.md):

- ``full``: the student's own history, ``prompt_0 y_0 close prompt_1 y_1 close ... prompt_t``.
- ``state_grounded``: the same with each past response ``y_k`` replaced by its executed action
  ``a_k`` (a sub-span of ``y_k``): the task, the actions and the observations, none of the
  student's reasoning.

Example:
    >>> fmt = ChatFormat.from_tokenizer(tokenizer)  # doctest: +SKIP
    >>> ids = render_context(trajectory, turn=3, view="state_grounded", fmt=fmt)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.trajectory import Trajectory

VIEWS = ("full", "state_grounded")


@dataclass(frozen=True)
class ChatFormat:
    """The token ids of ChatML's markup for one tokenizer (picklable, crosses to Ray actors)."""

    im_start_id: int
    im_end_id: int
    newline_ids: tuple[int, ...]
    think_end_id: int | None
    role_ids: dict  # role -> ids of "role\n"
    pad_id: int

    @staticmethod
    def from_tokenizer(tokenizer) -> "ChatFormat":
        """Read the markup ids off a tokenizer; refuse one without ChatML special tokens."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} lacks the ChatML tokens {missing}; "
                "opd renders conversations in ChatML (Qwen3, SmolLM2 and the tiny test models use it)."
            )
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else vocab["<|im_end|>"]
        return ChatFormat(
            im_start_id=vocab["<|im_start|>"],
            im_end_id=vocab["<|im_end|>"],
            newline_ids=encode("\n"),
            think_end_id=vocab.get("</think>"),
            role_ids={role: encode(f"{role}\n") for role in ("system", "user", "assistant")},
            pad_id=pad,
        )

    def message_ids(self, role: str, content_ids: list[int]) -> list[int]:
        """``<|im_start|>role\\n content <|im_end|>\\n`` as ids."""
        return [self.im_start_id, *self.role_ids[role], *content_ids, self.im_end_id, *self.newline_ids]

    def assistant_header_ids(self) -> list[int]:
        return [self.im_start_id, *self.role_ids["assistant"]]

    def close_ids(self, response_ids: list[int]) -> list[int]:
        """What follows an assistant message: its end token if sampling was cut short, then a newline."""
        end = [] if response_ids and response_ids[-1] == self.im_end_id else [self.im_end_id]
        return [*end, *self.newline_ids]

    def shown_and_close_ids(self, turn, view: str) -> tuple[list[int], list[int]]:
        """What a past turn shows in ``view`` (its response, or only its action) and the ids
        that close the message. The closing depends on the sampled response (was it cut
        short?), so both views close a message the same way."""
        if view == "full":
            return turn.response_ids, self.close_ids(turn.response_ids)
        closing = self.close_ids(turn.response_ids)
        if closing[0] != self.im_end_id:  # the action excludes the end token: put it back
            closing = [self.im_end_id, *closing]
        return turn.action_ids, closing

    def action_span(self, response_ids: list[int]) -> tuple[int, int]:
        """``(start, end)`` of the action inside a response: after ``</think>``, before ``<|im_end|>``."""
        start = 0
        if self.think_end_id is not None and self.think_end_id in response_ids:
            start = response_ids.index(self.think_end_id) + 1
        end = len(response_ids)
        if end > start and response_ids[end - 1] == self.im_end_id:
            end -= 1
        return start, end


def first_prompt_ids(fmt: ChatFormat, tokenizer, observation: str, system_prompt: str = "") -> list[int]:
    """Turn 0's prompt: optional system message, the task observation, the assistant header."""
    ids: list[int] = []
    if system_prompt:
        ids += fmt.message_ids("system", tokenizer.encode(system_prompt, add_special_tokens=False))
    ids += fmt.message_ids("user", tokenizer.encode(observation, add_special_tokens=False))
    return ids + fmt.assistant_header_ids()


def next_prompt_ids(fmt: ChatFormat, tokenizer, observation: str) -> list[int]:
    """A later turn's prompt: the observation message and the assistant header."""
    return fmt.message_ids("user", tokenizer.encode(observation, add_special_tokens=False)) + fmt.assistant_header_ids()


def standard_prompt_ids(fmt: ChatFormat, tokenizer, observation: str, system_prompt: str = "", first: bool = False) -> list[int]:
    """A turn's standard (think-then-act) prompt: :func:`first_prompt_ids` for the first turn,
    :func:`next_prompt_ids` for a later one."""
    return first_prompt_ids(fmt, tokenizer, observation, system_prompt) if first else next_prompt_ids(fmt, tokenizer, observation)


ACTION_ONLY_INSTRUCTION = "Answer with the action only."
REFERENCE_HEADER = "Reference next observation:"


def action_only_prompt_ids(fmt: ChatFormat, tokenizer, observation: str, reference_next: str | None) -> list[int]:
    """ActFirst's fast turn: its last user message and the assistant header, as ids.

    The message is the observation, then (inverse dynamics) a line ``Reference next
    observation:`` with o_ref(t+1), then ``Answer with the action only.``::

        <|im_start|>user
        {observation}
        Reference next observation:
        {reference_next}
        Answer with the action only.<|im_end|>
        <|im_start|>assistant

    Without a reference (autonomous prediction) the middle two lines are absent. The
    observation is encoded on its own, exactly as in the standard prompt, so the fast prompt
    shares the standard one's observation ids.

    Example:
        >>> ids = action_only_prompt_ids(fmt, tokenizer, "A F\\nH G", None)  # doctest: +SKIP
    """
    suffix = "\n" + (f"{REFERENCE_HEADER}\n{reference_next}\n" if reference_next is not None else "") + ACTION_ONLY_INSTRUCTION
    content = tokenizer.encode(observation, add_special_tokens=False) + tokenizer.encode(suffix, add_special_tokens=False)
    return fmt.message_ids("user", content) + fmt.assistant_header_ids()


def _past_turn_ids(fmt: ChatFormat, traj: Trajectory, k: int, view: str) -> list[int]:
    turn = traj.turns[k]
    shown, closing = fmt.shown_and_close_ids(turn, view)
    return [*turn.prompt_ids, *shown, *closing]


def render_context(traj: Trajectory, turn: int, view: str, fmt: ChatFormat) -> list[int]:
    """The ids that condition turn ``turn``'s response in ``view`` (``full`` | ``state_grounded``)."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    ids: list[int] = []
    for k in range(turn):
        ids += _past_turn_ids(fmt, traj, k, view)
    return ids + traj.turns[turn].prompt_ids


def student_sequence(traj: Trajectory, fmt: ChatFormat) -> dict[str, list]:
    """The whole episode as one student sequence (its own ``full`` view) with per-token targets.

    Every turn's context in the ``full`` view is a prefix of this sequence, so one forward pass
    gives the student's logprobs of all its turns.

    Returns:
        A row for :meth:`opd.trajectory.TokenBatch.from_rows`: ``input_ids``, ``attention_mask``,
        ``loss_mask`` (1.0 on the response tokens of a trained turn, :attr:`Turn.trained`),
        ``behaviour_logprobs``, ``turn_index`` and the ``response_positions`` of each turn (list
        of (start, end) into ``input_ids``).
    """
    ids: list[int] = []
    loss_mask: list[float] = []
    behaviour: list[float] = []
    turn_index: list[int] = []
    positions: list[tuple[int, int]] = []
    for k, turn in enumerate(traj.turns):
        ids += turn.prompt_ids
        start = len(ids)
        ids += turn.response_ids
        positions.append((start, len(ids)))
        closing = fmt.close_ids(turn.response_ids) if k + 1 < len(traj.turns) else []
        ids += closing
        pad = len(turn.prompt_ids)
        loss_mask += [0.0] * pad + [float(turn.trained)] * len(turn.response_ids) + [0.0] * len(closing)
        behaviour += [0.0] * pad + list(turn.response_logprobs) + [0.0] * len(closing)
        turn_index += [-1] * pad + [k] * len(turn.response_ids) + [-1] * len(closing)
    return {
        "input_ids": ids,
        "attention_mask": [1] * len(ids),
        "loss_mask": loss_mask,
        "behaviour_logprobs": behaviour,
        "turn_index": turn_index,
        "response_positions": positions,
    }
