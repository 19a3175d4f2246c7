"""The spec suite's run as a whole (properties/plugin/suite.py calls ``configure`` and registers this module for its
hooks): its Hypothesis profiles and seed, SIGTERM as Ctrl-C.

Hypothesis profiles (select with Hypothesis' own ``--hypothesis-profile``): ``default`` (few examples, so
the whole suite stays fast), ``ci`` (the same, derandomized: reproducible runs), ``thorough`` (many
examples).  All disable the deadline: kernel timings vary with the device, its warm-up and other load.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from properties.plugin import targets_suite

__all__ = ["PROFILE_NAMES", "configure", "write_seed", "pytest_report_header", "pytest_unconfigure"]

# No "explain" phase: its report names lines of the assertion helpers, never the property's cause.
_PHASES = tuple(p for p in Phase if p != Phase.explain)
# filter_too_much: a kernel with limits declines problems (properties/kernel/limits.py), each a rejected example; a
# clause it declines entirely is skipped by properties/kernel/coverage.py before Hypothesis would give up.
_DEFAULT = settings(max_examples=12, deadline=None, phases=_PHASES, suppress_health_check=[HealthCheck.filter_too_much])
_PROFILES = {
    "default": _DEFAULT,
    "ci": settings(_DEFAULT, derandomize=True, print_blob=True),
    "thorough": settings(_DEFAULT, max_examples=400),
    # `python -m zoo` (the default task) checks the assembled model in seconds; `task=verify` runs `default`.
    "quick": settings(_DEFAULT, max_examples=3),
    # Only the @example shapes pinned for known bug classes: a seconds-long smoke run, and the check that no
    # catalogued bug depends on a lucky draw (python -m properties.catalog.mutation_report --profile pinned).
    # The first failing example ends the test (report_multiple_bugs off): a catalogued bug is caught on its
    # first pinned shape without running the others.
    "pinned": settings(_DEFAULT, phases=(Phase.explicit,), report_multiple_bugs=False),
}
PROFILE_NAMES = tuple(_PROFILES)   # --hypothesis-profile values the suite registers


def _use_suite_profiles() -> None:
    """Register the suite's profiles (``default`` among them, replacing Hypothesis' own) and load ``default``."""
    for name, profile in _PROFILES.items():
        settings.register_profile(name, profile)
    settings.load_profile("default")


_SEED = pytest.StashKey[int]()


def _fix_seed(config) -> None:
    """Every suite run has one Hypothesis seed, printed in the header and after failures, so that a failure
    reproduces with --hypothesis-seed=N (given, it is honoured; otherwise one is drawn)."""
    seed = getattr(config.option, "hypothesis_seed", None)
    if seed is None:
        import random
        seed = random.SystemRandom().randrange(2**31)
        config.option.hypothesis_seed = seed   # Hypothesis' plugin reads it after this hook (tryfirst)
    config.stash[_SEED] = seed
    from properties.kernel.tiles import set_run_seed
    set_run_seed(seed)   # the run's head sizes (properties/kernel/tiles.py, run_choice)


def pytest_report_header(config):
    if _SEED in config.stash:
        seed = config.stash[_SEED]
        return f"spec suite: Hypothesis seed {seed} (reproduce with --hypothesis-seed={seed})"


def write_seed(terminalreporter, config) -> None:
    """After failures: the seed that reproduces them."""
    if _SEED in config.stash and terminalreporter.stats.get("failed"):
        seed = config.stash[_SEED]
        terminalreporter.write_line(f"spec suite: reproduce these failures with --hypothesis-seed={seed} "
                                    f"(the counterexamples above are also kept in .hypothesis/)")


_SIGTERM = pytest.StashKey[object]()


def _interrupt_on_sigterm(config) -> None:
    """SIGTERM ends the run as Ctrl-C does (KeyboardInterrupt): fixtures tear down and pytest-xdist stops its
    workers, instead of the process vanishing and leaving its children running. Restored at unconfigure."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        config.stash[_SIGTERM] = signal.signal(signal.SIGTERM, interrupt)


def pytest_unconfigure(config):
    if _SIGTERM in config.stash:
        import signal
        signal.signal(signal.SIGTERM, config.stash[_SIGTERM])


def configure(config) -> None:
    """For a run that collects the suite: its profiles (``default`` loaded), one seed, SIGTERM as Ctrl-C."""
    if targets_suite(config):
        _use_suite_profiles()
        _fix_seed(config)
        _interrupt_on_sigterm(config)
