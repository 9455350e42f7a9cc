"""Concrete opd environments; importing this package registers each with gymnasium.

Environments (``opd envs`` lists them with one line each; docs in ``docs/envs/``):
    opd/FrozenLakeText-v0: FrozenLake as text (gymnasium's engine).
    opd/ALFWorldText-v0: ALFWorld household tasks (official PDDL engine, generated or official games).
    opd/ScienceWorldText-v0: ScienceWorld's 30 tasks (official engine, Java).
    opd/TextWorldText-v0, opd/TextWorldExpressText-v0: generated text games.
    opd/BFCLMultiTurn-v0: BFCL multi-turn tool calling (official backend and checker).
    opd/SQLText-v0: text-to-SQL over generated SQLite databases.
    opd/ClinicalWorkup-v0: a clinical work-up simulator (refill triage, diagnosis, titration).
    opd/PromptDataset-v0: single-turn prompts from a dataset file (GKD-style distillation, GRPO).
    opd/Mix-v0: several of these in one run (a recipe's ``env.mix``; :mod:`opd.mixture`).

Registration is lazy (an entry-point string): an engine is imported only when its env is made.

Add an environment by writing a ``gymnasium.Env`` that follows the contract in
``opd.envs`` (``environments.base.TextEnv`` holds what every one here shares: reset, the step
guards, the turn budget and the common info keys) and registering it below under a versioned
``opd/`` id.
"""

from __future__ import annotations

import gymnasium


def _register(env_id: str, entry_point: str) -> None:
    # Re-imports (e.g. importlib.reload in tests) must not re-register: gymnasium warns on overrides.
    if env_id not in gymnasium.registry:
        # No max_episode_steps: each env enforces its own max_turns and reports truncation itself.
        gymnasium.register(id=env_id, entry_point=entry_point)


_register("opd/FrozenLakeText-v0", "environments.frozenlake:FrozenLakeTextEnv")
_register("opd/ALFWorldText-v0", "environments.alfworld_env:ALFWorldTextEnv")
_register("opd/ScienceWorldText-v0", "environments.scienceworld_env:ScienceWorldTextEnv")
_register("opd/TextWorldText-v0", "environments.textworld_env:TextWorldTextEnv")
_register("opd/TextWorldExpressText-v0", "environments.textworld_express_env:TextWorldExpressTextEnv")
_register("opd/BFCLMultiTurn-v0", "environments.bfcl_env:BFCLMultiTurnEnv")
_register("opd/SQLText-v0", "environments.sql_env:SQLTextEnv")
_register("opd/ClinicalWorkup-v0", "environments.clinical:ClinicalWorkupEnv")
_register("opd/PromptDataset-v0", "environments.prompt_dataset:PromptDatasetEnv")
# A recipe's env.mix: several of the above in one run (opd.mixture, docs/teachers.md).
_register("opd/Mix-v0", "opd.mixture:MixedEnv")
