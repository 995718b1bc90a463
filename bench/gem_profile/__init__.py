"""Where a training step's time goes: the recipe trained a few steps under torch.profiler, the
time by kind of kernel, the device's idle gaps and the host threads' time by site. Only the
top floor (gemctl and gem_bench) imports this package; nothing in gem_platform or gem_kernels
does."""
