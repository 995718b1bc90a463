"""The hand-built dataset meta and batches of the model tests, for the model variant's tests."""

from tests.model_inputs import batch_factory, tiny_meta  # noqa: F401
