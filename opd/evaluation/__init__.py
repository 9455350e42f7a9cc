"""Evaluation: success on held-out tasks, run reports and plots."""
