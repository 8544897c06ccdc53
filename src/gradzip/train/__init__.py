"""The training harness: datasets, models, the training loop, metrics."""
