"""The bootstrap's training rows: scripted episodes, and the SFT rows made of them.

A scripted policy (the environment's expert, or uniformly random valid actions) plays episodes
(:func:`scripted_episode`); each becomes rows of token ids in the layouts a run trains and scores
in, with the loss on the policy's responses:

- :func:`sft_row`: the whole episode in the student's own view (``history: full``), or packed as
  a state-grounded teacher scores it (``history: state_grounded``);
- :func:`actfirst_rows`: single turns in ActFirst's layouts (``action_only_prob``);
- :func:`hint_rows`: turns with PivotOPD's hint line (``hint_prob``);
- :func:`expert_labelled_rows`: DAgger's turns, a policy's own context with the expert's action
  as the target (``dagger_episodes``).

With ``think: plan`` a response is a ``<think>`` block (the state and a plan, :func:`plan_text`)
before the action, so a full response is many times longer than its action, as a reasoning
model's is.
"""

from __future__ import annotations

import random
from typing import Callable

from environments.base import TextEnv
from opd.envs import EnvFactory
from opd.chat import ChatFormat, action_only_prompt_ids, render_context, standard_prompt_ids, student_sequence
from opd.schema import EnvConfig
from opd.supervision.pivot import hint_text
from opd.supervision.teacher_view import packed_row
from opd.trajectory import Trajectory, Turn

StateOf = Callable[[str], str]  # an observation's state line (TextEnv.state_line)


def scripted_episode(env, task: str, choose: Callable[[dict], str], seed: int, explore_prob: float = 0.0,
                     rng: random.Random | None = None) -> list[tuple[str, str, bool]]:
    """Play ``task`` with ``choose(info) -> action``.

    With probability ``explore_prob`` a turn plays a random valid move instead, marked as not to
    be trained on (noise injection, as in DART): the policy then sees states off its own path
    and learns to recover from them, which is what a teacher grading a student's mistakes needs.

    Returns:
        ``[(observation, action, train_on), ...]``: each observation is the one the action
        answers; the last entry is the final observation with an empty action.
    """
    rng = rng or random.Random(seed)
    obs, info = env.reset(seed=seed, options={"task": task})
    steps = []
    while True:
        admissible = info.get("admissible_actions") or []
        explore = bool(admissible) and rng.random() < explore_prob
        action = rng.choice(admissible) if explore else choose(info)
        if action is None:  # the policy has no move here (an expert that lost track): stop
            steps.append((obs, "", False))
            return steps
        steps.append((obs, action, not explore))
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            steps.append((obs, "", False))
            return steps


def scripted_policy(kind: str, rng: random.Random) -> Callable[[dict], str | None]:
    """The scripted policy: the env's expert (else its first admissible action), or a uniformly
    random admissible action (else the expert's). ``None`` when the env offers neither."""

    def expert(info: dict) -> str | None:
        return info.get("expert_action") or next(iter(info.get("admissible_actions") or []), None)

    if kind == "expert":
        return expert
    return lambda info: rng.choice(info["admissible_actions"]) if info.get("admissible_actions") else expert(info)


def plan_text(observation: str, action: str, state_of: StateOf = TextEnv.state_line) -> str:
    """The reasoning of a ``think: plan`` target: the state (``state_of(observation)``, the env's
    :meth:`~environments.base.TextEnv.state_line`; by default the last line, e.g. FrozenLake's
    ``Around you: ...``) and a plan naming the move.

    Example:
        >>> plan_text("A F\\nAround you: left wall, down F.", "down")
        'State: Around you: left wall, down F. Plan: down.'
    """
    return f"State: {state_of(observation)} Plan: {action}."


def env_state_of(env_cfg: EnvConfig) -> StateOf:
    """The ``state_line`` of the env ``env_cfg`` names (:meth:`TextEnv.state_line` for a non-TextEnv)."""
    env_class = EnvFactory.of(env_cfg).env_class()
    return getattr(env_class, "state_line", TextEnv.state_line)


def response_ids(obs: str, action: str, tokenizer, fmt: ChatFormat, think: str,
                 state_of: StateOf = TextEnv.state_line) -> tuple[list[int], int]:
    """The SFT target of one turn and where its action starts (after ``</think>`` with a plan)."""
    action_ids = tokenizer.encode(action, add_special_tokens=False) + [fmt.im_end_id]
    if not think:
        return action_ids, 0
    think_start = tokenizer.get_vocab().get("<think>")
    if think_start is None or fmt.think_end_id is None:
        raise ValueError("key 'bootstrap.think' is 'plan' but the tokenizer has no <think> / </think> tokens; "
                         "use the trained tokenizer (bootstrap.tokenizer: \"\") or one that has them.")
    block = [think_start, *tokenizer.encode(" " + plan_text(obs, action, state_of) + " ", add_special_tokens=False), fmt.think_end_id]
    return block + action_ids, len(block)


