"""Matched-state comparison of two policies (``opd compare A B``): in the very same states, whose
next action is better?

1. **States.** Reference episodes (A's own greedy episodes by default, B's, the environment's
   expert's, or an episodes file of :mod:`opd.evaluation.trajectories`) give the states: state ``t`` of an episode is
   what the policy saw before its ``t``-th action.
2. **Restore.** Each state is rebuilt exactly by replaying the episode's actions in a fresh
   environment from the same task and seed; every observation must equal the recorded one
   (:class:`StateMismatch` otherwise: the environment is not deterministic, or the file belongs
   to another environment). The policy context is rebuilt from the same token ids the reference
   policy produced, so A and B read identical contexts (they must share a tokenizer).
3. **Ask.** A and B each give their greedy next action in every state.
4. **Judge** by what follows the action. ``expert`` (where the environment names an
   ``expert_action`` in every state): take the action, then let the expert play on; the
   better action keeps the task solvable, or solves it in fewer steps. ``rollouts`` (any
   environment): after the action, the reference policy continues ``rollouts`` times at the
   recipe's temperature; the better action has the higher success rate. Equal actions are equal.
5. **Report** the share of states where B is better, equal or worse: overall, by stage of the
   episode (early, middle, late: thirds of the reference episode's length) and by whether the
   reference had already made a mistake before the state (an invalid action, or an action
   other than the expert's): ``error_recovery`` vs ``on_track``.

Example:
    >>> result = compare_policies(host_a, host_b, factory, references, settings, judge="expert")  # doctest: +SKIP
    >>> result["overall"]  # doctest: +SKIP
    {'better': 0.21, 'equal': 0.71, 'worse': 0.08, 'n': 96}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from opd.chat import first_prompt_ids, next_prompt_ids
from opd.generation.base import SamplingParams
from opd.rollout.vanilla import EpisodeSettings
from opd.trajectory import Trajectory, Turn

Judge = Literal["expert", "rollouts"]


class StateMismatch(RuntimeError):
    """A replayed state differs from the one recorded in the reference episode."""


@dataclass
class Reference:
    """An episode to take states from: its task and reset seed, and per turn the response ids
    the policy produced, the action executed and the observation recorded after it."""

    task: str
    seed: int
    responses: list[Turn]
    observations: list[str]


def references_from_trajectories(trajs: Sequence[Trajectory], seed: int) -> list[Reference]:
    """References from freshly played episodes (reset with ``seed``)."""
    return [Reference(t.task, seed, [Turn([], list(turn.response_ids), [], turn.action_start, turn.action_end,
                                          turn.action_text) for turn in t.turns], [turn.observation for turn in t.turns])
            for t in trajs if t.turns and t.end_reason != "env_error"]


def references_from_rows(rows: Sequence[dict[str, Any]], seed: int) -> list[Reference]:
    """References from the rows of an episodes file (:mod:`opd.evaluation.trajectories`)."""
    return [Reference(row["task"], seed, [Turn([], list(t["response_ids"]), [], t["action_start"], t["action_end"],
                                              t["action"]) for t in row["turns"]], [t["observation"] for t in row["turns"]])
            for row in rows if row["turns"] and row["end_reason"] != "env_error"]


def references_from_expert(env_factory: Callable[[], Any], tasks: Sequence[str], seed: int, tokenizer: Any,
                           fmt: Any) -> list[Reference]:
    """References played by the environment's expert (``info["expert_action"]`` in every
    state). Its responses are the action alone, as the policy's ids (``action<|im_end|>``): a
    context in the ``full`` view shows them without reasoning."""
    refs = []
    env = env_factory()
    try:
        for task in tasks:
            _, info = env.reset(seed=seed, options={"task": task})
            turns, observations, done = [], [], False
            while not done:
                action = info.get("expert_action")
                if not action:
                    raise ValueError(f"task {task!r}: the environment names no expert action in some state, so it "
                                     "cannot play the references; use '--reference a' or '--reference b'")
                ids = tokenizer.encode(action, add_special_tokens=False)
                obs, _, terminated, truncated, info = env.step(action)
                turns.append(Turn([], [*ids, fmt.im_end_id], [], 0, len(ids), action))
                observations.append(obs)
                done = terminated or truncated
            refs.append(Reference(task, seed, turns, observations))
    finally:
        env.close()
    return refs


@dataclass
class State:
    """State ``turn`` of reference ``ref``: the context ids, the expert's action there (``""``
    if none), and whether the reference erred before it."""

    ref: int
    turn: int
    length: int
    context: list[int]
    expert_action: str
    after_mistake: bool

    @property
    def stage(self) -> str:
        third = 3 * self.turn / self.length
        return "early" if third < 1 else ("middle" if third < 2 else "late")


def restore(env: Any, ref: Reference, turn: int) -> None:
    """Reset ``env`` to ``ref``'s task and replay its first ``turn`` actions, checking each
    observation against the recorded one (:class:`StateMismatch` otherwise)."""
    env.reset(seed=ref.seed, options={"task": ref.task})
    for i in range(turn):
        replay_step(env, ref, i)


def replay_step(env: Any, ref: Reference, i: int) -> tuple:
    """``env.step`` with ``ref``'s action ``i``; :class:`StateMismatch` unless the observation is
    the recorded one."""
    result = env.step(ref.responses[i].action_text)
    if result[0] != ref.observations[i]:
        raise StateMismatch(f"task {ref.task!r}: after action {i} ({ref.responses[i].action_text!r}) the environment "
                            f"answered {result[0][:120]!r}, but the reference recorded {ref.observations[i][:120]!r}")
    return result


def collect_states(env_factory: Callable[[], Any], refs: Sequence[Reference], host: Any,
                   settings: EpisodeSettings) -> list[State]:
    """Every state of every reference, replayed once, with its context in ``host``'s ids."""
    states = []
    env = env_factory()
    try:
        for r, ref in enumerate(refs):
            obs, info = env.reset(seed=ref.seed, options={"task": ref.task})
            context = first_prompt_ids(host.fmt, host.tokenizer, obs, settings.system_prompt)
            mistaken = False
            for t, turn in enumerate(ref.responses):
                states.append(State(r, t, len(ref.responses), list(context), str(info.get("expert_action") or ""), mistaken))
                expert = info.get("expert_action")
                obs, _, terminated, truncated, info = replay_step(env, ref, t)
                mistaken = mistaken or not info.get("valid_action", True) or bool(expert and turn.action_text != expert)
                if terminated or truncated:
                    break
                shown, closing = host.fmt.shown_and_close_ids(turn, settings.history)
                context += shown + closing + next_prompt_ids(host.fmt, host.tokenizer, obs)
    finally:
        env.close()
    return states


