"""Text-to-SQL over generated SQLite databases (InterCode-SQL style); see ``environments.sql_env.env``.

Importing this package registers ``opd/SQLText-v0``.
"""

from __future__ import annotations

import gymnasium

from environments.sql_env.env import SQLTask, SQLTextEnv

__all__ = ["SQLTask", "SQLTextEnv"]

if "opd/SQLText-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/SQLText-v0", entry_point="environments.sql_env:SQLTextEnv")