def sft_row(steps: list[tuple[str, str, bool]], task: str, tokenizer, fmt: ChatFormat, think: str = "",
            history: str = "full", state_of: StateOf = TextEnv.state_line) -> dict[str, list]:
    """One SFT sequence; turns not to be trained on (exploration) get no loss.

    With ``history: state_grounded`` the row is packed as a state-grounded teacher scores an
    episode (:func:`opd.supervision.teacher_view.pack_trajectory`): past turns show their
    action only, and each turn's response is a branch after its own context.
    """
    traj = Trajectory(task=task)
    for k, (obs, action, _) in enumerate(steps[:-1]):
        prompt = standard_prompt_ids(fmt, tokenizer, obs, first=k == 0)
        response, start = response_ids(obs, action, tokenizer, fmt, think, state_of)
        traj.turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * len(response),
                               action_start=start, action_end=len(response) - 1, action_text=action))
    if history == "state_grounded":
        row, _ = packed_row(traj, fmt)
        row["loss_mask"] = [m if t < 0 or steps[t][2] else 0.0 for m, t in zip(row["loss_mask"], row["turn_index"])]
        return row
    row = student_sequence(traj, fmt)
    for (start, end), (_, _, train_on) in zip(row["response_positions"], steps):
        if not train_on:
            row["loss_mask"][start:end] = [0.0] * (end - start)
    return row


def target_row(prompt: list[int], target: list[int], turn: int) -> dict[str, list]:
    """A row of one turn: ``prompt`` as context, the loss on ``target`` (turn ``turn``'s response)."""
    ids = prompt + target
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [0.0] * len(prompt) + [1.0] * len(target),
            "behaviour_logprobs": [0.0] * len(ids), "turn_index": [-1] * len(prompt) + [turn] * len(target)}


def actfirst_rows(steps: list[tuple[str, str, bool]], tokenizer, fmt: ChatFormat, prob: float, think: str,
                  rng: random.Random, state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """Rows in ActFirst's layouts for a share ``prob`` of the turns of one episode.

    The context of turn k is state-grounded (``prompt_0 a_0 close ... ``: executed actions and
    observations only, as in every ActFirst prompt), its last message one of:

    - the action-only prompt with the next observation the move led to (inverse dynamics:
      right for exploratory moves too, since it names the move that explains the transition);
    - the action-only prompt without it (autonomous), for a move the policy chose (``train_on``);
    - with ``think``, the standard prompt, whose target is the full think-then-act response:
      ActFirst's full requests come in this state-grounded context, not after the student's
      own reasoning as in the SFT sequence.

    Action-only targets are the action and the end token.
    """
    formats = ("reference", "autonomous", "standard") if think else ("reference", "autonomous")
    rows = []
    history: list[int] = []
    for k, (obs, action, train_on) in enumerate(steps[:-1]):
        action_ids = tokenizer.encode(action, add_special_tokens=False)
        standard = standard_prompt_ids(fmt, tokenizer, obs, first=k == 0)
        if rng.random() < prob:
            layout = rng.choice(formats) if train_on else "reference"
            if layout == "standard":
                prompt, target = history + standard, response_ids(obs, action, tokenizer, fmt, think, state_of)[0]
            else:
                reference_next = steps[k + 1][0] if layout == "reference" else None
                prompt = history + action_only_prompt_ids(fmt, tokenizer, obs, reference_next)
                target = action_ids + [fmt.im_end_id]
            rows.append(target_row(prompt, target, k))
        history = history + standard + action_ids + [fmt.im_end_id, *fmt.newline_ids]
    return rows


def hint_rows(steps: list[tuple[str, str, bool]], tokenizer, fmt: ChatFormat, prob: float, rng: random.Random,
              think: str = "", state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """PivotOPD's hinted turns for a share ``prob`` of one episode's turns (after the first).

    A real instruct model reads a hint; a tiny one learns to here. The row is the episode up to
    turn ``k`` with the hint line (:func:`opd.supervision.pivot.hint_text`, naming an earlier
    turn's action as the gold one and turn ``k``'s as the one to play now) appended to turn
    ``k``'s observation; only turn ``k``'s response is trained on.
    """
    rows = []
    for k in range(1, len(steps) - 1):
        obs, action, train_on = steps[k]
        if not train_on or rng.random() >= prob:
            continue
        pivot = rng.randrange(k)
        hinted = [*steps[:k], (f"{obs}\n{hint_text(pivot, steps[pivot][1], action)}", action, True), ("", "", False)]
        row = sft_row(hinted, "", tokenizer, fmt, think, state_of=state_of)
        start, end = row["response_positions"][k]
        row["loss_mask"] = [1.0 if start <= p < end else 0.0 for p in range(len(row["loss_mask"]))]
        rows.append(row)
    return rows


def expert_labelled_rows(traj: Trajectory, tokenizer, fmt: ChatFormat, think: str = "",
                         state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """One row per turn of ``traj`` whose state has an expert action: the context the policy
    acted in (its own earlier responses shown, as it saw them) and the expert's action as the
    target (with ``think``, after its plan). Turn t's state is the one the reset (t = 0) or
    step t - 1 returned."""
    rows = []
    observations = [traj.initial_observation, *(turn.observation for turn in traj.turns)]
    for t, info in enumerate(traj.state_infos()):
        label = str(info.get("expert_action") or "")
        if not label:
            continue
        context = render_context(traj, t, "full", fmt)
        target, _ = response_ids(observations[t], label, tokenizer, fmt, think, state_of)
        rows.append(target_row(context, target, t))
    return rows
