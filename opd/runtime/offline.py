"""Policies played in this process, without Ray or a trainer: ``opd eval`` and ``opd compare``.

A *source* names a policy and the recipe it is evaluated under:

- ``RUN_DIR``: a run directory's newest checkpoint (``RUN_DIR@N``: step ``N``'s, verified first;
  ``RUN_DIR@0``: the student the run started from; ``RUN_DIR@teacher``: its teacher), under
  the run's own ``config.yaml``;
- ``MODEL_DIR``: a Hugging Face model directory (``config.json``), under ``--recipe``;
- ``RECIPE.yaml``: the recipe's student (``RECIPE.yaml@teacher``: its teacher), built by the
  CPU bootstrap if the recipe says so (cached).

``key=value`` overrides apply to the recipe (e.g. ``env.eval_split=train``, ``rollout.max_new_tokens=8``).
Episodes play in the environment worker pool (``env.isolation``) with the recipe's timeouts and
limits, exactly as the run's evaluation does; results go under the run directory's ``eval/``.

Example:
    >>> evaluate_command(["runs/quickstart@0"], name="before", samples=8)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from opd.config import ConfigError, load_config
from opd.envs import EnvFactory
from opd.progress import Progress
from opd.runtime.workers import EngineSpec, RolloutWorker
from opd.schema import ModelConfig, OPDConfig
from opd.training.checkpoint import CheckpointError, atomic_write_text, complete_checkpoints, verify_checkpoint


@dataclass
class PolicySource:
    """A resolved source: the recipe, the model section it plays with (engine, dtype), the
    model directory, a label for tables, a default result name and the results directory."""

    cfg: OPDConfig
    model_cfg: ModelConfig
    path: str
    label: str
    name: str
    out_dir: Path


def resolve_source(source: str, recipe: str | None, overrides: list[str], log: Any) -> PolicySource:
    """The policy ``source`` names (see the module docstring); :class:`ConfigError` when it
    names nothing that exists, naming what was looked for."""
    from opd.bootstrap import resolve_student_path, resolve_teacher_path
    from opd.mixture import teacher_sections

    spec, _, selector = source.rpartition("@") if "@" in source else (source, "", "")
    path = Path(spec)
    if path.is_dir() and (path / "config.yaml").is_file():
        cfg = load_config(recipe or path / "config.yaml", overrides)
        if selector in (teachers := teacher_sections(cfg)):  # `teacher`, or a key of `teachers`
            model = resolve_teacher_path(cfg, log, selector)
            return PolicySource(cfg, teachers[selector], model, f"{spec} {selector}", selector, path / "eval")
        checkpoints = {int(p.name.removeprefix("step_")): p for p in complete_checkpoints(path)}
        if selector in ("", "last"):
            if not checkpoints:
                raise ConfigError(f"{spec} holds no complete checkpoint (looked in {path / 'checkpoints'}); name the "
                                  f"starting student with {spec}@0")
            step = max(checkpoints)
        elif selector.isdigit():
            step = int(selector)
        else:
            raise ConfigError(f"{source}: after '@' a run directory takes a step number, 'last' or a teacher's name: "
                              f"{', '.join(teachers)} (got {selector!r})")
        if step == 0:
            model = resolve_student_path(cfg, log)
            return PolicySource(cfg, cfg.student, model, f"{spec} step 0", "step_0", path / "eval")
        if step not in checkpoints:
            raise ConfigError(f"{spec} has no complete checkpoint of step {step} (it has steps "
                              f"{', '.join(map(str, sorted(checkpoints))) or 'none'}; 0 is the starting student)")
        try:
            verify_checkpoint(checkpoints[step])
        except CheckpointError as exc:
            raise ConfigError(f"{checkpoints[step]} does not verify, so it was not loaded: {exc}") from None
        return PolicySource(cfg, cfg.student, str(checkpoints[step] / "hf"), f"{spec} step {step}", f"step_{step}",
                            path / "eval")
    if path.is_dir() and (path / "config.json").is_file():
        if recipe is None:
            raise ConfigError(f"{spec} is a model directory: pass --recipe RECIPE.yaml for the environment and the "
                              "episode settings it is evaluated under")
        cfg = load_config(recipe, overrides)
        return PolicySource(cfg, cfg.student, str(path), str(path), path.name, Path(cfg.run.output_dir) / "eval")
    if path.suffix in (".yaml", ".yml") and path.is_file():
        cfg = load_config(path, overrides)
        who = selector or "student"
        teachers = teacher_sections(cfg)  # the teachers routes use: `teacher` and the keys of `teachers`
        if who != "student" and who not in teachers:
            raise ConfigError(f"{source}: after '@' a recipe takes 'student' or one of its teachers: "
                              f"{', '.join(teachers)} (got {who!r})")
        if who == "student":
            model_cfg, model = cfg.student, resolve_student_path(cfg, log)
        else:
            model_cfg, model = teachers[who], resolve_teacher_path(cfg, log, who)
        return PolicySource(cfg, model_cfg, model, f"{who} of {spec}", who, Path(cfg.run.output_dir) / "eval")
    raise ConfigError(f"{source!r} is not a run directory (config.yaml and checkpoints/), a model directory "
                      "(config.json) or a recipe (.yaml) that exists")


def local_host(src: PolicySource) -> RolloutWorker:
    """The policy's engine, tokenizer and environment pool, in this process."""
    return RolloutWorker(EngineSpec.of(src.model_cfg, src.path, src.cfg.resources.torch_threads))


