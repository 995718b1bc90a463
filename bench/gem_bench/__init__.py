"""Benchmarks of the platform as users meet it: only gemctl imports this package, and nothing in
gem_platform or gem_kernels imports it. Its off-the-shelf model parts reach the model by name,
as the model variant ``baseline`` declared in pyproject.toml's entry points
(gem_platform.model_variants)."""
