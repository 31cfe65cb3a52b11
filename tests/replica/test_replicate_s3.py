"""Replication against a real S3 endpoint (moto's server on 127.0.0.1): round trip through
restore, create-only segments, the CAS manifest, the lease and its fencing, remote GC with
the grace rules, verify, and 409 treated like 412."""

from __future__ import annotations

import os
import time

import obstore
import pytest
import torch
from obstore.exceptions import GenericError

from kvj import Journal
from kvj.errors import CorruptionError
from kvj.journal.replay import replay
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.replica import manifest as mf
from kvj.replica.lease import Fenced, LeaseHeld
from kvj.replica.remote import LostRace, open_remote
from kvj.replica.pull import restore
from kvj.replica.ship import Diverged, Replicator
from kvj.replica.verify import verify_remote
from kvj.segments.store import SegmentStore

POLICY = CommitPolicy(max_delay=0.001, file_size_limit=4096)


def tensor(i: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(i))


def write_requests(j: Journal, first: int, n: int, ends: range = range(0)) -> None:
    """Requests ``first``..``first+n-1`` with one segment each, then the ends of requests ``ends``."""
    for i in range(first, first + n):
        j.start(f"r{i}", tokens=[i])
        j.flush(f"r{i}", 0, tensor(i), token_range=(0, 16), layout={"model": "t"}).result()
        j.alloc("cuda:0", i, 4096, "kv")
    for i in ends:
        j.end(f"r{i}")
    j.sync()


def same_state(a: str, b: str) -> None:
    x, y = replay(a).to_dict(), replay(b).to_dict()
    for d in (x, y):
        d.pop("tail")
        d.pop("snapshot_lsn")
        d.pop("first_lsn")
        d.pop("counts")
    assert x == y


def test_round_trip_through_compaction_restore_and_verify(s3, tmp_path):
    src, remote = str(tmp_path / "src"), open_remote(s3)
    with Journal.open(src, policy=POLICY) as j, Replicator(src, remote) as rep:
        write_requests(j, 0, 30)
        first = rep.round()
        assert first.committed and first.segments_uploaded == 30 and first.parts_uploaded >= 2
        write_requests(j, 30, 10, ends=range(20))
        compact(src, grace=3600)
        second = rep.round()
        assert second.snapshot_lsn is not None and second.segments_uploaded == 10
        assert rep.round().committed is False  # nothing new: no upload, no manifest write
        write_requests(j, 40, 2)  # records after the snapshot, however far the snapshot reached
        third = rep.round()
        last = j.sync()
    m, _ = mf.load(remote)
    assert m.last_lsn == last == third.last_lsn and m.snapshot.lsn == second.snapshot_lsn
    assert all(e.sealed == (e is not m.logs[-1]) for e in m.logs)
    assert all(len(e.parts) == 1 for e in m.logs if e.sealed), "a sealed log's parts are consolidated"

    out = str(tmp_path / "restored")
    result = restore(remote, out)
    assert result.last_lsn == last and result.segments == 22
    same_state(src, out)
    with SegmentStore(os.path.join(src, "segments")) as a, SegmentStore(os.path.join(out, "segments")) as b:
        for key in replay(out).referenced_keys():
            assert bytes(b.read_stored(key)) == bytes(a.read_stored(key))
    report = verify_remote(remote)
    assert report.ok and report.segments_needed == 22 and report.segments_read == 22, report.problems

    at = m.snapshot.lsn + 3
    earlier = str(tmp_path / "earlier")
    assert restore(remote, earlier, at_lsn=at).last_lsn == at
    assert replay(earlier).to_dict()["requests"] == replay(src, at_lsn=at).to_dict()["requests"]
    when = str(tmp_path / "when")
    assert restore(remote, when, at_time=m.history[-1][0]).last_lsn == last


def test_segments_are_create_only_and_an_identical_object_is_success(s3, tmp_path, moto):
    src, remote = str(tmp_path / "src"), open_remote(s3)
    with Journal.open(src, policy=POLICY) as j:
        write_requests(j, 0, 3)
        with SegmentStore(os.path.join(src, "segments")) as store, Replicator(src, remote) as rep:
            keys = sorted(store.keys())
            # another upload of the same segment lands between the listing and this round
            assert remote.put_create(mf.segment_object(keys[0]), bytes(store.read_stored(keys[0]))) is not None
            assert remote.put_create(mf.segment_object(keys[0]), b"other bytes") is None  # If-None-Match: *
            assert rep.round().segments_uploaded == 3  # the identical object counts as shipped
            write_requests(j, 3, 1)
            new = (set(store.keys()) - set(keys)).pop()
            remote.put_create(mf.segment_object(new), b"not the segment")
            with pytest.raises(CorruptionError, match="different bytes"):
                rep.round()
    bucket, prefix = s3[5:].split("/", 1)
    moto.client().put_object(Bucket=bucket, Key=f"{prefix}/{mf.segment_object(keys[1])}", Body=b"damaged")
    report = verify_remote(remote)
    assert not report.ok and any(keys[1] in p for p in report.problems)