def _progress(log: Any, what: str, total: int, prefix: str,
              total_work: float | None = None) -> tuple[Progress, Callable[..., None]]:
    """:class:`opd.progress.Progress` counted in steps of ``n``: returns it (a context manager)
    and the ``advance(n, cost=1)`` the grid and the comparison call (``cost``: of each of the
    ``n``, where items differ, out of ``total_work``)."""
    progress, done = Progress(log, what, total, prefix=prefix, total_work=total_work), [0, 0.0]

    def advance(n: int, cost: float = 1.0) -> None:
        done[0] += n
        done[1] += n * cost
        progress.advance(done[0], work=done[1])

    return progress, advance


def _close_pools(*hosts: RolloutWorker) -> None:
    """The environment processes of each host's pool."""
    for host in hosts:
        host.close()


def evaluate_command(source: str, recipe: str | None, overrides: list[str], console: Any, *, name: str | None = None,
                     samples: int = 8, budgets: list[float] | None = None, temperature: float | None = None,
                     tasks: int | None = None, split: str | None = None, out: str | None = None,
                     batch: int = 32, seed: int | None = None) -> dict[str, Any]:
    """``opd eval``: pass@k for k = 1 … ``samples`` over the turn-budget grid; writes
    ``<name>.json``, ``<name>.png`` and ``<name>.episodes.parquet`` and prints the tables."""
    from opd.evaluation.passk import (GridSpec, budget_turns, expert_lengths, play_grid, plot_grid, render_grid,
                                      solution_budgets, summarise)
    from opd.evaluation.trajectories import episode_rows, write_episodes
    from opd.rollout.vanilla import episode_settings

    log = console.log if console is not None else print
    if samples < 1 or batch < 1:
        raise ConfigError(f"--samples and --batch must be at least 1 (got {samples} and {batch})")
    fractions = budgets or [0.25, 0.5, 1.0]  # without an expert to say what the tasks can be solved in
    if any(not 0 < f <= 1 for f in fractions):
        raise ConfigError(f"--budgets takes fractions of the environment's turn budget in (0, 1] (got {fractions})")
    src = resolve_source(source, recipe, overrides, log)
    cfg = src.cfg
    split = split or cfg.env.eval_split
    probe = EnvFactory.of(cfg.env)()
    try:
        task_ids = probe.unwrapped.task_ids(split)[: tasks or cfg.run.eval_episodes]
        max_turns = getattr(probe.unwrapped, "max_turns", None)
    finally:
        probe.close()
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError(f"environment {cfg.env.id} has no integer 'max_turns' turn budget, so the turn-budget grid "
                          "cannot be played; pass --budgets 1")
    temperature = cfg.rollout.temperature if temperature is None else temperature
    seed = cfg.run.seed if seed is None else seed
    # What the tasks can be solved in: the expert's episodes, where the environment has an expert.
    lengths = expert_lengths(EnvFactory.of(cfg.env), task_ids, seed)
    shortest = min(lengths) if lengths else None
    grid = budget_turns(max_turns, fractions) if budgets or not lengths else solution_budgets(max_turns, lengths)
    spec = GridSpec(samples=samples, budgets=grid, temperature=temperature, seed=seed, batch=batch)
    if shortest is not None:
        log(f"the environment's expert solves {len(lengths)} of the {len(task_ids)} tasks in {shortest} to "
            f"{max(lengths)} turns" + ("" if budgets else "; the budgets: its shortest, its median and the whole budget"))
    name = name or src.name
    out_dir = Path(out) if out else src.out_dir
    log(f"evaluating {src.label} ({src.path}) on {cfg.env.id} {split}: {len(task_ids)} tasks × {samples} samples at "
        f"T={temperature:g}, turn budgets {[t for _, t in spec.budgets]} of {max_turns}")
    host = local_host(src)
    settings = episode_settings(cfg, temperature, cfg.run.eval_history)

    def collect(factory, task_list, temp, call_seed):
        return host.collect(factory, task_list, settings, call_seed)[0]

    def factory_for(turns: int) -> EnvFactory:
        return EnvFactory.of(cfg.env, max_turns=turns)

    # An episode's cost is its budget's turns, at most: the time left counts the long budgets to come.
    progress, advance = _progress(log, "episode", len(task_ids) * samples * len(spec.budgets), "eval",
                                  total_work=float(len(task_ids) * samples * sum(t for _, t in spec.budgets)))
    start = time.perf_counter()
    try:
        with progress:
            played = play_grid(collect, factory_for, task_ids, spec, advance)
            progress.finish()
    finally:
        _close_pools(host)
    result = {"name": name, "policy": src.label, "model": src.path, "env": cfg.env.id, "split": split,
              "tasks": len(task_ids), "samples": samples, "temperature": temperature, "max_turns": max_turns,
              "confidence": spec.confidence, "ci_method": f"percentile bootstrap over tasks, {spec.resamples} resamples",
              "budgets": [{"fraction": f, "turns": t} for f, t in spec.budgets], "seconds": time.perf_counter() - start,
              "shortest_solution": shortest,
              **summarise(played, spec)}
    rows = [row for turns, pairs in played.items()
            for row in episode_rows([traj for _, traj in pairs], host.tokenizer, 0, name,
                                    samples=[j for j, _ in pairs], turn_budget=turns)]
    result["episodes"] = write_episodes(out_dir / f"{name}.episodes.parquet", rows).name
    result["plot"] = plot_grid(result, out_dir / f"{name}.png").name
    atomic_write_text(out_dir / f"{name}.json", json.dumps(result, indent=2))
    render_grid(console, result)
    log(f"wrote {out_dir / (name + '.json')}, the plot {result['plot']} and the episodes {result['episodes']} "
        f"({len(rows)} episodes, {result['seconds']:.0f}s)")
    return result


