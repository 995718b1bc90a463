"""Data path: jagged batches, synthetic data with a planted ground truth, Parquet shards,
MovieLens conversion and batch balancing."""
