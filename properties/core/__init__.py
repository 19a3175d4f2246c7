"""Shared machinery of the spec suite: the clause registry, tolerance model, kernel oracle, strategies,
statistics, assertions and the `Subject` contract of a model under test."""
