"""Hostile replica contents against the real CLI and moto's S3 server: manifests and leases
crafted to traverse paths, overflow numbers, nest without end or declare absurd sizes, and
objects that are not what the manifest or the journal declares. Each is refused with exit
status 65 (75 for a live lease) and one clear line, never 70 "internal error"; nothing is
written outside the restore target, no read goes past the size declared for an object,
and a lease can neither hold forever nor print escape sequences to the terminal."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import Callable, Dict, List

import obstore
import pytest
import torch

from kvj import Journal
from kvj.journal.replay import replay
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.replica import manifest as mf
from kvj.replica.lease import MAX_TTL, Fenced, Lease, LeaseHeld
from kvj.replica.remote import open_remote
from kvj.replica.ship import Replicator
from support.s3 import set_env

POLICY = CommitPolicy(max_delay=0.001, file_size_limit=4096)


def _requests(j: Journal, first: int, n: int) -> None:
    for i in range(first, first + n):
        j.start(f"r{i}")
        tensor = torch.randn(32, 32, generator=torch.Generator().manual_seed(i))
        j.flush(f"r{i}", 0, tensor, token_range=(0, 16)).result()
        j.alloc("cuda:0", i, 4096, "kv")
    j.sync()


@pytest.fixture(scope="module")
def source(moto, tmp_path_factory):
    """A small replica built once (a snapshot, sealed and open logs, segments); each test
    copies it to a bucket of its own. Returns (journal, bucket)."""
    with pytest.MonkeyPatch.context() as mp:
        set_env(mp, moto.url)
        bucket = moto.new_bucket()
        journal = str(tmp_path_factory.mktemp("source") / "j")
        with Journal.open(journal, policy=POLICY) as j:
            _requests(j, 0, 8)
            for i in range(6):
                j.end(f"r{i}")
            _requests(j, 8, 8)  # so that the ends are in a sealed log, folded into the snapshot
            assert compact(journal, grace=3600).snapshot_lsn
            _requests(j, 16, 1)
        with Replicator(journal, open_remote(f"s3://{bucket}/replica")) as rep:
            rep.round()
    return journal, bucket


class Replica:
    """A copy of the source replica in a fresh bucket, and ways to spoil it."""

    def __init__(self, moto, source_bucket: str, url: str):
        self.client = moto.client()
        self.bucket, self.prefix = url[5:].split("/", 1)
        self.url = url
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=source_bucket):
            for obj in page.get("Contents", []):
                self.client.copy_object(Bucket=self.bucket, Key=obj["Key"],
                                        CopySource={"Bucket": source_bucket, "Key": obj["Key"]})
        self.manifest = json.loads(self.get(mf.MANIFEST_OBJECT))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=body)

    def put_manifest(self, doc) -> None:
        self.put(mf.MANIFEST_OBJECT, doc if isinstance(doc, bytes) else json.dumps(doc).encode())


@pytest.fixture
def replica(source, moto, s3):
    return Replica(moto, source[1], s3)


def kvj_here(capsys, *argv: str):
    """The kvj CLI run in this process: (exit status, stdout, stderr)."""
    from kvj.cli.main import app, run

    capsys.readouterr()
    status = run(app, list(argv), "kvj")
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def one_clear_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvj: error: "), stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
    assert "\x1b" not in stderr and "\0" not in stderr, repr(stderr)
    return lines[0]


def tree(path) -> List[str]:
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(path) for n in dirs + files)


def _part(doc) -> Dict:
    return doc["logs"][-1]["parts"][0]


def _set(path: Callable[[Dict], Dict], key: str, value) -> Callable[[Dict], bytes]:
    def spoil(doc: Dict) -> bytes:
        path(doc)[key] = value
        return json.dumps(doc).encode()
    return spoil


def _raw(key: str, text: str) -> Callable[[Dict], bytes]:
    """Replace the value of top-level ``key`` by ``text`` (not JSON that json.dumps would write)."""
    def spoil(doc: Dict) -> bytes:
        doc[key] = "@@"
        return json.dumps(doc).replace('"@@"', text).encode()
    return spoil


def _huge_part(doc: Dict) -> bytes:
    """The last log declared 10^18 bytes long, its part renamed to match (names stay consistent)."""
    entry = doc["logs"][-1]
    entry["size"] = part_end = 10 ** 18
    part = entry["parts"] = [entry["parts"][0]]
    part[0]["end"] = part_end
    part[0]["object"] = mf.part_object(entry["seq"], 0, part_end, doc["generation"])
    return json.dumps(doc).encode()


MANIFESTS = {
    "part ../../../etc/passwd": _set(_part, "object", "../../../etc/passwd"),
    "part logs/../manifest.json": _set(_part, "object", "logs/../manifest.json"),
    "part with a NUL": _set(_part, "object", "logs/0000000000000001/\0.part"),
    "part /etc/passwd": _set(_part, "object", "/etc/passwd"),
    "part of another log": _set(_part, "object", mf.part_object(99, 0, 10, 1)),
    "snapshot ../x": _set(lambda d: d["snapshot"], "object", "../x"),
    "garbage entry with ..": _set(lambda d: d, "garbage", {"segments/../../../x": 0.0}),
    "garbage entry absolute": _set(lambda d: d, "garbage", {"/etc/passwd": 0.0}),
    "garbage time Infinity": lambda d: json.dumps({**d, "garbage": {"@@": 1}}).replace(
        '"@@": 1', f'"{mf.snapshot_object(1, 1)}": Infinity').encode(),
    "generation 1e309": _raw("generation", "1e309"),
    "last_lsn Infinity": _raw("last_lsn", "Infinity"),
    "updated NaN": _raw("updated", "NaN"),
    "last_lsn of 400 digits": _raw("last_lsn", "9" * 400),
    "last_lsn of 5000 digits": _raw("last_lsn", "9" * 5000),
    "seq negative": _set(lambda d: d["logs"][0], "seq", -1),
    "seq true": _set(lambda d: d["logs"][0], "seq", True),
    "size a string": _set(lambda d: d["logs"][0], "size", "12"),
    "logs an object": _set(lambda d: d, "logs", {}),
    "history nested": _raw("history", "[" * 100 + "]" * 100),
    "declares a 10^18-byte log": _huge_part,
    "manifest nested 10^5 levels": lambda d: b"[" * 100_000 + b"]" * 100_000,
    "manifest nested 10^6 levels": lambda d: b'{"a":' * 1_000_000 + b"1" + b"}" * 1_000_000,
    "manifest not UTF-8": lambda d: b"\xff\xfe{}",
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_hostile_manifest_is_refused_with_status_65_and_nothing_written(case, replica, source, tmp_path, capsys):
    """Regression: these raised ValueError (obstore "Could not parse path"), OverflowError,
    RecursionError or TypeError: exit 70 "internal error"; the 10^18-byte log was restored
    and verified "ok"."""
    replica.put_manifest(MANIFESTS[case](replica.manifest))
    before = tree(tmp_path)
    target = tmp_path / "restored"
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(target))
    line = one_clear_line(stderr)
    assert status == 65, line
    assert not target.exists() and tree(tmp_path) == before, "a refused restore left files behind"
    status, stdout, stderr = kvj_here(capsys, "verify", "--remote", replica.url)
    assert status == 65 and "problem: " in stdout and not stderr, stdout + stderr
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--grace", "0s")
    assert status == 65, one_clear_line(stderr)
    assert tree(tmp_path) == before


LEASES = {
    "nested 10^5 levels": b"[" * 100_000 + b"]" * 100_000,
    "larger than a lease": json.dumps({"owner": "x" * 10_000, "generation": 1, "expires_at": 0}).encode(),
    "generation 1e309": b'{"owner": "x", "generation": 1e309, "expires_at": 0}',
    "expires_at Infinity": b'{"owner": "x", "generation": 9, "expires_at": Infinity}',
    "expires_at NaN": b'{"owner": "x", "generation": 9, "expires_at": NaN}',
    "expires_at a string": b'{"owner": "x", "generation": 9, "expires_at": "soon"}',
    "owner not a string": b'{"owner": 7, "generation": 9, "expires_at": 0}',
    "not an object": b"[1, 2]",
}


@pytest.mark.parametrize("case", list(LEASES))
def test_a_lock_json_that_is_no_lease_is_refused_then_replaced_deliberately(case, replica, source, capsys):
    """Regression: nesting raised RecursionError and a 1e309 generation OverflowError (70);
    an Infinity expiry held the lease forever ("for inf s more"). Now 65 naming the way out,
    which works: --break-lease unreadable."""
    replica.put("lock.json", LEASES[case])
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url)
    line = one_clear_line(stderr)
    assert status == 65 and "is not a kvj lease" in line and "--break-lease unreadable" in line, line
    status, stdout, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--break-lease",
                                      "unreadable", "--json")
    assert status == 0 and "broke the lease of unreadable" in stderr, stderr
    lease = json.loads(replica.get("lock.json"))
    assert lease["generation"] == json.loads(stdout)["generation"] > replica.manifest["generation"]
    assert lease["expires_at"] == 0.0  # released again at the end of the run


def test_a_lease_expiring_in_the_year_3e292_ends_an_hour_after_it_was_written(replica, source, capsys):
    """Regression: expires_at 1e300 held the lease forever ("for 1000...(300 digits) s more")."""
    replica.put("lock.json", json.dumps({"owner": "node-x", "generation": 5, "expires_at": 1e300}).encode())
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url)
    line = one_clear_line(stderr)
    assert status == 75 and "node-x" in line, line
    left = int(line.split(" for ")[1].split(" s more")[0])
    assert 0 < left <= MAX_TTL, line
    remote = open_remote(replica.url)
    lease = Lease(remote, owner="node-y", clock=lambda: time.time() + MAX_TTL + 60)
    assert lease.acquire() == 6  # an hour after lock.json was written, its lease is over


@pytest.mark.parametrize("expires_at", [0, -5, -1e308, 1.5])
def test_a_lease_that_expired_long_ago_is_taken(expires_at, replica, source, capsys):
    replica.put("lock.json", json.dumps({"owner": "node-x", "generation": 5, "expires_at": expires_at}).encode())
    status, stdout, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--json")
    assert status == 0 and json.loads(stdout)["generation"] == 6 and not stderr, stderr


def test_an_owner_with_escape_sequences_is_printed_escaped_and_only_its_lease_is_broken(replica, source, capsys):
    """Regression: an owner with ANSI escapes was printed raw to the terminal, and there was no
    way to break a lease before it expired."""
    evil = "\x1b[2J\x1b[31mnode-x\x1b[0m\x07"
    replica.put("lock.json", json.dumps({"owner": evil, "generation": 5, "expires_at": time.time() + 600}).encode())
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url)
    line = one_clear_line(stderr)
    shown = "\\x1b[2J\\x1b[31mnode-x\\x1b[0m\\x07"
    assert status == 75 and shown in line and f"--break-lease '{shown}'" in line, line
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--break-lease", "node-x")
    assert status == 75 and "nothing was broken" in one_clear_line(stderr)
    assert json.loads(replica.get("lock.json"))["owner"] == evil, "a wrong holder name broke the lease"
    status, stdout, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--json",
                                      "--break-lease", shown)
    assert status == 0 and json.loads(stdout)["generation"] == 6, stderr
    assert "\x1b" not in stderr and f"broke the lease of {shown}" in stderr, repr(stderr)


def test_breaking_a_live_holders_lease_fences_it_out(replica, source, capsys):
    """A holder that still runs loses its next round (Fenced), never the replica its consistency."""
    remote = open_remote(replica.url)
    live = Replicator(source[0], remote, owner="node-a").open()
    try:
        assert live.round().last_lsn == replica.manifest["last_lsn"]
        status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url)
        assert status == 75 and "node-a" in one_clear_line(stderr)
        status, stdout, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--json",
                                          "--break-lease", "node-a")
        assert status == 0 and json.loads(stdout)["generation"] == live.lease.generation + 1, stderr
        live.lease.expires_at = 0.0  # it renews before its next commit...
        with pytest.raises(Fenced):
            live.round()  # ...and finds its lease taken
    finally:
        live.pool.shutdown()
    status, stdout, _ = kvj_here(capsys, "verify", "--remote", replica.url)
    assert status == 0 and stdout.strip().endswith("ok"), stdout


@pytest.mark.parametrize("ttl", ["0s", "2h"])
def test_a_lease_ttl_out_of_range_is_a_usage_error(ttl, replica, source, capsys):
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--lease-ttl", ttl)
    assert status == 64 and "lease TTL" in one_clear_line(stderr)


def test_lease_held_names_the_holder_escaped():
    err = LeaseHeld("s3://b/p", "a\nb\x1bc", time.time() + 10, time.time())
    assert "\n" not in str(err) and "\x1b" not in str(err) and "a\\nb\\x1bc" in str(err)


# -- objects that are not what is declared (item 7) -----------------------------------------------

@pytest.fixture
def body_reads(monkeypatch):
    """Bytes of each object's body that kvj pulled from the object store, per object."""
    reads: Dict[str, List[int]] = defaultdict(list)
    real = obstore.get

    class Counting:
        def __init__(self, result, path: str):
            self._result, self._path = result, path

        @property
        def meta(self):
            return self._result.meta

        def bytes(self):
            data = self._result.bytes()
            reads[self._path].append(len(data))
            return data

        def stream(self, *args, **kwargs):
            for piece in self._result.stream(*args, **kwargs):
                reads[self._path].append(len(piece))
                yield piece

    monkeypatch.setattr(obstore, "get", lambda store, path, *a, **k: Counting(real(store, path, *a, **k), path))
    return reads


