"""opd: on-policy distillation of multi-turn LLM agents.

The loop, box by box (see DESIGN.md):

- ``opd.rollout``: the student plays environments and yields :class:`opd.trajectory.Trajectory`.
- ``opd.supervision``: the teacher's view of each turn and the teacher's scores.
- ``opd.losses``: the loss registry; ``opd.algorithms``: one file per algorithm.
- ``opd.training``: the DeepSpeed student trainer, checkpoints and HF export.
- ``opd.runtime``: Ray actors and the driver loop; ``opd.cli``: the ``opd`` command.
"""

__version__ = "0.1.0"
