"""Ablation sweeps: decide whether a precision, attention or loader change is safe.

- ``config``: the sweep spec (base recipe, arms as overrides or a grid, seeds, concurrency),
  resolved into one validated recipe per arm.
- ``runner`` + ``trial``: Ray Tune runs one function trainable per (arm, seed); each trial is
  a real training run recorded as an MLflow child run of the sweep's parent run. The same
  command resumes an interrupted sweep without duplicate runs.
- ``compare`` + ``stats`` + ``plot``: per arm, NE/AUC per task as mean +- std over seeds, the
  delta to the baseline arm with a 95% interval (paired over seeds when both arms ran the
  same seeds, Welch otherwise), efficiency metrics, regression gates,
  and an NE-vs-step PNG logged to the parent run.
- ``inprocess`` + ``results``: the same trials run one after another in this process (no Ray,
  no MLflow: a lone GPU box), written to a JSON results file that ``compare`` reads like a
  sweep id.
- ``runs``: recent runs for ``gemctl runs``.
- ``store``: the MLflow tags and queries these share.

CLI: ``gemctl sweep recipes/ablations/attention.yaml``, ``gemctl compare SWEEP_ID
--max-ne-regression 0.1%``, ``gemctl runs``.
"""
