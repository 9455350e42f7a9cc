"""Evaluation: success on held-out tasks (:mod:`opd.evaluation.heldout`), run reports, progress
and plots (:mod:`opd.evaluation.report`)."""