def next_actions(host: Any, contexts: list[list[int]], max_new_tokens: int, batch: int = 32) -> list[str]:
    """``host``'s greedy action in each context."""
    actions = []
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(host.fmt.im_end_id,), seed=0)
    for c in range(0, len(contexts), batch):
        for completion in host.engine.generate(contexts[c:c + batch], params):
            start, end = host.fmt.action_span(completion.response_ids)
            actions.append(host.tokenizer.decode(completion.response_ids[start:end], skip_special_tokens=True))
    return actions


def expert_outcome(env: Any, ref: Reference, turn: int, action: str, cap: int = 1000) -> tuple[bool, int] | None:
    """Take ``action`` in state ``turn`` of ``ref``, then follow the environment's expert to the
    end: ``(solved, steps)``; ``None`` when some state has no expert action."""
    restore(env, ref, turn)
    _, _, terminated, truncated, info = env.step(action)
    steps = 1
    while not (terminated or truncated) and steps < cap:
        expert = info.get("expert_action")
        if not expert:
            return None
        _, _, terminated, truncated, info = env.step(expert)
        steps += 1
    return bool(info.get("success", False)), steps


def rollout_outcome(env: Any, ref: Reference, state: State, action: str, host: Any, settings: EpisodeSettings,
                    rollouts: int, seed: int) -> float:
    """Success rate of ``rollouts`` continuations by ``host`` (sampled at ``settings.temperature``)
    after taking ``action`` in ``state``."""
    wins = 0
    for r in range(rollouts):
        restore(env, ref, state.turn)
        obs, _, terminated, truncated, info = env.step(action)
        ids = host.tokenizer.encode(action, add_special_tokens=False)
        context = state.context + ids + host.fmt.close_ids(ids) + next_prompt_ids(host.fmt, host.tokenizer, obs)
        turn = 0
        while not (terminated or truncated):
            params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    stop_token_ids=(host.fmt.im_end_id,), seed=seed * 7919 + r * 101 + turn)
            completion = host.engine.generate([context], params)[0]
            start, end = host.fmt.action_span(completion.response_ids)
            text = host.tokenizer.decode(completion.response_ids[start:end], skip_special_tokens=True)
            obs, _, terminated, truncated, info = env.step(text)
            turn_ids = Turn([], list(completion.response_ids), [], start, end, text)
            shown, closing = host.fmt.shown_and_close_ids(turn_ids, settings.history)
            context += shown + closing + next_prompt_ids(host.fmt, host.tokenizer, obs)
            turn += 1
            if len(context) + settings.max_new_tokens > settings.max_context_tokens:
                break
        wins += bool(info.get("success", False))
    return wins / rollouts


