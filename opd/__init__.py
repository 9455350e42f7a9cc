"""opd: on-policy distillation of multi-turn LLM agents.

The loop, box by box, bottom layer first (docs/architecture.md has the layers and contracts):

- ``opd.schema``, ``opd.trajectory``, ``opd.chat``: the recipe's schema, the data that flows, and
  ChatML rendering in token ids.
- ``opd.generation`` (inference engines), ``opd.envs`` (the environment contract), ``opd.models``.
- ``opd.rollout``: the student plays environments and yields :class:`opd.trajectory.Trajectory`;
  ``opd.supervision``: the teacher's view of each turn and its scores; ``opd.losses``.
- ``opd.training``: the DeepSpeed student trainer and checkpoints.
- ``opd.algorithms``: one file per algorithm; ``opd.evaluation``; ``opd.provisioning``: models.
- ``opd.config``: loading and validating a recipe.
- ``opd.runtime``: Ray actors and the driver loop; ``opd.cli``: the ``opd`` command.
"""

__version__ = "0.1.0"
