"""Concrete opd environments; importing this package registers each with gymnasium.

Environments:
    opd/FrozenLakeText-v0: FrozenLake as text (``environments.frozenlake.FrozenLakeTextEnv``).

Add an environment by writing a ``gymnasium.Env`` that follows the contract in
``opd.envs`` and registering it below under a versioned ``opd/`` id.
"""

from __future__ import annotations

import gymnasium


def _register(env_id: str, entry_point: str) -> None:
    # Re-imports (e.g. importlib.reload in tests) must not re-register: gymnasium warns on overrides.
    if env_id not in gymnasium.registry:
        # No max_episode_steps: each env enforces its own max_turns and reports truncation itself.
        gymnasium.register(id=env_id, entry_point=entry_point)


_register("opd/FrozenLakeText-v0", "environments.frozenlake:FrozenLakeTextEnv")
