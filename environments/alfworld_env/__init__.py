"""ALFWorld on the official engine: generated games for the six task types, or the official game files.

Modules:
    generator: rooms and PDDL problems for the six task types, deterministic from (split, index).
    games: generated games cached on disk, or the official ``json_2.1.1`` games.
    env: :class:`ALFWorldTextEnv`, the gymnasium environment (``opd/ALFWorldText-v0``).

Importing this package registers the env; the ``alfworld`` package is imported only when an env
builds a game, so ``import environments`` works without it.

Example:
    >>> from opd.envs import make_env
    >>> env = make_env("opd/ALFWorldText-v0", n_train_tasks=60, n_eval_tasks=12)
    >>> obs, info = env.reset(seed=0, options={"task": "alfgen-look_at_obj_in_light-eval-00001"})
"""

from __future__ import annotations

import gymnasium

from environments.alfworld_env.env import ALFWorldTextEnv

__all__ = ["ALFWorldTextEnv"]

if "opd/ALFWorldText-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/ALFWorldText-v0", entry_point="environments.alfworld_env:ALFWorldTextEnv")
