"""Checkpoints of a training run: the store (write, commit, find the newest intact one), the
manifest that marks a checkpoint whole, the intactness check, and resharding to another
parallel layout on resume."""
