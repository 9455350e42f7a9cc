"""The vanilla multi-turn episode loop: think-then-act at every turn, batched across episodes.

All live episodes advance together: one ``engine.generate`` call per turn for the whole batch,
then one ``env.step`` per episode. A context grows by concatenating the sampled response ids,
the closing markup and the next observation's message ids, so the ids the student saw are the
ids it is trained on.

An environment that raises, crashes or hangs ends that episode only (``end_reason="env_error"``,
the reason kept in ``Trajectory.error``); the other episodes and the run go on. Environments run
where ``envs`` says: child processes with a timeout (:mod:`opd.rollout.env_pool`, what the
rollout worker uses) or this process.

Example:
    >>> trajs = run_episodes(engine, EnvFactory("opd/FrozenLakeText-v0"), ["fl4-train-00001"],
    ...                      tokenizer, fmt, EpisodeSettings(max_new_tokens=8), seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opd.chat import ChatFormat, first_prompt_ids, next_prompt_ids
from opd.envs import EnvFactory, report_keys
from opd.generation.base import SamplingParams
from opd.rollout.env_pool import EnvFailure, InProcessEnvs
from opd.schema import OPDConfig
from opd.trajectory import Trajectory, Turn

# Kept from every step's info, with the environment's report_keys.
INFO_KEYS = ("success", "valid_action", "expert_action", "turn")


@dataclass(frozen=True)
class EpisodeSettings:
    """Per-episode sampling settings (a picklable subset of the rollout config)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    max_context_tokens: int = 2048
    system_prompt: str = ""
    env_isolation: str = "subprocess"  # subprocess | inprocess (see opd.rollout.env_pool)
    env_timeout_s: float = 60.0
    env_memory_limit_mb: float = 4096.0  # subprocess: an env process's memory cap; 0: none
    env_cpu_time_limit_s: float = 60.0  # subprocess: CPU seconds per reset or step; 0: none
    history: str = "full"  # full: past turns keep their whole response | state_grounded: their action only
    report_keys: tuple[str, ...] = ()  # the env's figures, kept in each turn's info (opd.envs.report_keys)
    max_turns: int = 0  # end an episode after this many turns (end_reason "depth_limit"); 0: when the env ends it
    starts: tuple = ()  # per episode of the step (its index there): the reference turns ((action, observation),
    # ...) replayed before the student plays, as context (opd.curriculum); () or an empty one: from the reset
    guide_share: float = 0.0  # the share of the student's turns the teacher plays, as context (Guided-OPD)


def episode_settings(cfg: OPDConfig, temperature: float, history: str = "full") -> EpisodeSettings:
    """The recipe's episode settings at ``temperature``, past turns shown as ``history`` says."""
    return EpisodeSettings(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=temperature,
        max_context_tokens=cfg.rollout.max_context_tokens, system_prompt=cfg.rollout.system_prompt,
        env_isolation=cfg.env.isolation, env_timeout_s=cfg.env.timeout_s, env_memory_limit_mb=cfg.env.memory_limit_mb,
        env_cpu_time_limit_s=cfg.env.cpu_time_limit_s, history=history, report_keys=report_keys(EnvFactory.of(cfg.env)))


def kept_info(info: dict, report_keys: tuple[str, ...] = ()) -> dict:
    """The JSON-safe subset of a step's info that a trajectory keeps: :data:`INFO_KEYS` and the
    environment's ``report_keys``."""
    return {k: info[k] for k in (*INFO_KEYS, *report_keys) if k in info}


