"""Module-level clauses: multi-head attention, feed-forward, norms, positional schemes and layers."""
