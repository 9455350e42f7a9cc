"""Episodes on disk, token by token: one format for training samples, held-out evaluations and
``opd eval``, read by ``opd report``'s trajectory viewer and by ``datasets``.

A file is a Parquet table, one row per episode, that loads as a Hugging Face dataset
(``datasets.Dataset.from_parquet(path)``) or with pyarrow. Where a run writes them:

- ``trajectories/train_step_N.parquet``: the first ``run.trajectory_episodes`` episodes of
  training step ``N``, every ``run.trajectory_every_steps`` steps, with the teacher's logprob of
  every response token;
- ``trajectories/eval_{who}_step_N.parquet``: every held-out episode of the evaluation at step
  ``N`` (``who`` is ``student`` or ``teacher``), greedy, not scored;
- ``eval/<name>.episodes.parquet``: ``opd eval``'s episodes.

Columns of a row (:data:`EPISODE_COLUMNS`):

=====================  ======================================================================
``step``               the training step (0: before training)
``kind``               ``train``, ``eval/student``, ``eval/teacher`` or ``opd eval``'s name
``episode``            the episode's index in its batch
``task``               the environment's task id
``sample``             which of a task's samples this is (``opd eval``; 0 elsewhere)
``turn_budget``        the turn budget it played under (0: the environment's own)
``success``            the environment's success flag at the end
``end_reason``         ``success``, ``failure``, ``truncated``, ``context_limit``, ``depth_limit`` or ``env_error``
``error``              the environment's error text for ``env_error``
``total_reward``       the sum of the turns' rewards
``task_prompt``        the system and task messages the policy saw first, decoded
``turns``              a list, one struct per turn, below
=====================  ======================================================================

Each turn: ``prompt`` (the tokens appended before this turn's response, decoded: the task at
turn 0, the observation message later), ``response`` (the whole response, reasoning included),
``action`` (what the environment executed), ``action_start``/``action_end`` (the action's span
in ``response_ids``), ``observation`` (the environment's answer), ``reward``, ``valid_action``,
``expert_action`` (the environment's expert in this turn's state, ``""`` if none),
``response_ids``, ``response_tokens`` (each id decoded alone), ``behaviour_logprobs`` (the
sampling policy's, one per response token), ``teacher_logprobs`` (the teacher's, in its view;
empty where not scored) and ``marks`` (``pivot`` and ``recovery``: PivotOPD's pivotal turn and
the turns after it that got a self-teacher response; ``aligned``: an ActFirst turn that acted
along its reference; ``context``: a turn that carried no loss, outside a depth curriculum's
window, ``replayed`` from a reference before the student played, or played by the ``teacher``).

Example:
    >>> write_episodes(path, episode_rows(trajs, tokenizer, step=5, kind="train", scores=scores))  # doctest: +SKIP
    >>> read_episodes(path)[0]["turns"][0]["teacher_logprobs"][:3]  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any, Sequence

from opd.generation.base import TokenScores
from opd.optional import optional_module
from opd.trajectory import Trajectory

EPISODE_COLUMNS = ("step", "kind", "episode", "task", "sample", "turn_budget", "success", "end_reason", "error",
                   "total_reward", "task_prompt", "turns")

Marks = dict[int, dict[int, list[str]]]
"""``{episode index: {turn index: [mark, ...]}}``."""


def episode_rows(trajs: Sequence[Trajectory], tokenizer: Any, step: int, kind: str,
                 scores: Sequence[TokenScores] | None = None, marks: Marks | None = None,
                 samples: Sequence[int] | None = None, turn_budget: int = 0) -> list[dict[str, Any]]:
    """One row per trajectory in the format above. ``scores[i]`` holds the teacher's logprob of
    every response token of trajectory ``i`` in turn order; a trajectory whose scores do not
    cover its responses exactly is written without them rather than misaligned."""
    rows = []
    for i, traj in enumerate(trajs):
        teacher = list(scores[i].logprobs) if scores is not None and i < len(scores) else []
        if teacher and len(teacher) != traj.num_response_tokens:
            teacher = []
        infos = traj.state_infos()
        turns, offset = [], 0
        for t, turn in enumerate(traj.turns):
            n = len(turn.response_ids)
            turns.append({
                "prompt": tokenizer.decode(turn.prompt_ids, skip_special_tokens=False),
                "response": tokenizer.decode(turn.response_ids, skip_special_tokens=True),
                "action": turn.action_text,
                "action_start": int(turn.action_start),
                "action_end": int(turn.action_end),
                "observation": turn.observation,
                "reward": float(turn.reward),
                "valid_action": bool(turn.info.get("valid_action", False)),
                "expert_action": str(infos[t].get("expert_action") or "") if t < len(infos) else "",
                "response_ids": [int(x) for x in turn.response_ids],
                "response_tokens": tokenizer.batch_decode([[x] for x in turn.response_ids]),
                "behaviour_logprobs": [_finite(x) for x in turn.response_logprobs],
                "teacher_logprobs": [_finite(x) for x in teacher[offset:offset + n]],
                "marks": list((marks or {}).get(i, {}).get(t, [])) + ([] if turn.trained else ["context"])
                + (["replayed"] if turn.info.get("replayed") else [])
                + (["teacher"] if turn.info.get("teacher_played") else []),
            })
            offset += n
        rows.append({
            "step": int(step), "kind": kind, "episode": i, "task": traj.task,
            "sample": int(samples[i]) if samples is not None else 0, "turn_budget": int(turn_budget),
            "success": bool(traj.success), "end_reason": traj.end_reason, "error": traj.error,
            "total_reward": float(traj.total_reward),
            "task_prompt": tokenizer.decode(traj.turns[0].prompt_ids, skip_special_tokens=False) if traj.turns else "",
            "turns": turns,
        })
    return rows


def _finite(x: float) -> float:
    """Parquet and the viewer take floats; a -inf logprob is written as -1e9."""
    return float(x) if math.isfinite(x) else -1e9


def write_episodes(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a Parquet dataset at ``path``, written whole (a partial file is never left
    under the final name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=_schema()) if rows else _schema().empty_table()
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial)
    partial.replace(path)
    return path


def read_episodes(path: Path) -> list[dict[str, Any]]:
    """The rows of an episodes file, as plain dicts."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(path)).to_pylist()


