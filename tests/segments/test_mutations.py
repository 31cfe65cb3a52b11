"""Every wait, event and record_stream on kvj's device paths matters: deleted one at a time
(tests/support/mutants.py lists them), some device-path test fails under the strict CUDA
stand-in, and that test passes on the unchanged code. Also the vLLM connector's old defect,
a CPU-into-CUDA ``index_copy_``, reintroduced, fails."""

from __future__ import annotations

import time

import pytest
from support import mutants


@pytest.fixture(scope="module")
def cases():
    return mutants.cases()


def test_every_wait_event_and_record_stream_is_needed(cases):
    t0 = time.perf_counter()
    survivors, killers, rows = [], {}, []
    for site in mutants.SITES:
        found = mutants.first_killer(site, cases)
        if found is None:
            survivors.append(site.name)
            continue
        case, exc = found
        killers[case.id] = case
        first_line = (str(exc).splitlines() or [""])[0][:110]
        rows.append(f"  {site.name}\n      killed by {case.id}: {type(exc).__name__}: {first_line}")
    for case in killers.values():  # a kill counts only if the test passes on kvj as it is
        exc = mutants.run(case)
        assert exc is None, f"{case.id} fails on the unchanged code: {exc!r}"
    print(f"\n{len(mutants.SITES)} mutation sites, {len(cases)} device-path cases, "
          f"{time.perf_counter() - t0:.1f} s:\n" + "\n".join(rows))
    assert not survivors, "no test fails without:\n  " + "\n  ".join(survivors)


def test_a_cpu_index_copy_into_a_cuda_cache_fails(cases):
    found = mutants.first_killer(mutants.CPU_INTO_CUDA, cases)
    assert found is not None
    case, exc = found
    assert "same device" in str(exc) and "cpu" in str(exc), f"{case.id}: {exc!r}"


def test_a_site_whose_code_changed_is_reported_not_skipped():
    site = mutants.Site(mutants.D, "Cuda.wait", "event.wait_for_godot()")
    with pytest.raises(AssertionError, match="occurs 0 times"):
        with mutants.mutated(site):
            pass


def test_a_mutant_is_undone_after_its_block():
    from kvj.segments import device

    site = mutants.SITES[0]
    before = device.Cuda.wait.__code__
    with mutants.mutated(site):
        assert device.Cuda.wait.__code__ is not before
    assert device.Cuda.wait.__code__ is before
