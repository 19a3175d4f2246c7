"""Benchmarks of the zoo against PyTorch and Hugging Face: ``python -m bench --help``."""