def run_episode_files(run_dir: Path) -> list[Path]:
    """A run's episode files, training samples and evaluations, by step then name."""
    def key(path: Path) -> tuple[int, str]:
        found = re.search(r"_step_(\d+)\.parquet$", path.name)
        return (int(found.group(1)) if found else -1, path.name)

    return sorted((Path(run_dir) / "trajectories").glob("*.parquet"), key=key)


def _schema():
    import pyarrow as pa

    turn = pa.struct([
        ("prompt", pa.string()), ("response", pa.string()), ("action", pa.string()),
        ("action_start", pa.int64()), ("action_end", pa.int64()), ("observation", pa.string()),
        ("reward", pa.float64()), ("valid_action", pa.bool_()), ("expert_action", pa.string()),
        ("response_ids", pa.list_(pa.int64())), ("response_tokens", pa.list_(pa.string())),
        ("behaviour_logprobs", pa.list_(pa.float64())), ("teacher_logprobs", pa.list_(pa.float64())),
        ("marks", pa.list_(pa.string())),
    ])
    return pa.schema([
        ("step", pa.int64()), ("kind", pa.string()), ("episode", pa.int64()), ("task", pa.string()),
        ("sample", pa.int64()), ("turn_budget", pa.int64()), ("success", pa.bool_()), ("end_reason", pa.string()),
        ("error", pa.string()), ("total_reward", pa.float64()), ("task_prompt", pa.string()),
        ("turns", pa.list_(turn)),
    ])


class RunEpisodes:
    """A run's :class:`opd.algorithms.base.EpisodeRecorder`: training samples every
    ``every`` steps and at the first and the ``last_step`` (so a short run's report has its
    teacher colours too; ``every = 0``: never), and every evaluation episode, under
    ``run_dir/trajectories``.

    ``tokenizers`` decodes each role's ids (the teacher's may differ from the student's).
    :attr:`seconds` accumulates the time spent writing training samples, which the driver
    reports per step as ``time/trajectory_write_s`` (part of ``time/step_s``).
    """

    def __init__(self, run_dir: Path, tokenizers: dict[str, Any], every: int, episodes: int,
                 last_step: int | None = None):
        self.dir = Path(run_dir) / "trajectories"
        self.tokenizers = tokenizers
        self.every = every
        self.last_step = last_step
        self.episodes = episodes
        self.seconds = 0.0
        # A bare machine without pyarrow trains on, without episode files (opd.optional).
        self.enabled = optional_module("pyarrow.parquet", "the episode files trajectories/*.parquet",
                                       "pyarrow") is not None

    def train_sample(self, step, trajs, scores=None, marks=None) -> None:
        if not self.enabled or not self.every or (step % self.every and step not in (1, self.last_step)):
            return
        start = time.perf_counter()
        n = self.episodes
        rows = episode_rows(trajs[:n], self.tokenizers["student"], step, "train", scores[:n] if scores else None, marks)
        write_episodes(self.dir / f"train_step_{step}.parquet", rows)
        self.seconds += time.perf_counter() - start

    def evaluation(self, step, who, trajs) -> None:
        if not self.enabled:
            return
        write_episodes(self.dir / f"eval_{who}_step_{step}.parquet", episode_rows(trajs, self.tokenizers[who], step,
                                                                                  f"eval/{who}"))

    def take_seconds(self) -> float:
        """The writing time since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
