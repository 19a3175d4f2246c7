"""The tasks that `python -m zoo task=NAME` runs: the model card, training on synthetic data, decoding,
verification with the spec suite, and comparison with reference implementations."""
