"""The replica's required failure scenarios against moto's S3 server: the node (writer and
replicator) SIGKILLed while replicating, then its disk wiped and the journal restored on a
fresh directory; the endpoint killed mid-upload and refusing requests for a while; two
replicators on one replica through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import torch

from kvj import Journal
from kvj.journal.replay import replay
from kvj.journal.writer import CommitPolicy
from kvj.replica import manifest as mf
from kvj.replica.remote import open_remote
from kvj.replica.restore import restore
from kvj.replica.ship import Replicator
from kvj.replica.verify import verify_remote
from kvj.segments.store import SegmentStore
from support.cli_helpers import KVJ, env, kvj
from support.kill import Tally, check_journal_after_kill, kill, side_lines, spawn, wait_ready
from support.s3 import s3_env
from support.wait import wait_for


def _acked(child) -> int:
    acked = 0
    for line in side_lines(child):
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("A", "S"):
            acked = max(acked, int(parts[1]))
    return acked


def _manifest_lsn(remote) -> int:
    m, _ = mf.load(remote)
    return m.last_lsn if m else 0


def test_node_killed_while_replicating_then_disk_wiped_restores_every_replicated_record(s3, moto, tmp_path):
    journal, side = str(tmp_path / "node" / "journal"), str(tmp_path / "side")
    os.makedirs(side)
    remote = open_remote(s3)
    seed = 5150
    print(f"seed {seed}")
    child = spawn(journal, side, 1, seed, flush=True)
    wait_ready(child)
    rep = subprocess.Popen([*KVJ, "replicate", "-j", journal, "--to", s3, "--follow", "--interval", "0.1s", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**s3_env(moto.url)))
    try:
        wait_for(lambda: _acked(child) > 200 and any(l.startswith("S ") for l in side_lines(child)),
                 "the writer to acknowledge flushes", 120)
        acked = _acked(child)
        wait_for(lambda: _manifest_lsn(remote) >= acked, "a replication round past the acknowledged LSN", 120)
    finally:
        kill(child)
        rep.send_signal(signal.SIGKILL)
        rep.wait(30)
    assert rep.returncode == -signal.SIGKILL, rep.stderr.read()
    last_round = _manifest_lsn(remote)
    shutil.rmtree(tmp_path / "node")  # the local disk is gone

    fresh = str(tmp_path / "fresh")
    result = restore(remote, fresh)
    assert result.last_lsn == last_round >= acked
    tally = Tally()
    # every record acknowledged before the round is there, each exactly as appended, no holes,
    # and every restored segment is bit-exactly the tensor that was flushed
    assert check_journal_after_kill(fresh, acked, tally) == last_round
    assert tally.segments_checked > 0
    assert verify_remote(remote).ok
    proc = kvj("fsck", "-j", fresh)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_endpoint_down_mid_upload_and_refusing_then_back_loses_and_duplicates_nothing(relay, moto, tmp_path):
    bucket = moto.new_bucket()
    remote = open_remote(f"s3://{bucket}/replica", retries=1, timeout=2.0)
    journal = str(tmp_path / "j")
    stop, failures, rounds = threading.Event(), [], []
    big = torch.randn(1024, 1024)  # 4 MiB: an upload that is in flight when the relay goes down
    with Journal.open(journal, policy=CommitPolicy(max_delay=0.001, file_size_limit=16 << 10)) as j, \
            Replicator(journal, remote, threads=2) as rep:
        worker = threading.Thread(target=rep.follow, args=(0.05, stop, rounds.append, failures.append))
        worker.start()
        try:
            for i in range(20):
                j.start(f"q{i}")
                j.flush(f"q{i}", 0, big + i, token_range=(0, 16)).result()
            wait_for(lambda: relay.connections > 0, "an upload to start")
            relay.down()
            down_at = j.sync()
            # the writer goes on at full speed while the endpoint refuses everything
            t0 = time.monotonic()
            for i in range(200):
                j.alloc("cpu", i, 64, "while-down", durable=True)
            assert time.monotonic() - t0 < 30
            wait_for(lambda: len(failures) >= 2, "rounds to fail against the dead endpoint")
            assert _manifest_lsn_direct(moto, bucket) < j.sync()
            relay.up()
            last = j.sync()
            wait_for(lambda: _manifest_lsn_direct(moto, bucket) >= last, "replication to catch up", 120)
        finally:
            stop.set()
            worker.join(60)
    assert down_at < last and failures and rounds
    m, _ = mf.load(remote)
    m.check("manifest")  # parts tile every log exactly: nothing twice, nothing missing
    out = str(tmp_path / "out")
    restore(remote, out)
    assert replay(out).to_dict()["allocations"] == replay(journal).to_dict()["allocations"]
    assert replay(out).last_lsn == replay(journal).last_lsn
    with SegmentStore(os.path.join(journal, "segments")) as local:
        keys = set(local.keys())
    remote_keys = {mf.segment_key(o.path) for o in remote.list("segments/")}
    assert remote_keys == keys  # one object per key: a retried upload never duplicates
    assert verify_remote(remote).ok


def _manifest_lsn_direct(moto, bucket: str) -> int:
    """The manifest's LSN read past the relay (the test's own view of the endpoint)."""
    try:
        body = moto.client().get_object(Bucket=bucket, Key="replica/manifest.json")["Body"].read()
    except Exception:  # not written yet
        return 0
    return json.loads(body)["last_lsn"]


def test_cli_second_replicator_is_refused_naming_the_holder_and_restore_refuses_a_used_directory(s3, moto, tmp_path,
                                                                                                capsys):
    journal = str(tmp_path / "j")
    with Journal.open(journal) as j:
        j.start("a")
        j.flush("a", 0, torch.ones(8, 8), token_range=(0, 8)).result()
        j.sync()
    e = s3_env(moto.url)
    first = subprocess.Popen([*KVJ, "replicate", "-j", journal, "--to", s3, "--follow", "--interval", "0.1s"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**e))
    try:
        wait_for(lambda: _manifest_lsn(open_remote(s3)) >= 2, "the first replicator's round", 60)
        status, _, stderr = _kvj_here(capsys, "replicate", "-j", journal, "--to", s3)
        assert status == 75 and "leased by another replicator" in stderr
        assert f":{first.pid}:" in stderr, stderr  # names the holder (host:pid:...)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    assert first.returncode == 0, first.stderr.read()
    status, stdout, stderr = _kvj_here(capsys, "replicate", "-j", journal, "--to", s3, "--json")
    assert status == 0 and json.loads(stdout)["last_lsn"] == 2, stderr  # the lease was released
    os.makedirs(tmp_path / "used")
    open(tmp_path / "used" / "x", "w").close()
    status, _, stderr = _kvj_here(capsys, "restore", "--from", s3, "-j", str(tmp_path / "used"))
    assert status == 64 and "not empty" in stderr
    status, stdout, stderr = _kvj_here(capsys, "restore", "--from", s3, "-j", str(tmp_path / "new"))
    assert status == 0 and "through LSN 2" in stdout, stderr
    status, stdout, stderr = _kvj_here(capsys, "verify", "--remote", s3)
    assert status == 0 and stdout.strip().endswith("ok"), stdout + stderr
    status, _, stderr = _kvj_here(capsys, "verify", "--remote", s3 + "-missing")
    assert status == 66 and "no replica here" in stderr


def _kvj_here(capsys, *argv: str):
    """Run the kvj CLI in this process (fast); (exit status, stdout, stderr)."""
    from kvj.cli.main import app, run

    capsys.readouterr()
    status = run(app, list(argv), "kvj")
    captured = capsys.readouterr()
    return status, captured.out, captured.err
