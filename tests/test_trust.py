"""The root-owner trust policy is the library's (kvj.trust): ``Journal.open``, ``SegmentStore``
and ``init`` run as root refuse a directory another user owns, or others may write, unless
KVJ_TRUST_OWNER=1, whoever calls them (issue 23 item 5)."""

from __future__ import annotations

import os

import pytest
import torch

import kvj
from kvj.errors import UnsafePath
from kvj.ops.init import init
from kvj.segments.store import SegmentStore

NOBODY = 65534

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the owner check applies to kvj run as root; this run is not")


@pytest.fixture
def untrusted(monkeypatch):
    monkeypatch.delenv("KVJ_TRUST_OWNER", raising=False)


def _journal(path) -> str:
    with kvj.Journal.open(path) as j:
        j.start("r")
    return str(path)


@as_root
def test_journal_open_refuses_a_journal_another_user_owns_unless_trusted(tmp_path, untrusted, monkeypatch):
    path = _journal(tmp_path / "j")
    os.chown(path, NOBODY, NOBODY)
    before = sorted(os.listdir(path))
    with pytest.raises(UnsafePath, match=f"belongs to uid {NOBODY}.*KVJ_TRUST_OWNER=1"):
        kvj.Journal.open(path)
    assert sorted(os.listdir(path)) == before  # refused before the lock file or a log file was touched
    monkeypatch.setenv("KVJ_TRUST_OWNER", "1")
    with kvj.Journal.open(path) as j:
        j.end("r", durable=True)
    assert kvj.replay(path).requests["r"].ended


@as_root
@pytest.mark.parametrize("mode,gid,who", [(0o777, 0, "everyone"), (0o770, NOBODY, f"group gid {NOBODY}")],
                         ids=["world-writable", "group-writable"])
def test_journal_open_refuses_a_root_journal_others_may_write(tmp_path, untrusted, mode, gid, who):
    path = _journal(tmp_path / "j")
    os.chown(path, 0, gid)
    os.chmod(path, mode)
    with pytest.raises(UnsafePath, match=f"writable by {who}"):
        kvj.Journal.open(path)
    os.chown(path, 0, 0)
    os.chmod(path, 0o770)  # writable by root's group only: root's own, as logrotate has it
    kvj.Journal.open(path).close()


@as_root
def test_journal_open_refuses_another_users_store_at_open(tmp_path, untrusted, monkeypatch):
    path = _journal(tmp_path / "j")
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"{store} belongs to uid {NOBODY}"):
        kvj.Journal.open(path, store=str(store))
    os.makedirs(os.path.join(path, "segments"))
    os.chown(os.path.join(path, "segments"), NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"segments belongs to uid {NOBODY}"):
        kvj.Journal.open(path)  # the journal's own store, the default
    monkeypatch.setenv("KVJ_TRUST_OWNER", "1")
    with kvj.Journal.open(path, store=str(store)) as j:
        j.flush("r", 0, torch.ones(4, 2), token_range=(0, 4)).result()


@as_root
def test_segment_store_refuses_a_directory_another_user_owns(tmp_path, untrusted, monkeypatch):
    root = tmp_path / "store"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"belongs to uid {NOBODY}"):
        SegmentStore(root)
    assert os.listdir(root) == []
    monkeypatch.setenv("KVJ_TRUST_OWNER", "1")
    with SegmentStore(root) as store:
        assert torch.equal(store.get(store.put(torch.arange(8)).key), torch.arange(8))


@as_root
def test_init_refuses_another_users_directory_before_writing(tmp_path, untrusted):
    target = tmp_path / "new"
    target.mkdir()
    os.chown(target, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"belongs to uid {NOBODY}"):
        init(str(target))
    assert os.listdir(target) == []  # no kvj.conf left behind


def test_not_root_nothing_is_refused(tmp_path, untrusted, monkeypatch):
    path = _journal(tmp_path / "j")
    os.chmod(path, 0o777)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the policy is root's alone
    kvj.Journal.open(path).close()
