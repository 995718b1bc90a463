"""Benchmarks of the platform as users meet it: only gemctl imports this package, and nothing in
gem_platform or gem_kernels imports it."""
