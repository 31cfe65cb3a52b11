"""Prints the figures of the crash, kill, corruption and I/O-error suite (crash states
checked, kills survived, corruption detection rate) in pytest's terminal summary, and
makes a skip of a ``ci_required`` test a failure under CI (``support/ci_skips.py``)."""

from support.ci_skips import pytest_configure, pytest_runtest_makereport  # noqa: F401  (hooks of this conftest)


def pytest_terminal_summary(terminalreporter):
    try:
        from support.crashcheck import FIGURES
    except ImportError:  # the crash suite was not collected
        return
    if FIGURES:
        terminalreporter.section("kvj crash-suite figures")
        for name, value in sorted(FIGURES.items()):
            shown = f"{value:.4g}" if isinstance(value, float) and not value.is_integer() else f"{int(value)}"
            terminalreporter.write_line(f"{name}: {shown}")
