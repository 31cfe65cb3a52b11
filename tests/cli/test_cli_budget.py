"""The store's byte budget on the command line: kvj init --max-store-bytes records it,
kvj compact --max-store-bytes (or the recorded one) evicts down to it, kvj status shows it
and the store's hit rate; a bad size is a usage error (64) that changes nothing."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from support.cli_helpers import assert_fails, in_process, kvj, tree

from kvj.journal.config import CONFIG, default_store_path
from kvj.journal.journal import Journal
from kvj.segments.store import SegmentStore


def block(i: int) -> torch.Tensor:
    return torch.randn(2, 16, 2, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def filled(path, n: int = 6):
    """A journal whose store holds ``n`` unreferenced blocks, stored 10 minutes ago, block 0
    the least recently used; one in-flight request references block ``n``. The keys, in order."""
    with SegmentStore(default_store_path(str(path)), count_loads=True) as store:
        with Journal.open(path, store=store) as j:
            j.start("live", durable=True)
            live = store.put(block(n))
            j.flush("live", 0, info=live, token_range=(0, 16)).result()
            j.sync()
        keys = [store.put(block(i)).key for i in range(n)]
        for key in keys[1:]:
            store.get(key)
        with pytest.raises(Exception):
            store.get("ab" * 32)  # asked, not served
        t = time.time() - 600
        for key in keys + [live.key]:
            os.utime(store.backend.path(key), (t, t))
        size = store.stat(keys[0]).size
    return keys, live.key, size


def test_compact_evicts_the_least_recently_used_down_to_the_budget(tmp_path, capsys):
    path = tmp_path / "j"
    keys, live, size = filled(path)
    total = 7 * size  # roughly: blocks of random bf16 compress alike
    proc = in_process(capsys, "compact", "-j", path, "--max-store-bytes", str(4 * size + size // 2), "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    with SegmentStore(default_store_path(str(path))) as store:
        left = set(store.keys())
        held = sum(store.stat(k).size for k in left)
    assert live in left and res["segments_evicted"] == keys[:len(res["segments_evicted"])]
    assert held <= 4 * size + size // 2 < total and res["store_bytes"] == held and res["over_budget"] == 0
    assert len(res["segments_evicted"]) >= 2
    proc = in_process(capsys, "compact", "-j", path, "--max-store-bytes", "0")
    assert proc.returncode == 0, proc.stderr
    assert "least recently used segments: the store holds " in proc.stdout and " over it in segments needed" in proc.stdout
    with SegmentStore(default_store_path(str(path))) as store:
        assert set(store.keys()) == {live}


def test_the_budget_kvj_init_records_is_the_default_and_status_shows_it_with_the_hit_rate(tmp_path, capsys):
    path = tmp_path / "j"
    proc = kvj("init", "-j", path, "--max-store-bytes", "1MiB")
    assert proc.returncode == 0, proc.stderr
    assert "of at most 1.0 MiB" in proc.stdout
    with open(path / CONFIG) as f:
        assert json.load(f)["max_store_bytes"] == 1 << 20
    keys, live, size = filled(path)
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["store"]["max_store_bytes"] == 1 << 20
    assert s["store"]["loads"] == {"served": 5, "asked": 6, "hit_rate": 5 / 6}
    text = in_process(capsys, "status", "-j", path).stdout
    assert "of a 1.0 MiB budget (" in text and "5 of 6 served from the store (hit rate 83.3%)" in text
    config = json.loads((path / CONFIG).read_text())
    config["max_store_bytes"] = 2 * size + size // 2
    (path / CONFIG).write_text(json.dumps(config))
    res = json.loads(in_process(capsys, "compact", "-j", path, "--json").stdout)
    assert res["max_store_bytes"] == 2 * size + size // 2 and res["segments_evicted"] == keys[:len(res["segments_evicted"])]
    assert len(res["segments_evicted"]) >= 4
    config["max_store_bytes"] = "lots"
    (path / CONFIG).write_text(json.dumps(config))
    before = tree(path)
    assert_fails(in_process(capsys, "compact", "-j", path), 65, "'max_store_bytes' must be a non-negative integer")
    assert tree(path) == before
    assert "'max_store_bytes' must be" in json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)["config_error"]


@pytest.mark.parametrize("args, needle", [
    (["--max-store-bytes", "lots"], "'lots' is not a size"),
    (["--max-store-bytes", "-5"], "is not a size"),
    (["--max-store-bytes", "1G", "--no-segments"], "cannot go with --no-segments"),
])
def test_a_bad_budget_is_a_usage_error_that_changes_nothing(tmp_path, capsys, args, needle):
    path = tmp_path / "j"
    filled(path, 2)
    before = tree(path)
    assert_fails(in_process(capsys, "compact", "-j", path, *args), 64, needle)
    assert tree(path) == before


def test_kvj_init_refuses_a_bad_budget_and_creates_nothing(tmp_path):
    path = tmp_path / "j"
    assert_fails(kvj("init", "-j", path, "--max-store-bytes", "12 parsecs"), 64, "--max-store-bytes", "not a size")
    assert not path.exists()