def _junk(n: int) -> bytes:
    return os.urandom(1 << 16) * (n >> 16)


def test_a_junk_part_larger_than_declared_is_refused_unread(replica, tmp_path, capsys, body_reads):
    """Regression: restore read a 60 MiB junk object declared as a few KiB whole before checking
    it (peak RSS 320 -> 442 MB). Its size is now compared with the manifest's first."""
    part = replica.manifest["logs"][0]["parts"][0]
    replica.put(part["object"], _junk(16 << 20))
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(tmp_path / "out"))
    line = one_clear_line(stderr)
    assert status == 65 and f"{part['end'] - part['start']} are declared (not read)" in line, line
    assert sum(body_reads[part["object"]]) == 0, body_reads[part["object"]]
    status, stdout, _ = kvj_here(capsys, "verify", "--remote", replica.url)
    assert status == 65 and "are declared (not read)" in stdout
    assert sum(sum(r) for r in body_reads.values()) < 1 << 20, {k: sum(v) for k, v in body_reads.items()}


def test_a_part_declared_larger_than_its_object_is_refused_unread(replica, tmp_path, capsys, body_reads):
    """5 GiB declared (the most one upload holds), the real object renamed to match."""
    doc = replica.manifest
    entry = doc["logs"][-1]
    part = entry["parts"][-1]
    real = replica.get(part["object"])
    part["end"] = part["start"] + mf.MAX_OBJECT_BYTES
    entry["size"] = part["end"]
    part["object"] = mf.part_object(entry["seq"], part["start"], part["end"], doc["generation"])
    replica.put(part["object"], real)
    replica.put_manifest(doc)
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(tmp_path / "out"))
    line = one_clear_line(stderr)
    assert status == 65 and f"holds {len(real)} bytes, {mf.MAX_OBJECT_BYTES} are declared" in line, line
    assert sum(body_reads[part["object"]]) == 0