def test_two_replicators_one_lease_takeover_after_expiry_fences_the_old_holder(s3, tmp_path):
    src, remote = str(tmp_path / "src"), open_remote(s3)
    later = [0.0]
    with Journal.open(src, policy=POLICY) as j:
        write_requests(j, 0, 5)
        old = Replicator(src, remote, owner="node-a", lease_ttl=30).open()
        old.round()
        with pytest.raises(LeaseHeld, match="node-a"):
            Replicator(src, remote, owner="node-b").open()
        # node-a stalls past its lease; node-b's clock is past the expiry
        new = Replicator(src, remote, owner="node-b", clock=lambda: time.time() + 60 + later[0]).open()
        assert new.lease.generation == old.lease.generation + 1
        write_requests(j, 5, 5)
        with pytest.raises(Fenced, match="node-b"):
            old.round()  # its lease renewal fails: nothing it uploads is committed
        old.lease.expires_at = time.time() + 1000  # even if it believed its lease still valid...
        with pytest.raises(Fenced):
            old._commit(mf.Manifest(generation=old.lease.generation))  # ...the manifest CAS fences it
        m, _ = mf.load(remote)
        assert m.generation == new.lease.generation
        assert new.round().committed
        new.close()
        old.pool.shutdown()
    m, _ = mf.load(remote)
    assert m.last_lsn == replay(src).last_lsn
    assert all(f".g{new.lease.generation}." in p.object or f".g{old.lease.generation}." in p.object
               for e in m.logs for p in e.parts)
    # the lease was released: a third replicator acquires it at once, with a newer generation
    with Replicator(src, remote, owner="node-c") as third:
        assert third.lease.generation == new.lease.generation + 1


def test_remote_gc_follows_local_compaction_after_the_grace(s3, tmp_path):
    src, remote = str(tmp_path / "src"), open_remote(s3)
    now = [time.time()]
    with Journal.open(src, policy=POLICY) as j, Replicator(src, remote, grace=100, clock=lambda: now[0]) as rep:
        write_requests(j, 0, 20)
        rep.round()
        m0, _ = mf.load(remote)
        write_requests(j, 20, 5, ends=range(10))  # r0..r9 end: their segments may go
        write_requests(j, 25, 20)  # so that a log file after the ends is sealed, and folded
        result = compact(src, grace=0)
        assert len(result.segments_removed) == 10 and result.logs_removed
        rep.round()
        m1, _ = mf.load(remote)
        gone = {mf.segment_object(k) for k in result.segments_removed}
        dropped = set(m0.objects()) - set(m1.objects())
        assert dropped and gone | dropped <= set(m1.garbage), "no longer needed: garbage, not yet deleted"
        present = {o.path for p in ("segments/", "logs/") for o in remote.list(p)}
        assert gone <= present and dropped <= present, "nothing is deleted inside the grace period"
        now[0] += 101
        assert rep.round().objects_deleted == len(gone | dropped)
        present = {o.path for p in ("segments/", "logs/", "snapshots/") for o in remote.list(p)}
        assert not (gone | dropped) & present
        assert set(mf.load(remote)[0].objects()) <= present
    out = str(tmp_path / "out")
    restore(remote, out)
    same_state(src, out)
    assert verify_remote(remote).ok


def test_a_replica_of_another_journal_is_refused(s3, tmp_path):
    remote = open_remote(s3)
    for name in ("a", "b"):
        with Journal.open(str(tmp_path / name), policy=POLICY) as j:
            write_requests(j, 0, 2)
    with Replicator(str(tmp_path / "a"), remote) as rep:
        rep.round()
    with Replicator(str(tmp_path / "b"), remote) as rep, pytest.raises(Diverged, match="another journal"):
        rep.round()


def test_verify_finds_missing_segments_and_damaged_parts_and_samples(s3, tmp_path, moto):
    src, remote = str(tmp_path / "src"), open_remote(s3)
    with Journal.open(src, policy=POLICY) as j, Replicator(src, remote) as rep:
        write_requests(j, 0, 20)
        rep.round()
    sampled = verify_remote(remote, sample=0.25, seed=7)
    assert sampled.ok and sampled.segments_read == 5 and sampled.segments_present == 20
    m, _ = mf.load(remote)
    bucket, prefix = s3[5:].split("/", 1)
    s3c = moto.client()
    key = sorted(replay(src).referenced_keys())[0]
    s3c.delete_object(Bucket=bucket, Key=f"{prefix}/{mf.segment_object(key)}")
    part = m.logs[0].parts[0].object
    body = bytearray(s3c.get_object(Bucket=bucket, Key=f"{prefix}/{part}")["Body"].read())
    body[-3] ^= 0xFF
    s3c.put_object(Bucket=bucket, Key=f"{prefix}/{part}", Body=bytes(body))
    report = verify_remote(remote, seed=1)
    assert not report.ok and any("digest the manifest recorded" in p for p in report.problems)
    with pytest.raises(CorruptionError):
        restore(remote, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out"), "a failed restore leaves nothing under the target name"
    s3c.put_object(Bucket=bucket, Key=f"{prefix}/{part}", Body=bytes(body[:-3] + bytes([body[-3] ^ 0xFF]) + body[-2:]))
    report = verify_remote(remote, seed=1)
    assert [p for p in report.problems if key in p and "missing" in p] and len(report.problems) == 1


def test_409_conditional_request_conflict_is_a_lost_race(s3, monkeypatch):
    remote = open_remote(s3)

    def conflict(*args, **kwargs):
        raise GenericError("Server returned non-2xx status code: 409 Conflict: <Code>ConditionalRequestConflict</Code>")

    monkeypatch.setattr(obstore, "put", conflict)
    with pytest.raises(LostRace):
        remote.put_if_match("manifest.json", b"{}", '"etag"')
    assert remote.put_create("segments/x", b"x") is None
