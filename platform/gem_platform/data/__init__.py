"""Data path: jagged batches, synthetic data with a planted ground truth, Parquet shards (local
or in object storage) read into memory or streamed through a bounded window, MovieLens
conversion, and the loader that pairs a table with its batcher."""