def test_a_junk_segment_larger_than_its_record_declares_is_refused_unread(replica, source, tmp_path, capsys,
                                                                        body_reads):
    key = sorted(replay(source[0]).referenced_keys())[-1]
    obj = mf.segment_object(key)
    replica.put(obj, _junk(20 << 20))  # more than its stored size plus the largest header
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(tmp_path / "out"))
    line = one_clear_line(stderr)
    assert status == 65 and key in line and "the journal declares" in line, line
    assert sum(body_reads[obj]) == 0
    status, stdout, _ = kvj_here(capsys, "verify", "--remote", replica.url)
    assert status == 65 and key in stdout and sum(body_reads[obj]) == 0


def test_a_junk_snapshot_is_refused_unread(replica, tmp_path, capsys, body_reads):
    obj = replica.manifest["snapshot"]["object"]
    replica.put(obj, _junk(4 << 20))
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(tmp_path / "out"))
    assert status == 65 and "are declared (not read)" in one_clear_line(stderr)
    assert sum(body_reads[obj]) == 0


@pytest.mark.parametrize("name", ["logs/notes.txt", "snapshots/x.snap", "segments/zz/evil.kvjseg",
                                  "logs/0000000000000001/x.part"])
def test_objects_kvj_did_not_write_are_left_alone(name, replica, source, capsys):
    """An object under the replica's prefix that kvj did not write is neither deleted as
    garbage nor written into the manifest (which would then be refused)."""
    replica.put(name, b"someone else's")
    for _ in range(2):
        status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url, "--grace", "0s")
        assert status == 0, stderr
    assert replica.get(name) == b"someone else's"
    assert name not in json.loads(replica.get(mf.MANIFEST_OBJECT))["garbage"]
    status, stdout, _ = kvj_here(capsys, "verify", "--remote", replica.url)
    assert status == 0, stdout


@pytest.mark.parametrize("name,restored", [("snapshots/../../x.snap", 0), ("segments/ab/../../../etc/passwd", 65)])
def test_an_object_whose_name_is_not_a_path_is_reported_not_an_io_error(name, restored, replica, source, tmp_path,
                                                                         capsys):
    """S3 keys may hold "..": the object store client cannot list past one (it was exit 74, "I/O
    error"). It is 65, naming the object to remove; restore lists only segments/."""
    replica.put(name, b"planted")
    status, _, stderr = kvj_here(capsys, "replicate", "-j", source[0], "--to", replica.url)
    line = one_clear_line(stderr)
    assert status == 65 and "kvj did not write" in line and name in line, line
    status, _, stderr = kvj_here(capsys, "restore", "--from", replica.url, "-j", str(tmp_path / "out"))
    assert status == restored, stderr
    if restored:
        assert name in one_clear_line(stderr)
