"""Training: the loop (in-process or one Ray Train worker), evaluation, FLOPs and MFU."""