def compare_command(source_a: str, source_b: str, recipe: str | None, overrides: list[str], console: Any, *,
                    reference: str = "a", judge: str = "expert", rollouts: int = 4, tasks: int | None = None,
                    split: str | None = None, name: str | None = None, out: str | None = None) -> dict[str, Any]:
    """``opd compare A B``: matched-state comparison (:mod:`opd.evaluation.compare`); writes
    ``compare_<name>.json`` and prints the table."""
    from opd.evaluation.compare import (StateMismatch, compare_policies, references_from_expert, references_from_rows,
                                        references_from_trajectories, render_comparison)
    from opd.evaluation.trajectories import read_episodes
    from opd.models import TokenizerMismatchError, check_tokenizers_match
    from opd.rollout.vanilla import episode_settings

    log = console.log if console is not None else print
    src_a = resolve_source(source_a, recipe, overrides, log)
    src_b = resolve_source(source_b, recipe, overrides, log)
    cfg = src_a.cfg
    if (cfg.env.id, dict(cfg.env.kwargs)) != (src_b.cfg.env.id, dict(src_b.cfg.env.kwargs)):
        raise ConfigError(f"A and B were trained on different environments ({cfg.env.id} {dict(cfg.env.kwargs)} vs "
                          f"{src_b.cfg.env.id} {dict(src_b.cfg.env.kwargs)}); pass --recipe to evaluate both under one")
    host_a, host_b = local_host(src_a), local_host(src_b)
    try:
        check_tokenizers_match(host_a.tokenizer, host_b.tokenizer)
    except TokenizerMismatchError as exc:
        raise ConfigError(f"A ({src_a.path}) and B ({src_b.path}) must share a tokenizer, so both read the same "
                          f"context ids: {exc}") from None
    split = split or cfg.env.eval_split
    factory = EnvFactory.of(cfg.env)
    probe = factory()
    try:
        task_ids = probe.unwrapped.task_ids(split)[: tasks or cfg.run.eval_episodes]
    finally:
        probe.close()
    settings = episode_settings(cfg, cfg.rollout.temperature, cfg.run.eval_history)
    greedy = episode_settings(cfg, 0.0, cfg.run.eval_history)
    if reference in ("a", "b"):
        host = host_a if reference == "a" else host_b
        trajs = host.collect(factory, task_ids, greedy, cfg.run.seed)[0]
        refs = references_from_trajectories(trajs, cfg.run.seed)
        ref_label = f"{(src_a if reference == 'a' else src_b).label}'s greedy episodes"
    elif reference == "expert":
        try:
            refs = references_from_expert(factory, task_ids, cfg.run.seed, host_a.tokenizer, host_a.fmt)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        ref_label = "the environment's expert episodes"
    elif Path(reference).is_file():
        refs = references_from_rows(read_episodes(Path(reference)), cfg.run.seed)
        ref_label = reference
    else:
        raise ConfigError(f"--reference takes 'a', 'b', 'expert' or an episodes file (.parquet) that exists "
                          f"(got {reference!r})")
    total_states = sum(len(r.responses) for r in refs)
    log(f"comparing B = {src_b.label} with A = {src_a.label} in the states of {len(refs)} episodes ({ref_label}), "
        f"judged by {judge}")
    progress, advance = _progress(log, "state", total_states, "compare")
    try:
        with progress:
            result = compare_policies(host_a, host_b, factory, refs, settings, judge=judge, rollouts=rollouts,
                                      seed=cfg.run.seed, advance=advance)
            progress.finish()
    except StateMismatch as exc:
        raise ConfigError(f"a reference state could not be restored exactly: {exc}. Is the environment deterministic "
                          "for a task and seed, and does the reference come from this environment?") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        _close_pools(host_a, host_b)
    result = {"name": name or f"{src_b.name}_vs_{src_a.name}", "a": src_a.label, "b": src_b.label,
              "reference": ref_label, "env": cfg.env.id, "split": split, **result}
    out_dir = Path(out) if out else src_b.out_dir
    path = out_dir / f"compare_{result['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2))
    render_comparison(console, result)
    log(f"wrote {path} (one record per state under 'records')")
    return result
