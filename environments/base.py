"""What every opd text environment shares: :class:`TextEnv`, a ``gymnasium.Env`` base, and :func:`check_split`.

The environments differ in their engines and tasks, but play an episode the same way: ``reset``
picks a task, each ``step`` must come between a reset and the episode's end, counts a turn and
truncates at ``max_turns``, and every ``info`` starts with the same keys. As Gymnasium's own
environments share a base (``MujocoEnv.reset`` calls each env's ``reset_model``), that part lives
here once and a subclass writes only its engine:

    * ``__init__``: validate its kwargs, then ``TextEnv.__init__`` (``max_turns``, ``render_mode``
      and the sizes of the text spaces);
    * ``task_ids(split)`` (:func:`check_split` gives the error for an unknown split);
    * ``_start_episode(task)``: set the task up and return the first observation;
    * ``step(action)``: ``_begin_turn()``, the engine's move, then ``_end_turn(obs, terminated=...)``
      for ``truncated``, and ``_info(success=..., valid_action=...)``;
    * ``_state_info()``: its own info keys (``admissible_actions`` and ``expert_action`` where it
      offers them, a score...).

``reset``, ``render`` and the checks in ``_begin_turn`` come from the base.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import gymnasium


def check_split(split: str, splits: Sequence[str]) -> None:
    """Raises ValueError naming the valid splits unless ``split`` is one of ``splits``."""
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(map(repr, splits))}")


class TextEnv(gymnasium.Env):
    """Base of the opd text environments: the episode bookkeeping, with the engine left to a subclass.

    Attributes:
        tokenizer_words: Words the environment's actions are made of. A tokenizer trained on the
            environment's text (the CPU bootstrap in opd) seeds its corpus with them, so that each
            is learnt as a whole.
        reward_kwargs: Keyword arguments that change the rewards only: not the tasks, the
            observations nor the expert's actions. The CPU bootstrap keeps them out of the cache
            key of the models it trains on the expert, so that one model serves every reward.
        data_version: Version of the content the environment generates (its tasks, text and
            expert), bumped when that content changes. The CPU bootstrap puts it into the cache
            key of the models it trains on the expert, so a changed generator retrains them.
        report_keys: Info keys of an episode's last step that the environment reports as
            figures besides success (a score, a value, questions asked; a bool counts as a
            share). Trajectories keep them, and the held-out evaluation averages each over the
            episodes that report it (``eval/student_score``...).
        max_turns: Turn budget; a step that reaches it without ending the episode truncates.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.

    Example:
        >>> class EchoEnv(TextEnv):
        ...     '''Say the task id back.'''
        ...     def __init__(self, max_turns: int = 3) -> None:
        ...         super().__init__(max_turns=max_turns, render_mode=None, max_observation_chars=64,
        ...                          max_action_chars=64)
        ...     def task_ids(self, split: str) -> list[str]:
        ...         check_split(split, ("train", "eval"))
        ...         return [f"echo-{split}-{i}" for i in range(3)]
        ...     def _start_episode(self, task: str) -> str:
        ...         return f"Say {task}."
        ...     def step(self, action: str):
        ...         self._begin_turn()
        ...         success = action == self._task
        ...         obs = "Right." if success else "Say it again."
        ...         truncated = self._end_turn(obs, terminated=success)
        ...         return obs, float(success), success, truncated, self._info(success=success, valid_action=True)
        >>> env = EchoEnv()
        >>> env.reset(options={"task": "echo-eval-0"})
        ('Say echo-eval-0.', {'success': False, 'valid_action': True, 'task': 'echo-eval-0', 'turn': 0})
        >>> env.step("echo-eval-0")[1:4]
        (1.0, True, False)
    """

    metadata = {"render_modes": ["ansi"]}
    tokenizer_words: tuple[str, ...] = ()
    reward_kwargs: frozenset[str] = frozenset()
    data_version: str = ""
    report_keys: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        max_turns: int,
        render_mode: str | None,
        max_observation_chars: int,
        max_action_chars: int,
    ) -> None:
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode={render_mode!r} is not supported; use None or 'ansi'")
        self.max_turns = max_turns
        self.render_mode = render_mode
        # Nominal: an engine's text and a model's reply may hold non-ASCII characters too.
        self.observation_space = gymnasium.spaces.Text(max_length=max_observation_chars, charset=string.printable)
        self.action_space = gymnasium.spaces.Text(min_length=0, max_length=max_action_chars, charset=string.printable)
        self._task = ""  # id of the episode's task
        self._turn = 0  # steps taken in the episode
        self._done = True  # no episode to step: none yet, or it ended
        self._last_obs = ""

    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split``, the same for the same kwargs; ValueError for an unknown split."""
        raise NotImplementedError

    # ----- episode -----
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Starts an episode on ``options["task"]``, or on a train task drawn with ``seed``."""
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            task = self._draw_train_task()
        obs = self._start_episode(task)
        self._task, self._turn, self._done, self._last_obs = task, 0, False, obs
        return obs, self._info(success=False, valid_action=True)

    def render(self) -> str:
        """The current observation text ("" before the first reset)."""
        return self._last_obs

    def _draw_train_task(self) -> str:
        """The task of a reset without one: a train task drawn with ``np_random``."""
        train = self.task_ids("train")
        return train[int(self.np_random.integers(len(train)))]

    def _start_episode(self, task: str) -> str:
        """Sets the engine up on ``task`` and returns the first observation; ValueError for an unknown task."""
        raise NotImplementedError

    def _has_episode(self) -> bool:
        """Whether a reset started an episode, running or over, for ``step`` to continue or refuse.

        An env whose ``close`` stops its engine overrides this, so that a step after ``close``
        asks for a reset rather than calling the stopped engine.
        """
        return bool(self._task)

    def _begin_turn(self) -> None:
        """Counts a step's turn; raises RuntimeError if no episode is running."""
        if not self._has_episode():
            raise RuntimeError("step() called before reset(); call reset() first")
        if self._done:
            raise RuntimeError(f"episode on task {self._task!r} is over; call reset() before step()")
        self._turn += 1

    def _truncates(self, terminated: bool) -> bool:
        """Whether this turn used up ``max_turns`` without the episode ending otherwise."""
        return not terminated and self._turn >= self.max_turns

    def _end_turn(self, obs: str, *, terminated: bool) -> bool:
        """Records the step's observation and whether the episode ended; returns ``truncated``."""
        truncated = self._truncates(terminated)
        self._done = bool(terminated or truncated)
        self._last_obs = obs
        return truncated

    def _info(self, *, success: bool, valid_action: bool) -> dict[str, Any]:
        """The keys every info carries, then the env's own (:meth:`_state_info`)."""
        return {
            "success": bool(success),
            "valid_action": bool(valid_action),
            "task": self._task,
            "turn": self._turn,
            **self._state_info(),
        }

    def _state_info(self) -> dict[str, Any]:
        """Info keys of this env about the current state, e.g. ``admissible_actions``, ``expert_action``."""
        return {}

    @staticmethod
    def state_line(observation: str) -> str:
        """One line saying what ``observation`` tells about the state: the ``State:`` of a reasoning
        target (``think: plan`` in the CPU bootstrap, :func:`opd.bootstrap.rows.plan_text`).

        The default is the observation's last non-empty line, which suits an env that ends each
        observation with the state (FrozenLake's ``Around you: ...``). An env whose last line is
        instructions or bookkeeping overrides it: a model trained on that would copy boilerplate.
        A pure function of the text, so that a recipe's cached model depends on nothing else.
        """
        lines = [line.strip() for line in observation.strip().splitlines() if line.strip()]
        return lines[-1] if lines else ""