def verdict(a: Any, b: Any) -> str:
    """``better`` / ``equal`` / ``worse`` for B against A, from their outcomes: ``(solved, steps)``
    (solved first, then fewer steps) or a success rate."""
    if isinstance(a, tuple):
        a, b = (a[0], -a[1] if a[0] else 0), (b[0], -b[1] if b[0] else 0)
    return "better" if b > a else ("worse" if b < a else "equal")


def compare_policies(host_a: Any, host_b: Any, env_factory: Callable[[], Any], refs: Sequence[Reference],
                     settings: EpisodeSettings, judge: Judge = "expert", rollouts: int = 4, seed: int = 0,
                     advance: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """The comparison's numbers (see the module docstring) and one record per state."""
    states = collect_states(env_factory, refs, host_a, settings)
    contexts = [s.context for s in states]
    actions_a = next_actions(host_a, contexts, settings.max_new_tokens)
    actions_b = next_actions(host_b, contexts, settings.max_new_tokens)
    env = env_factory()
    records = []
    try:
        for s, a, b in zip(states, actions_a, actions_b):
            ref = refs[s.ref]
            if a == b:
                result = "equal"
            elif judge == "expert":
                out_a, out_b = expert_outcome(env, ref, s.turn, a), expert_outcome(env, ref, s.turn, b)
                if out_a is None or out_b is None:
                    raise ValueError(f"task {ref.task!r}: the environment names no expert action in some state, so "
                                     "'--judge expert' cannot judge it; use '--judge rollouts'")
                result = verdict(out_a, out_b)
            else:
                result = verdict(rollout_outcome(env, ref, s, a, host_a, settings, rollouts, seed),
                                 rollout_outcome(env, ref, s, b, host_a, settings, rollouts, seed))
            records.append({"task": ref.task, "turn": s.turn, "length": s.length, "stage": s.stage,
                            "after_mistake": s.after_mistake, "expert_action": s.expert_action, "action_a": a,
                            "action_b": b, "verdict": result})
            advance(1)
    finally:
        env.close()
    return {
        "states": len(records), "episodes": len(refs), "judge": judge,
        "overall": shares(records),
        "by_stage": {stage: shares([r for r in records if r["stage"] == stage]) for stage in ("early", "middle", "late")},
        "by_recovery": {"error_recovery": shares([r for r in records if r["after_mistake"]]),
                        "on_track": shares([r for r in records if not r["after_mistake"]])},
        "records": records,
    }


def shares(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The share of ``records`` whose verdict is better, equal and worse, and their number."""
    n = len(records)
    out: dict[str, float] = {v: sum(r["verdict"] == v for r in records) / n if n else 0.0
                             for v in ("better", "equal", "worse")}
    out["n"] = n
    return out


def render_comparison(console: Any, result: dict[str, Any]) -> None:
    """The table: B better / equal / worse than A, overall, by stage and by recovery."""
    from rich.table import Table

    table = Table(title=f"B = {result['b']} vs A = {result['a']}: next action in {result['states']} matched states of "
                        f"{result['episodes']} reference episodes ({result['reference']}), judged by {result['judge']}")
    for name in ("states", "n", "B better", "equal", "B worse"):
        table.add_column(name, justify="left" if name == "states" else "right")
    rows = [("all", result["overall"])] + [(f"stage: {k}", v) for k, v in result["by_stage"].items()] + \
        [(k.replace("_", " "), v) for k, v in result["by_recovery"].items()]
    for name, s in rows:
        table.add_row(name, str(s["n"]), *(f"{100 * s[v]:.1f}%" if s["n"] else "n/a" for v in ("better", "equal", "worse")))
    console.print(table)
