"""The ActFirst episode loop: act first by inverse dynamics, reason later, off the critical path.

In a think-then-act rollout every environment step waits for a long reasoning block. ActFirst
takes the reasoning off that path. All live episodes advance together, as in
:func:`opd.rollout.vanilla.run_episodes`, but each turn t is played by a *fast* action-only
request, and the *full* think-then-act response is generated apart:

1. **Context.** ``c_t`` is the state-grounded context: the task, then every executed action and
   the observation it led to, in token ids (``prompt_0 a_0 close prompt_1 ... prompt_t``),
   exactly ``render_context(traj, t, "state_grounded")``.
2. **Full request, at once.** As soon as ``c_t`` exists it is added to the engine's stream
   (continuous batching, :class:`opd.generation.base.GenerationStream`) for a full
   think-then-act response (the standard prompt, no reference, ``rollout.max_new_tokens``).
   It decodes a token in every step the stream runs from then on, so it overlaps with the
   later fast turns (which share those steps) and with the other full requests. A request is
   added only while its episode is live (never after it ended); the action inside a full
   response is not executed. After the last environment step the stream drains.
3. **Fast action.** While the episode is *aligned* with its reference trajectory, the student
   gets the inverse-dynamics prompt: ``c_t`` with the last observation message extended by the
   reference next observation o_ref(t+1) (see :func:`opd.chat.action_only_prompt_ids`), and answers
   with the action only (``actfirst.action_max_new_tokens``). The environment executes it.
4. **Transition check.** The new observation is compared with o_ref(t+1): a normalised exact
   match by default, or the environment class's ``transition_matches(observation, reference)``
   (``actfirst.transition_check: env``). The check is about the outcome, not about whether
   the action equals the reference's. After the first failed check the episode plays the rest
   in *autonomous* action-only prompts (no reference). With ``inverse_dynamics=False`` (the
   "w/o ID" ablation) every fast turn is autonomous.

One thread, one stream: a fast turn adds its action-only requests to the same stream and
steps it until they have all finished; every one of those steps also advances every full
request in flight. On a small model or a GPU a decode step over a hundred rows costs little
more than over ten, so the full responses ride along nearly free, and the critical path is
the fast turns alone (:class:`opd.generation.hf_stream.HFStream` on the HF engine, vLLM's own
scheduler on vLLM). The order of ``add`` and ``step`` calls depends on nothing but the
episodes, so a rollout is reproducible.

Example:
    >>> trajs, stats = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0"), tasks, refs,
    ...                                      tokenizer, fmt, ActFirstSettings(), seed=0)  # doctest: +SKIP
    >>> stats.metrics()["actfirst/alignment_rate"]  # doctest: +SKIP
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from opd.chat import ChatFormat, action_only_prompt_ids, standard_prompt_ids
from opd.envs import env_class
from opd.generation.base import Completion, GenerationStream, SamplingParams
from opd.rollout.env_pool import EnvFailure, InProcessEnvs
from opd.rollout.vanilla import EpisodeSettings, kept_info, mark_env_error
from opd.trajectory import Trajectory, Turn



# ----- transition check ---------------------------------------------------------------------
def normalise_observation(text: str) -> str:
    """Case-folded, whitespace-collapsed text: what the default check compares."""
    return re.sub(r"\s+", " ", str(text)).strip().casefold()


def exact_match(observation: str, reference: str) -> bool:
    """The default transition check: normalised exact match."""
    return normalise_observation(observation) == normalise_observation(reference)


def env_comparator(env_id: str, module: str = ""):
    """The environment class's ``@staticmethod transition_matches(observation, reference)``,
    looked up from the registered entry point (the environment is not made).

    Raises:
        ValueError: naming ``actfirst.transition_check`` when the class defines none.
    """
    entry = env_class(env_id, module)
    comparator = getattr(entry, "transition_matches", None)
    if not callable(comparator):
        raise ValueError(
            f"key 'actfirst.transition_check' is 'env' but {getattr(entry, '__qualname__', entry)} (environment "
            f"{env_id}) defines no `@staticmethod transition_matches(observation, reference) -> bool`; "
            "add one, or use transition_check: exact."
        )
    return comparator


@dataclass(frozen=True)
class TransitionCheck:
    """Picklable transition check (it crosses to the rollout actor).

    Attributes:
        mode: ``exact`` (normalised exact match) or ``env`` (the environment's comparator).
        env_id, module: where to find the comparator for ``env``.
    """

    mode: str = "exact"
    env_id: str = ""
    module: str = ""

    def resolve(self):
        """The comparator ``(observation, reference) -> bool``."""
        if self.mode == "exact":
            return exact_match
        if self.mode == "env":
            return env_comparator(self.env_id, self.module)
        raise ValueError(f"key 'actfirst.transition_check' is {self.mode!r}; expected exact or env")


@dataclass(frozen=True)
class ActFirstSettings:
    """Settings of an ActFirst rollout (picklable).

    Attributes:
        episode: the standard settings; ``max_new_tokens`` and ``temperature`` are the full
            responses' budget and temperature (fast turns sample at the same temperature).
        inverse_dynamics: ``False`` is the "w/o ID" ablation: no reference prompts at all.
        action_max_new_tokens: budget of a fast action-only turn.
        check: the transition check.
        decode_during_env_steps: while the environments (in their own processes) compute a
            turn's steps, the stream keeps decoding the full responses in flight, once they have
            taken longer than the last stream step (faster ones are not held up). How many steps
            fit depends on timing, so which requests share a later step varies from run to run:
            the samples stay the same with vLLM's per-request seeds up to floating-point
            differences between batch shapes, and differ with the HF stream's one generator.
            ``False``: the stream waits, and a rollout is reproducible for a seed.
    """

    episode: EpisodeSettings = field(default_factory=EpisodeSettings)
    inverse_dynamics: bool = True
    action_max_new_tokens: int = 8
    check: TransitionCheck = field(default_factory=TransitionCheck)
    decode_during_env_steps: bool = True


# ----- statistics ---------------------------------------------------------------------------
@dataclass
class ActFirstStats:
    """What an ActFirst rollout measured (picklable; :meth:`metrics` summarises it).

    Per episode ``i`` and turn ``t``: ``modes[i][t]`` (``reference`` | ``autonomous``),
    ``matches[i][t]`` (the transition check's verdict on a reference turn, else ``None``),
    ``first_deviation[i]`` (turn of the first failed check; ``None`` if none),
    ``has_reference[i]``, ``ended_at[i]`` (``perf_counter`` when the episode ended),
    ``full_queued_at[i][t]`` / ``full_finished_at[i][t]`` (when turn t's full request was
    added to the stream / came back finished), ``critical_path_end`` (``perf_counter`` after
    the last environment step).
    ``fast_latencies_s``: one per fast turn (its requests added until the last finished);
    ``full_latencies_s``: one per full request (added until finished). ``stream_steps`` /
    ``stream_row_steps``: decode steps the stream ran, and their live rows summed;
    ``env_overlap_steps``: those of them run while the environments stepped.
    """

    modes: list[list[str]]
    matches: list[list[bool | None]]
    first_deviation: list[int | None]
    has_reference: list[bool]
    ended_at: list[float]
    full_queued_at: list[list[float]]
    full_finished_at: list[list[float]]
    fast_latencies_s: list[float]
    full_latencies_s: list[float]
    stream_steps: int
    stream_row_steps: int
    env_overlap_steps: int
    fast_tokens: int
    full_tokens: int
    critical_path_s: float  # from the first reset to the last environment step
    critical_path_end: float
    drain_s: float  # waiting for outstanding full responses after the last step
    generation_s: float  # the whole rollout

    def aligned_turns(self, i: int) -> list[int]:
        """The turns of episode ``i`` that acted along its reference (every check up to and
        including the turn passed)."""
        first = self.first_deviation[i]
        return [t for t, mode in enumerate(self.modes[i]) if mode == "reference" and (first is None or first > t)]

    def metrics(self) -> dict[str, float]:
        """Alignment by turn, first deviation, latencies, S_ideal and the time split.

        ``S_ideal(T) = T * l_full / ((T - 1) * l_fast + l_full)`` with ``T`` the mean number of
        turns per episode, ``l_fast`` the mean fast turn and ``l_full`` the mean full request.
        """
        out: dict[str, float] = {}
        referenced = [i for i, has in enumerate(self.has_reference) if has]
        if referenced:
            # Turn t is aligned when every check up to and including t passed.
            horizon = max((len(self.modes[i]) for i in referenced), default=0)
            flags = []
            for t in range(horizon):
                alive = [i for i in referenced if t < len(self.modes[i])]
                aligned = [self.first_deviation[i] is None or self.first_deviation[i] > t for i in alive]
                aligned = [a and self.modes[i][t] == "reference" for a, i in zip(aligned, alive)]
                out[f"actfirst/alignment_rate_turn_{t}"] = sum(aligned) / len(alive)
                flags += aligned
            out["actfirst/alignment_rate"] = sum(flags) / max(len(flags), 1)
            deviated = [self.first_deviation[i] for i in referenced if self.first_deviation[i] is not None]
            out["actfirst/deviated_share"] = len(deviated) / len(referenced)
            out["actfirst/first_deviation_turn"] = sum(deviated) / len(deviated) if deviated else float("nan")
        turns = [m for episode in self.modes for m in episode]
        out["actfirst/reference_prompt_share"] = sum(m == "reference" for m in turns) / max(len(turns), 1)
        late = sum(q > end for queued, end in zip(self.full_queued_at, self.ended_at) for q in queued)
        out["actfirst/full_requests"] = float(sum(len(q) for q in self.full_queued_at))
        out["actfirst/late_full_requests"] = float(late)
        l_fast = sum(self.fast_latencies_s) / max(len(self.fast_latencies_s), 1)
        l_full = sum(self.full_latencies_s) / max(len(self.full_latencies_s), 1)
        T = len(turns) / max(len(self.modes), 1)
        out["latency/fast_s"] = l_fast
        out["latency/full_s"] = l_full
        out["actfirst/turns"] = T
        out["actfirst/s_ideal"] = s_ideal(T, l_fast, l_full)
        out["actfirst/stream_steps"] = float(self.stream_steps)
        out["actfirst/stream_rows_mean"] = self.stream_row_steps / max(self.stream_steps, 1)
        out["actfirst/env_overlap_steps"] = float(self.env_overlap_steps)
        out["time/critical_path_s"] = self.critical_path_s
        out["time/full_drain_s"] = self.drain_s
        out["actfirst/fast_tokens"] = float(self.fast_tokens)
        out["actfirst/full_tokens"] = float(self.full_tokens)
        return out


def s_ideal(T: float, l_fast: float, l_full: float) -> float:
    """The idealised speedup ``T * l_full / ((T - 1) * l_fast + l_full)`` (``nan`` if undefined)."""
    denominator = (T - 1) * l_fast + l_full
    return T * l_full / denominator if denominator > 0 and T > 0 else float("nan")


# ----- the loop -----------------------------------------------------------------------------
@dataclass
class _Episode:
    traj: Trajectory
    reference: Any  # opd.rollout.references.Reference | None
    history: list[int] = field(default_factory=list)  # c_t without its last (observation) prompt
    context: list[int] = field(default_factory=list)  # c_t
    prompt: list[int] = field(default_factory=list)  # turn t's standard prompt, as the trajectory keeps it
    observation: str = ""
    aligned: bool = False


class _ActFirstRollout:
    """One rollout's state: its episodes, the stream and what the rollout measures.

    Every request goes through :meth:`_add`, whose seed is the number of requests added before
    it, and every decode step through :meth:`_step`, which files the full responses that finish.
    """

    def __init__(self, engine, tasks: list[str], references: dict[str, Any] | None, tokenizer, fmt: ChatFormat,
                 settings: ActFirstSettings, seed: int):
        self.tokenizer, self.fmt, self.settings = tokenizer, fmt, settings
        self.matches_reference = settings.check.resolve()
        self.stream: GenerationStream = engine.stream(seed * 1009 + 500009)
        self.requests = 0  # added so far: the next request's seed
        self.step_s = 0.0  # the last stream step's duration
        self.overlap_steps = 0
        self.full_results: dict[tuple[int, int], Completion] = {}  # keyed by (episode, turn)
        self.full_queued_at: dict[tuple[int, int], float] = {}
        self.full_finished_at: dict[tuple[int, int], float] = {}
        self.full_latencies: list[float] = []
        self.full_tokens = 0
        self.fast_latencies: list[float] = []
        self.fast_tokens = 0
        n = len(tasks)
        self.episodes = [_Episode(Trajectory(task=task),
                                  (references or {}).get(task) if settings.inverse_dynamics else None)
                         for task in tasks]
        self.modes: list[list[str]] = [[] for _ in tasks]
        self.matches: list[list[bool | None]] = [[] for _ in tasks]
        self.first_deviation: list[int | None] = [None] * n
        self.ended_at = [float("nan")] * n

    # ----- the stream
    def _add(self, key, prompt_ids: list[int], max_new_tokens: int) -> None:
        # Every request its own seed (vLLM seeds per request; the HF stream ignores it).
        self.stream.add(key, prompt_ids, SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.settings.episode.temperature,
            stop_token_ids=(self.fmt.im_end_id,), seed=self.requests))
        self.requests += 1

    def _add_full(self, i: int, t: int) -> None:
        """Turn t's full think-then-act request, from episode i's context c_t."""
        self.full_queued_at[(i, t)] = time.perf_counter()
        self._add(("full", i, t), self.episodes[i].context, self.settings.episode.max_new_tokens)

    def _step(self) -> list[tuple[Any, Completion]]:
        """One stream step; full responses are filed, fast ones returned."""
        fast = []
        began = time.perf_counter()
        finished = self.stream.step()
        ended = time.perf_counter()
        self.step_s = ended - began
        for key, completion in finished:
            if key[0] == "full":
                self.full_results[key[1:]] = completion
                self.full_finished_at[key[1:]] = ended
                self.full_latencies.append(ended - self.full_queued_at[key[1:]])
            else:
                fast.append((key, completion))
        return fast

    def decode_while_envs_step(self) -> bool:
        """One stream step while the environments compute; ``False`` once nothing is in flight.
        Every fast request has finished by then, so only full responses advance."""
        if not self.stream:
            return False
        fast = self._step()
        assert not fast, "a fast request was in flight during the environment steps"
        self.overlap_steps += 1
        return True

    def drain(self) -> None:
        """Steps the stream until the full responses still in flight have finished."""
        while self.stream:
            self._step()

    # ----- the episodes
    def _end(self, i: int) -> None:
        self.ended_at[i] = time.perf_counter()

    def reset(self, envs, seed: int) -> list[int]:
        """Resets every environment and adds each turn 0's full request; returns the live episodes."""
        live = []
        for i, result in enumerate(envs.reset_many([(i, e.traj.task, seed) for i, e in enumerate(self.episodes)])):
            e = self.episodes[i]
            if isinstance(result, EnvFailure):
                mark_env_error(e.traj, result)
                self._end(i)
                continue
            e.observation = result[0]
            e.traj.initial_observation = result[0]
            e.traj.initial_info = kept_info(result[1], self.settings.episode.report_keys)
            e.prompt = standard_prompt_ids(self.fmt, self.tokenizer, e.observation, self.settings.episode.system_prompt,
                                           first=True)
            e.context = list(e.prompt)
            # c_0's history is the system prompt alone: a fast prompt replaces the observation's message.
            e.history = e.context[: len(e.context) - len(standard_prompt_ids(self.fmt, self.tokenizer, e.observation))]
            e.aligned = e.reference is not None and len(e.reference.actions) > 0
            self._add_full(i, 0)
            live.append(i)
        return live

    def _fast_prompt(self, e: _Episode) -> tuple[str, list[int]]:
        """Turn t's mode and action-only prompt: with o_ref(t+1) while the episode is aligned."""
        t = len(e.traj.turns)
        reference_next = e.reference.observations[t] if e.aligned and t < len(e.reference.observations) else None
        mode = "reference" if reference_next is not None else "autonomous"
        return mode, e.history + action_only_prompt_ids(self.fmt, self.tokenizer, e.observation, reference_next)

    def fast_turn(self, live: list[int]) -> list[tuple[int, str]]:
        """Adds turn t's action-only request of every live episode and steps the stream until all
        have finished (the full requests in flight advance in the same steps). Appends turn t to
        each trajectory and returns the actions for the environments to execute."""
        called = time.perf_counter()
        modes = []
        for i in live:
            mode, prompt = self._fast_prompt(self.episodes[i])
            modes.append(mode)
            self._add(("fast", i), prompt, self.settings.action_max_new_tokens)
        done: dict[int, Completion] = {}
        while len(done) < len(live):
            done.update((key[1], completion) for key, completion in self._step())
        self.fast_latencies.append(time.perf_counter() - called)
        actions = []
        for i, mode in zip(live, modes):
            fast = done[i].response_ids
            self.fast_tokens += len(fast)
            a_start, a_end = self.fmt.action_span(fast)
            action_ids = list(fast[a_start:a_end])
            turn = Turn(prompt_ids=list(self.episodes[i].prompt), response_ids=[], response_logprobs=[],
                        action_text=self.tokenizer.decode(action_ids, skip_special_tokens=True),
                        executed_action_ids=action_ids)
            self.episodes[i].traj.turns.append(turn)
            self.modes[i].append(mode)
            actions.append((i, turn.action_text))
        return actions

    def observe(self, live: list[int], results: list[Any]) -> list[int]:
        """Applies the environments' results to each live episode's turn t; returns those that
        go on, each with turn t+1's full request added."""
        return [i for i, result in zip(live, results) if self._observe(i, result)]

    def _observe(self, i: int, result: Any) -> bool:
        """Checks the transition, records turn t's outcome and builds c_{t+1}; ``False`` once the
        episode has ended."""
        e = self.episodes[i]
        t = len(e.traj.turns) - 1
        turn, mode = e.traj.turns[t], self.modes[i][t]
        if isinstance(result, EnvFailure):
            mark_env_error(e.traj, result)
            self.matches[i].append(None)
            self._end(i)
            return False
        obs, reward, terminated, truncated, info = result
        match = self.matches_reference(obs, e.reference.observations[t]) if mode == "reference" else None
        if match is False:
            e.aligned = False
            self.first_deviation[i] = t
        if e.aligned and t + 1 >= len(e.reference.observations):
            e.aligned = False  # the reference ended: nothing left to follow
        self.matches[i].append(match)
        turn.observation, turn.reward = obs, float(reward)
        turn.terminated, turn.truncated = bool(terminated), bool(truncated)
        turn.info = {**kept_info(info, self.settings.episode.report_keys), "actfirst_mode": mode,
                     "transition_match": match}
        e.traj.success = bool(info.get("success", False))
        if terminated or truncated:
            e.traj.end_reason = "success" if e.traj.success else ("failure" if terminated else "truncated")
            self._end(i)
            return False
        if self.settings.episode.max_turns and t + 1 >= self.settings.episode.max_turns:
            e.traj.end_reason = "depth_limit"  # a forward depth curriculum's horizon (opd.curriculum)
            self._end(i)
            return False
        next_prompt = standard_prompt_ids(self.fmt, self.tokenizer, obs)
        # c_{t+1} = c_t a_t close o_t: the state-grounded view closes every action this way.
        e.history = e.context + turn.executed_action_ids + [self.fmt.im_end_id, *self.fmt.newline_ids]
        e.context = e.history + next_prompt
        e.prompt = next_prompt
        e.observation = obs
        if len(e.context) + self.settings.episode.max_new_tokens > self.settings.episode.max_context_tokens:
            e.traj.end_reason = "context_limit"
            self._end(i)
            return False
        self._add_full(i, t + 1)
        return True

    # ----- the results
    def attach_full_responses(self) -> None:
        """Files each full response into its turn (once the stream has drained)."""
        for i, e in enumerate(self.episodes):
            for t, turn in enumerate(e.traj.turns):
                completion = self.full_results[(i, t)]
                turn.response_ids, turn.response_logprobs = list(completion.response_ids), list(completion.logprobs)
                turn.action_start, turn.action_end = self.fmt.action_span(turn.response_ids)
                self.full_tokens += len(turn.response_ids)

    def _per_turn(self, at: dict[tuple[int, int], float]) -> list[list[float]]:
        return [[at[(i, t)] for t in range(len(e.traj.turns))] for i, e in enumerate(self.episodes)]

    def stats(self, start: float, critical: float, end: float) -> ActFirstStats:
        """The :class:`ActFirstStats`, given when the rollout began, when the last environment
        step returned and when the stream had drained (``perf_counter``)."""
        return ActFirstStats(
            modes=self.modes, matches=self.matches, first_deviation=self.first_deviation,
            has_reference=[e.reference is not None for e in self.episodes], ended_at=self.ended_at,
            full_queued_at=self._per_turn(self.full_queued_at), full_finished_at=self._per_turn(self.full_finished_at),
            fast_latencies_s=self.fast_latencies, full_latencies_s=self.full_latencies,
            stream_steps=self.stream.steps, stream_row_steps=self.stream.row_steps,
            env_overlap_steps=self.overlap_steps, fast_tokens=self.fast_tokens, full_tokens=self.full_tokens,
            critical_path_s=critical - start, critical_path_end=critical, drain_s=end - critical,
            generation_s=end - start,
        )


def run_actfirst_episodes(
    engine,
    env_factory,
    tasks: list[str],
    references: dict[str, Any] | None,
    tokenizer,
    fmt: ChatFormat,
    settings: ActFirstSettings,
    seed: int,
    envs=None,
) -> tuple[list[Trajectory], ActFirstStats]:
    """Play one ActFirst episode per task.

    Args:
        engine: the student's engine (its ``stream``).
        env_factory: picklable zero-argument callable returning a fresh environment.
        tasks: task ids, one episode each.
        references: task -> :class:`opd.rollout.references.Reference`; a task without one (or
            ``settings.inverse_dynamics=False``) plays autonomous fast turns from the start.
        tokenizer, fmt: the student's tokenizer and ChatML ids.
        settings: see :class:`ActFirstSettings`.
        seed: the stream samples with ``seed * 1009 + 500009``.
        envs: an :class:`opd.rollout.env_pool.EnvWorkerPool`, or ``None`` for in-process envs.

    Returns:
        The trajectories (turn t: ``prompt_ids`` is its standard prompt, ``response_ids`` /
        ``response_logprobs`` the full response, ``executed_action_ids`` / ``action_text`` the
        fast action the environment executed; ``info`` adds ``actfirst_mode`` and
        ``transition_match``) and the :class:`ActFirstStats`.
    """
    if envs is None:
        with InProcessEnvs(env_factory) as local:
            return run_actfirst_episodes(engine, env_factory, tasks, references, tokenizer, fmt, settings, seed, local)
    rollout = _ActFirstRollout(engine, tasks, references, tokenizer, fmt, settings, seed)
    while_waiting = rollout.decode_while_envs_step if settings.decode_during_env_steps else None
    start = time.perf_counter()
    live = rollout.reset(envs, seed)
    while live:
        actions = rollout.fast_turn(live)
        # Environments that answer within one stream step are not held up by one: the stream
        # decodes only in the waits of slower ones.
        results = envs.step_many(actions, while_waiting=while_waiting, grace_s=rollout.step_s)
        live = rollout.observe(live, results)
    critical = time.perf_counter()
    rollout.drain()
    end = time.perf_counter()
    rollout.attach_full_responses()
    return [e.traj for e in rollout.episodes], rollout.stats(start, critical, end)

