"""Ablation sweeps: a spec of arms x seeds run on Ray Tune as MLflow parent/child runs,
compared per arm with confidence intervals and regression gates."""
