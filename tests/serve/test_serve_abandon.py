"""Abandoning (issue 38 item 3): ``kvj recover --abandon ID|--abandon-all`` ends in-flight requests on
purpose, journaled in the engine journal and kvj serve's reply journal, so that nothing resumes them;
``kvj recover``'s next line says that ``kvj serve`` resumes the requests it served."""

from __future__ import annotations

import os

from support.cli_helpers import kvj

import kvj as lib
from kvj.serve.paths import replies_dir
from kvj.serve.replies import REPLY_FORMAT


def served_journal(path: str) -> None:
    """An engine journal with two kvj serve requests and a plain one in flight, and their replies."""
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 2, "max_tokens": 8, "sampling": {}, "stop_ids": []}
    with lib.Journal.open(path) as j:
        j.start("e-a", None, [1, 2], {**meta, "client": "chatcmpl-a"})
        j.tokens("e-a", 2, [3])
        j.start("e-b", None, [1, 2], {**meta, "client": "chatcmpl-b"})
        j.start("e-plain", None, [1, 2], meta)
    with lib.Journal.open(replies_dir(path)) as j:
        for key in ("chatcmpl-a", "chatcmpl-b"):
            j.start(key, "h", None, {"format": REPLY_FORMAT, "kind": "chat", "body": {}, "created": 1, "stream": True})


def test_abandon_ends_a_reply_and_its_engine_requests_and_the_next_line_names_kvj_serve(tmp_path):
    path = str(tmp_path / "j")
    served_journal(path)
    dry = kvj("recover", "-j", path, "--abandon", "chatcmpl-a", "--dry-run")
    assert dry.returncode == 0 and "would abandon request e-a" in dry.stdout and "would abandon reply chatcmpl-a" in dry.stdout
    assert not lib.replay(path).requests["e-a"].ended  # a dry run changed nothing
    proc = kvj("recover", "-j", path, "--abandon", "chatcmpl-a")
    assert proc.returncode == 0, proc.stderr
    engine, replies = lib.replay(path), lib.replay(replies_dir(path))
    assert engine.requests["e-a"].status == "abandoned" and not engine.requests["e-b"].ended
    assert replies.requests["chatcmpl-a"].status == "abandoned" and not replies.requests["chatcmpl-b"].ended
    next_line = proc.stdout.strip().splitlines()[-1]
    assert next_line.startswith("next: start kvj serve on this journal again") and f"--journal {path}" in next_line
    assert "resume(llm" in next_line  # e-plain: the connector without kvj serve, resumed offline


def test_abandon_all_ends_everything_in_flight_and_an_unknown_id_changes_nothing(tmp_path):
    path = str(tmp_path / "j")
    served_journal(path)
    unknown = kvj("recover", "-j", path, "--abandon", "chatcmpl-zz")
    assert unknown.returncode == 66 and "chatcmpl-zz" in unknown.stderr and "Traceback" not in unknown.stderr
    assert not lib.replay(path).requests["e-a"].ended
    proc = kvj("recover", "-j", path, "--abandon-all")
    assert proc.returncode == 0, proc.stderr
    assert lib.replay(path).in_flight() == [] and lib.replay(replies_dir(path)).in_flight() == []
    assert "next: nothing to resume" in proc.stdout
    assert os.path.isdir(os.path.join(path, "recovery"))


def test_abandon_is_refused_while_kvj_serve_holds_the_journal(tmp_path):
    path = str(tmp_path / "j")
    served_journal(path)
    with lib.Journal.open(replies_dir(path)):  # the server's writer lock
        proc = kvj("recover", "-j", path, "--abandon", "chatcmpl-a")
    assert proc.returncode == 75 and "Traceback" not in proc.stderr
    assert not lib.replay(path).requests["e-a"].ended
