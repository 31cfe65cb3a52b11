"""Under CI, a test marked ``ci_required`` that skips is a failure.

Some tests need what a developer's machine may lack: a private mount namespace (``unshare
-rm``: read-only mounts, the incident walkthrough's small disk), root (planted device nodes,
the root-owner checks) or ``setpriv``. They skip where it is missing, saying why. A CI run
must not pass having skipped them, so with ``CI`` set to true (GitHub Actions and GitLab set
``CI=true`` on every job; ``.ci/run`` sets it when unset) such a skip is reported as a failure
that names what the machine lacks.
"""

from __future__ import annotations

import os

import pytest

MARKER = "ci_required"


def in_ci() -> bool:
    """Whether this run is a CI run (``CI`` is true, 1 or yes)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: needs something of the machine (a private mount namespace, "
                                       "root, setpriv) and may skip without it, but not in CI (CI=true): there a "
                                       "skip is a failure")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and item.get_closest_marker(MARKER) is not None and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI={os.environ['CI']}, where it must run ({MARKER}): {reason}. "
                           "Give the CI machine what it lacks, or run it elsewhere and say so.")