def run_episodes(
    engine,
    env_factory,
    tasks: list[str],
    tokenizer,
    fmt: ChatFormat,
    settings: EpisodeSettings,
    seed: int,
    envs=None,
    first_index: int = 0,
    guide=None,
) -> list[Trajectory]:
    """Play one episode per task with the policy in ``engine``.

    Args:
        engine: anything with the engine contract's ``generate``.
        env_factory: picklable zero-argument callable returning a fresh environment.
        tasks: task ids, one episode each (repeats allowed).
        tokenizer, fmt: the policy's tokenizer and its ChatML ids.
        settings: sampling and context limits; ``temperature=0`` plays greedily.
        seed: seeds sampling and the environments' resets; episode ``i``'s turn ``k`` samples
            with its own seed, :func:`episode_seed` ``(seed, first_index + i, k)``.
        envs: where the environments run: an :class:`opd.rollout.env_pool.EnvWorkerPool`
            (child processes with a timeout; episode ``i`` uses slot ``i``), or ``None`` for
            environments made from ``env_factory`` in this process.
        first_index: the index of ``tasks[0]`` among the step's episodes: a step's episodes
            split among rollout replicas sample as they would in one call.
        guide: the teacher's engine: it plays ``settings.guide_share`` of the turns (each drawn
            from ``(seed, episode, turn)``), from the same context, as context only (not trained).

    Returns:
        One :class:`Trajectory` per task, in order.
    """
    if envs is None:
        with InProcessEnvs(env_factory) as local:
            return run_episodes(engine, env_factory, tasks, tokenizer, fmt, settings, seed, envs=local,
                                first_index=first_index, guide=guide)
    trajs = [Trajectory(task=task) for task in tasks]
    contexts: list[list[int]] = [[] for _ in tasks]
    pending = []
    for i, result in enumerate(envs.reset_many([(i, task, seed) for i, task in enumerate(tasks)])):
        if isinstance(result, EnvFailure):  # a broken env ends its episode, not the run
            mark_env_error(trajs[i], result)
            continue
        trajs[i].initial_observation = result[0]
        trajs[i].initial_info = kept_info(result[1], settings.report_keys)
        prompt = first_prompt_ids(fmt, tokenizer, result[0], settings.system_prompt)
        contexts[i] = list(prompt)
        pending.append((i, prompt))
    if settings.starts:
        pending = replay_starts(trajs, contexts, pending, envs, tokenizer, fmt, settings, first_index)
    turn_no = 0
    while pending:
        guided = {i for i, _ in pending if guide is not None and guided_turn(seed, first_index + i, turn_no,
                                                                            settings.guide_share)}
        completions = {}
        for player, rows in ((engine, [i for i, _ in pending if i not in guided]), (guide, sorted(guided))):
            if not rows:
                continue
            params = SamplingParams(
                max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                stop_token_ids=(fmt.im_end_id,),
                seed=seed * 1009 + turn_no,
                seeds=tuple(episode_seed(seed, first_index + i, turn_no) for i in rows),
            )
            completions.update(zip(rows, player.generate([contexts[i] for i in rows], params)))
        turns = []
        for i, prompt in pending:
            completion = completions[i]
            response = completion.response_ids
            start, end = fmt.action_span(response)
            action_text = tokenizer.decode(response[start:end], skip_special_tokens=True)
            turn = Turn(prompt_ids=list(prompt), response_ids=list(response), response_logprobs=list(completion.logprobs),
                        action_start=start, action_end=end, action_text=action_text)
            trajs[i].turns.append(turn)
            turns.append(turn)
        results = envs.step_many([(i, turn.action_text) for (i, _), turn in zip(pending, turns)])
        still = []
        for (i, _), turn, result in zip(pending, turns, results):
            if isinstance(result, EnvFailure):
                mark_env_error(trajs[i], result)
                continue
            obs, reward, terminated, truncated, info = result
            turn.observation, turn.reward = obs, float(reward)
            turn.terminated, turn.truncated = bool(terminated), bool(truncated)
            turn.info = kept_info(info, settings.report_keys)
            if i in guided:  # the teacher played it: context for the student, not trained on
                turn.info["teacher_played"], turn.trained = True, False
            trajs[i].success = bool(info.get("success", False))
            if terminated or truncated:
                trajs[i].end_reason = "success" if trajs[i].success else ("failure" if terminated else "truncated")
                continue
            if settings.max_turns and len(trajs[i].turns) >= settings.max_turns:
                trajs[i].end_reason = "depth_limit"  # a forward depth curriculum's horizon (opd.curriculum)
                continue
            next_prompt = next_prompt_ids(fmt, tokenizer, obs)
            shown, closing = fmt.shown_and_close_ids(turn, settings.history)
            contexts[i] += shown + closing + next_prompt
            if len(contexts[i]) + settings.max_new_tokens > settings.max_context_tokens:
                trajs[i].end_reason = "context_limit"
                continue
            still.append((i, next_prompt))
        pending = still
        turn_no += 1
    return trajs


