"""opd: on-policy distillation of multi-turn LLM agents.

The loop, box by box, bottom layer first (docs/architecture.md has the layers and contracts):

- ``opd.schema``, ``opd.trajectory``, ``opd.chat``, ``opd.progress``: the recipe's schema, the data
  that flows, ChatML rendering in token ids, and the one progress display.
- ``opd.generation`` (inference engines), ``opd.envs`` (the environment contract), ``opd.models``.
- ``opd.rollout``: the student plays environments and yields :class:`opd.trajectory.Trajectory`;
  ``opd.supervision``: the teacher's view of each turn and its scores; ``opd.losses``.
- ``opd.training``: the DeepSpeed student trainer and checkpoints.
- ``opd.algorithms``: one file per algorithm; ``opd.evaluation``; ``opd.bootstrap``: where models come from.
- ``opd.config``: loading and validating a recipe.
- ``opd.runtime``: the worker classes, Ray actors and the driver; ``opd.cli``: the ``opd`` command.
"""

__version__ = "0.1.0"
