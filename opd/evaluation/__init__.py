"""Evaluation: success on held-out tasks (:mod:`~opd.evaluation.heldout`), pass@k over turn budgets
(:mod:`~opd.evaluation.passk`), matched-state comparisons (:mod:`~opd.evaluation.compare`), the
episode files (:mod:`~opd.evaluation.trajectories`), the run directory's reader
(:mod:`~opd.evaluation.run_dir`), the console's progress line, summary and plot
(:mod:`~opd.evaluation.report`), the HTML report (:mod:`~opd.evaluation.html_report`) and opd's
losses against TRL's (:mod:`~opd.evaluation.trl_parity`)."""
