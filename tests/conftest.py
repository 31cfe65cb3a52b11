"""Prints the figures of the crash, kill, corruption and I/O-error suite (crash states
checked, kills survived, corruption detection rate) in pytest's terminal summary, marks
the unit tier, and makes a skip of a ``ci_required`` test a failure under CI
(``support/ci_skips.py``)."""

import pytest

from support.ci_skips import pytest_configure, pytest_runtest_makereport  # noqa: F401  (hooks of this conftest)


#: The unit tier, for the edit loop (``./quickstart test -m unit``, about a minute): files whose
#: tests start no engine, server or crash run. A fast new file joins by being named here.
UNIT = frozenset({
    "tests/bench/test_bench_journal.py",
    "tests/bench/test_bench_verify.py",
    "tests/cli/test_cli_budget.py",
    "tests/cli/test_cli_docs.py",
    "tests/cli/test_cli_dump.py",
    "tests/cli/test_cli_launch_exit.py",
    "tests/cli/test_cli_messages.py",
    "tests/cli/test_cli_ndjson.py",
    "tests/cli/test_cli_output.py",
    "tests/cli/test_cli_recover_next.py",
    "tests/cli/test_cli_seed_era.py",
    "tests/cli/test_cli_time_arguments.py",
    "tests/crash/test_checker_catches_a_wrong_fold.py",
    "tests/crash/test_collect_crash.py",
    "tests/integrations/test_training_capture.py",
    "tests/integrations/test_training_delta.py",
    "tests/integrations/test_training_device.py",
    "tests/integrations/test_training_resume.py",
    "tests/integrations/test_vllm_serving.py",
    "tests/integrations/test_vllm_worker.py",
    "tests/journal/test_flush_checks.py",
    "tests/journal/test_follow.py",
    "tests/journal/test_framing.py",
    "tests/journal/test_legacy.py",
    "tests/journal/test_main_fixture.py",
    "tests/journal/test_ordering.py",
    "tests/journal/test_spec.py",
    "tests/journal/test_time_and_resume.py",
    "tests/journal/test_writer.py",
    "tests/ops/test_compact.py",
    "tests/ops/test_flush.py",
    "tests/ops/test_prefix_cache.py",
    "tests/ops/test_prune.py",
    "tests/ops/test_status_walk.py",
    "tests/replica/test_manifest.py",
    "tests/replica/test_stored_bytes.py",
    "tests/segments/test_codecs.py",
    "tests/segments/test_device_blocks.py",
    "tests/segments/test_flusher.py",
    "tests/segments/test_layout.py",
    "tests/segments/test_load.py",
    "tests/segments/test_stored_segments.py",
    "tests/segments/test_streaming_verify.py",
    "tests/serve/test_serve_abandon.py",
    "tests/serve/test_serve_join.py",
    "tests/serve/test_serve_ops.py",
    "tests/serve/test_serve_shm.py",
    "tests/serve/test_serve_wire.py",
    "tests/spec/test_limits.py",
    "tests/spec/test_schema_rules.py",
    "tests/spec/test_segment_page.py",
    "tests/spec/test_spec_hf.py",
    "tests/spec/test_spec_vllm.py",
    "tests/test_trust.py",
})


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in UNIT and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


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
