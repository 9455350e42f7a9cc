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
the fast turns alone (:class:`opd.generation.hf.HFStream` on the HF engine, vLLM's own
scheduler on vLLM). The order of ``add`` and ``step`` calls depends on nothing but the
episodes, so a rollout is reproducible.

Example:
    >>> trajs, stats = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0"), tasks, refs,
    ...                                      tokenizer, fmt, ActFirstSettings(), seed=0)  # doctest: +SKIP
    >>> stats.metrics()["actfirst/alignment_rate"]  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from opd.chat import ChatFormat, action_only_prompt_ids, standard_prompt_ids
from opd.generation.base import Completion, SamplingParams
from opd.rollout.env_pool import EnvFailure, InProcessEnvs
from opd.rollout.vanilla import EpisodeSettings, kept_info, mark_env_error
from opd.trajectory import Trajectory, Turn

MODES = ("reference", "autonomous")


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
    import gymnasium

    from opd.envs import ensure_registered

    if module:
        importlib.import_module(module)
    ensure_registered()
    if env_id not in gymnasium.registry:
        raise ValueError(f"unknown environment {env_id!r} (key 'env.id')")
    entry = gymnasium.registry[env_id].entry_point
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), attr)
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
    observation: str = ""
    aligned: bool = False


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
    ep = settings.episode
    matches_reference = settings.check.resolve()
    stream = engine.stream(seed * 1009 + 500009)
    requests = 0

    def add(key, prompt_ids: list[int], max_new_tokens: int) -> None:
        nonlocal requests
        # Every request its own seed (vLLM seeds per request; the HF stream ignores it).
        stream.add(key, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=ep.temperature,
                                                   stop_token_ids=(fmt.im_end_id,), seed=requests))
        requests += 1

    full_results: dict[tuple[int, int], Completion] = {}
    full_queued_at: dict[tuple[int, int], float] = {}
    full_finished_at: dict[tuple[int, int], float] = {}
    full_latencies: list[float] = []

    step_s = 0.0  # the last stream step's duration

    def step() -> list[tuple[Any, Completion]]:
        """One stream step; full responses are filed, fast ones returned."""
        nonlocal step_s
        fast = []
        began = time.perf_counter()
        finished = stream.step()
        ended = time.perf_counter()
        step_s = ended - began
        for key, completion in finished:
            if key[0] == "full":
                full_results[key[1:]] = completion
                full_finished_at[key[1:]] = ended
                full_latencies.append(full_finished_at[key[1:]] - full_queued_at[key[1:]])
            else:
                fast.append((key, completion))
        return fast

    overlap_steps = 0

    def decode_while_envs_step() -> bool:
        """One stream step while the environments compute; ``False`` once nothing is in flight.
        Every fast request has finished by then, so only full responses advance."""
        nonlocal overlap_steps
        if not stream:
            return False
        fast = step()
        assert not fast, "a fast request was in flight during the environment steps"
        overlap_steps += 1
        return True

    def add_full(i: int, t: int, context: list[int]) -> None:
        full_queued_at[(i, t)] = time.perf_counter()
        add(("full", i, t), context, ep.max_new_tokens)

    n = len(tasks)
    episodes = [_Episode(Trajectory(task=task), (references or {}).get(task) if settings.inverse_dynamics else None)
                for task in tasks]
    modes: list[list[str]] = [[] for _ in tasks]
    matches: list[list[bool | None]] = [[] for _ in tasks]
    first_deviation: list[int | None] = [None] * n
    ended_at = [float("nan")] * n
    fast_latencies: list[float] = []
    fast_tokens = 0
    start = time.perf_counter()
    pending = []
    for i, result in enumerate(envs.reset_many([(i, task, seed) for i, task in enumerate(tasks)])):
        e = episodes[i]
        if isinstance(result, EnvFailure):
            mark_env_error(e.traj, result)
            ended_at[i] = time.perf_counter()
            continue
        e.observation = result[0]
        e.traj.initial_observation, e.traj.initial_info = result[0], kept_info(result[1])
        prompt = standard_prompt_ids(fmt, tokenizer, e.observation, ep.system_prompt, first=True)
        e.context = list(prompt)
        e.history = e.context[: len(e.context) - len(standard_prompt_ids(fmt, tokenizer, e.observation))]
        e.aligned = e.reference is not None and len(e.reference.actions) > 0
        add_full(i, 0, e.context)
        pending.append((i, prompt))
    while pending:
        turn_modes = []
        called = time.perf_counter()
        for i, _ in pending:
            e, t = episodes[i], len(episodes[i].traj.turns)
            reference_next = e.reference.observations[t] if e.aligned and t < len(e.reference.observations) else None
            turn_modes.append("reference" if reference_next is not None else "autonomous")
            prompt = e.history + action_only_prompt_ids(fmt, tokenizer, e.observation, reference_next)
            add(("fast", i), prompt, settings.action_max_new_tokens)
        fast_done: dict[int, Completion] = {}
        while len(fast_done) < len(pending):
            fast_done.update((key[1], completion) for key, completion in step())
        fast_latencies.append(time.perf_counter() - called)
        turns = []
        for (i, prompt), mode in zip(pending, turn_modes):
            fast = fast_done[i].response_ids
            fast_tokens += len(fast)
            a_start, a_end = fmt.action_span(fast)
            action_ids = list(fast[a_start:a_end])
            turn = Turn(prompt_ids=list(prompt), response_ids=[], response_logprobs=[],
                        action_text=tokenizer.decode(action_ids, skip_special_tokens=True),
                        executed_action_ids=action_ids)
            episodes[i].traj.turns.append(turn)
            modes[i].append(mode)
            turns.append(turn)
        # Environments that answer within one stream step are not held up by one: the stream
        # decodes only in the waits of slower ones.
        results = envs.step_many([(i, turn.action_text) for (i, _), turn in zip(pending, turns)],
                                 while_waiting=decode_while_envs_step if settings.decode_during_env_steps else None,
                                 grace_s=step_s)
        still = []
        for (i, _), mode, turn, result in zip(pending, turn_modes, turns, results):
            e, t = episodes[i], len(episodes[i].traj.turns) - 1
            if isinstance(result, EnvFailure):
                mark_env_error(e.traj, result)
                matches[i].append(None)
                ended_at[i] = time.perf_counter()
                continue
            obs, reward, terminated, truncated, info = result
            match = matches_reference(obs, e.reference.observations[t]) if mode == "reference" else None
            if match is False:
                e.aligned = False
                first_deviation[i] = t
            if e.aligned and t + 1 >= len(e.reference.observations):
                e.aligned = False  # the reference ended: nothing left to follow
            matches[i].append(match)
            turn.observation, turn.reward = obs, float(reward)
            turn.terminated, turn.truncated = bool(terminated), bool(truncated)
            turn.info = {**kept_info(info), "actfirst_mode": mode, "transition_match": match}
            e.traj.success = bool(info.get("success", False))
            if terminated or truncated:
                e.traj.end_reason = "success" if e.traj.success else ("failure" if terminated else "truncated")
                ended_at[i] = time.perf_counter()
                continue
            next_prompt = standard_prompt_ids(fmt, tokenizer, obs)
            # c_{t+1} = c_t a_t close o_t: the state-grounded view closes every action this way.
            e.history = e.context + turn.executed_action_ids + [fmt.im_end_id, *fmt.newline_ids]
            e.context = e.history + next_prompt
            e.observation = obs
            if len(e.context) + ep.max_new_tokens > ep.max_context_tokens:
                e.traj.end_reason = "context_limit"
                ended_at[i] = time.perf_counter()
                continue
            add_full(i, t + 1, e.context)
            still.append((i, next_prompt))
        pending = still
    critical = time.perf_counter()
    while stream:  # the full responses still in flight
        step()
    end = time.perf_counter()
    full_tokens = 0
    for i, e in enumerate(episodes):
        for t, turn in enumerate(e.traj.turns):
            completion = full_results[(i, t)]
            turn.response_ids, turn.response_logprobs = list(completion.response_ids), list(completion.logprobs)
            turn.action_start, turn.action_end = fmt.action_span(turn.response_ids)
            full_tokens += len(turn.response_ids)
    stats = ActFirstStats(
        modes=modes, matches=matches, first_deviation=first_deviation,
        has_reference=[e.reference is not None for e in episodes], ended_at=ended_at,
        full_queued_at=[[full_queued_at[(i, t)] for t in range(len(e.traj.turns))] for i, e in enumerate(episodes)],
        full_finished_at=[[full_finished_at[(i, t)] for t in range(len(e.traj.turns))] for i, e in enumerate(episodes)],
        fast_latencies_s=fast_latencies, full_latencies_s=full_latencies,
        stream_steps=stream.steps, stream_row_steps=stream.row_steps, env_overlap_steps=overlap_steps,
        fast_tokens=fast_tokens, full_tokens=full_tokens, critical_path_s=critical - start, critical_path_end=critical, drain_s=end - critical,
        generation_s=end - start,
    )
    return [e.traj for e in episodes], stats


def collect_actfirst(worker, env_factory, tasks: list[str], references: dict[str, Any] | None,
                     settings: ActFirstSettings, seed: int) -> tuple[list[Trajectory], ActFirstStats, dict[str, float]]:
    """:func:`run_actfirst_episodes` inside a rollout actor (``worker.run(collect_actfirst, ...)``),
    with the worker's engine and environment pool; also returns ``env_restarts``."""
    envs = worker._envs(env_factory, settings.episode)
    restarts_before = envs.restarts if envs is not None else 0
    trajs, stats = run_actfirst_episodes(worker.engine, env_factory, tasks, references, worker.tokenizer, worker.fmt,
                                         settings, seed, envs=envs)
    restarts = (envs.restarts - restarts_before) if envs is not None else 0
    return trajs, stats, {"env_restarts": float(restarts)}
