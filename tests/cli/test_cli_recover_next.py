"""kvj recover's "next:" line names what resumes the work it planned (issue 41 item 13): a
training journal is continued by the training run, never by "the server"; vLLM requests by
resume(llm, MANIFEST)."""

from __future__ import annotations

import os

from support.cli_helpers import block, build, in_process, segment_file

from kvj.integrations.vllm.resuming import START_FORMAT
from kvj.journal.journal import Journal


def _next(capsys, path: str) -> str:  # type: ignore[no-untyped-def]
    proc = in_process(capsys, "recover", "-j", path)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("next: "), proc.stdout
    return last


def test_a_training_journal_is_resumed_by_the_training_run(tmp_path, capsys):
    path = str(tmp_path / "train")
    build(path, requests=0, ended=0, training=True)  # a checkpoint at step 10, deltas to step 12
    line = _next(capsys, path)
    assert line.startswith("next: restart training: it continues from step 12 (Trainer: "
                           "resume_from_checkpoint=cb.resume(trainer) with KvjCallback, DCP: JournalReader("), line
    assert "recover_training" in line and "server" not in line


def test_vllm_requests_are_resumed_by_resume_in_an_engine(tmp_path, capsys):
    path = str(tmp_path / "serve")
    with Journal.open(path) as j:
        j.start("chat-1", tokens=[1, 2, 3], meta={"format": START_FORMAT})
        j.flush("chat-1", 0, block(1, 0), token_range=(0, 16)).result()
        j.sync()
    manifest = os.path.join(path, "recovery", "manifest-000001.json")
    line = _next(capsys, path)
    assert line == (f'next: resume the vLLM requests in an engine with KvjConnector: resume(llm, "{manifest}") '
                    "(kvj.integrations.vllm.resuming)"), line


def test_each_kind_of_work_is_named_and_damage_last(tmp_path, capsys):
    path = str(tmp_path / "mixed")
    written = build(path, requests=1, blocks=2, ended=0, training=True)  # a request of no integration
    with Journal.open(path) as j:
        j.start("chat-1", tokens=[1, 2, 3], meta={"format": START_FORMAT})
        j.sync()
    os.unlink(segment_file(path, written["keys"]["req-0"][1]))
    steps = _next(capsys, path)[len("next: "):].split("; ")
    assert [s.split(":")[0] for s in steps] == ["resume the vLLM requests in an engine with KvjConnector",
                                                "start the server", "restart training",
                                                f"then look at the damage with kvj fsck -j {path} (kvj fsck --repair moves "
                                                "damaged segments to quarantine)"], steps


def test_nothing_to_resume_says_so(tmp_path, capsys):
    path = str(tmp_path / "idle")
    build(path, requests=0, ended=1, training=False)
    assert _next(capsys, path) == "next: nothing to resume (no request in flight, no training state)"
