"""Shared machinery of the spec suite: the clause registry, tolerance model, kernel oracle, strategies,
statistics, assertions, the `Subject` contract of a model under test, and the watchdog every call of the code
under test runs inside."""
