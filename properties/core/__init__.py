"""Shared machinery of the spec suite, what every level uses: the clause registry, tolerance model, float64 oracle,
dtypes and devices, strategies of general use, assertions, the `Subject` contract of a model under test, the zoo
config of a run, and the watchdog every call of the code under test runs inside."""
