"""The hand-built meta and batches, and the tiny checkpointing recipe (tests/model_inputs.py)."""

from tests.model_inputs import batch_factory, tiny_meta, tiny_recipe  # noqa: F401