class StartMismatch(RuntimeError):
    """A replayed reference turn whose observation differs from the one the reference recorded."""


def replay_starts(trajs: list[Trajectory], contexts: list[list[int]], pending: list[tuple[int, list[int]]], envs,
                  tokenizer, fmt: ChatFormat, settings: EpisodeSettings, first_index: int) -> list[tuple[int, list[int]]]:
    """Play each episode's start (``settings.starts[first_index + i]``: reference turns) before
    the student: each action stepped in the episode's environment, its observation checked
    against the recorded one (as ``opd compare`` restores a state), and kept as a turn that is
    context only (``trained`` false; the action as the response, logprob 0). Returns the episodes
    still live, each with its next prompt.

    Raises:
        StartMismatch: an observation that is not the recorded one, naming the task and turn.
    """
    live = []
    prompts = dict(pending)
    starts = {i: settings.starts[first_index + i] for i, _ in pending if first_index + i < len(settings.starts)}
    for k in range(max((len(turns) for turns in starts.values()), default=0)):
        playing = [i for i, turns in starts.items() if len(turns) > k and i in prompts]
        results = envs.step_many([(i, starts[i][k][0]) for i in playing])
        for i, result in zip(playing, results):
            action, recorded = starts[i][k]
            if isinstance(result, EnvFailure):
                mark_env_error(trajs[i], result)
                del prompts[i]
                continue
            obs, reward, terminated, truncated, info = result
            if obs != recorded:
                raise StartMismatch(
                    f"task {trajs[i].task!r}: replaying the reference's turn {k} ({action!r}) the environment answered "
                    f"{obs[:120]!r}, but the reference recorded {recorded[:120]!r}; the environment is not "
                    "deterministic for this task, or the references belong to another environment (see docs/curricula.md)")
            response = tokenizer.encode(action, add_special_tokens=False) + [fmt.im_end_id]
            start, end = fmt.action_span(response)
            turn = Turn(prompt_ids=list(prompts[i]), response_ids=response, response_logprobs=[0.0] * len(response),
                        action_start=start, action_end=end, action_text=action, observation=obs, reward=float(reward),
                        terminated=bool(terminated), truncated=bool(truncated),
                        info={**kept_info(info, settings.report_keys), "replayed": True}, trained=False)
            trajs[i].turns.append(turn)
            trajs[i].success = bool(info.get("success", False))
            if terminated or truncated:  # the reference ended here: nothing left for the student
                trajs[i].end_reason = "success" if trajs[i].success else ("failure" if terminated else "truncated")
                del prompts[i]
                continue
            prompts[i] = next_prompt_ids(fmt, tokenizer, obs)
            shown, closing = fmt.shown_and_close_ids(turn, settings.history)
            contexts[i] += shown + closing + prompts[i]
    for i, _ in pending:
        if i in prompts:
            live.append((i, prompts[i]))
    return live


def guided_turn(seed: int, episode: int, turn: int, share: float) -> bool:
    """Whether the teacher plays ``episode``'s turn ``turn`` (a pure function of the call's seed:
    a resumed run, and any split among replicas, picks the same turns)."""
    return share > 0 and random.Random(f"{seed}:{episode}:{turn}:guide").random() < share


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of ``episode``'s turn ``turn`` in a call seeded ``seed`` (63 bits)."""
    return ((seed * 1_000_003 + episode) * 1009 + turn) % (1 << 63)


def mark_env_error(traj: Trajectory, failure: EnvFailure) -> None:
    """End ``traj`` as an environment failure (``end_reason="env_error"``), keeping why."""
    traj.end_reason = "env_error"
    traj.error = failure.message
    traj.success = False

