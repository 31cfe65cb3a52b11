"""kvj serve's start-up join of the reply journal and the engine journal (``kvj.serve.restore.join``),
the reply record's fold, and the retention and budget selection: fast, no engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import kvj
from kvj.journal.records import RecordType
from kvj.serve.replies import REPLY_FORMAT, Reply
from kvj.serve.restore import Incarnation, incarnations, join
from kvj.serve.retention import doomed


def replies_journal(path: str, replies: Dict[str, Any]) -> "kvj.JournalState":
    """A reply journal holding ``replies``: key -> (tokens released, REPLY fields or None)."""
    with kvj.Journal.open(path) as j:
        for key, (tokens, end) in replies.items():
            j.start(key, "h", None, {"format": REPLY_FORMAT, "kind": "chat", "body": {"model": "m"}, "created": 7,
                                     "stream": True, "engine_id": key, "admission": "arrival"})
            if tokens:
                j.tokens(key, 0, tokens)
            if end is not None:
                j.append(RecordType.REPLY, {"id": key, "count": len(tokens), "at": 100.0, **end})
    return kvj.replay(path)


def inc(jid: str, client: Optional[str], generated: List[int], in_flight: bool = True) -> Incarnation:
    return Incarnation(jid, client, generated, in_flight)


def test_a_running_reply_continues_from_the_longer_of_its_tokens_and_its_engine_requests(tmp_path):
    state = replies_journal(str(tmp_path / "r"), {"chatcmpl-a": ([1, 2, 3], None), "chatcmpl-b": ([1, 2, 3, 4, 5], None)})
    done = join(state, [inc("e-a", "chatcmpl-a", [1, 2, 3, 4, 5, 6]), inc("e-b", "chatcmpl-b", [1, 2])])
    by = {r.key: r for r in done.replies}
    assert by["chatcmpl-a"].known == [1, 2, 3, 4, 5, 6] and by["chatcmpl-a"].restored == "resume"  # engine ahead
    assert by["chatcmpl-b"].known == [1, 2, 3, 4, 5]  # reply ahead: what clients saw, generated the same way
    assert by["chatcmpl-a"].tokens == [1, 2, 3] and by["chatcmpl-a"].journaled == 3
    assert sorted(done.supersede) == ["e-a", "e-b"] and done.abandon == [] and done.notes == []


def test_what_clients_saw_wins_over_an_engine_request_that_disagrees(tmp_path):
    state = replies_journal(str(tmp_path / "r"), {"chatcmpl-a": ([1, 2, 3], None)})
    done = join(state, [inc("e-a", "chatcmpl-a", [1, 9, 3, 4])])
    assert done.replies[0].known == [1, 2, 3] and done.supersede == ["e-a"]
    assert len(done.notes) == 1 and "e-a" in done.notes[0]


def test_a_reply_killed_while_resuming_takes_the_newest_of_its_incarnations_and_ends_them_all(tmp_path):
    """A second crash during the resume: two engine requests of one reply in flight (and an ended
    one kvj recover's offline resume() finished): one drive continues it, every one is superseded."""
    state = replies_journal(str(tmp_path / "r"), {"chatcmpl-a": ([1, 2], None)})
    done = join(state, [inc("e-1", "chatcmpl-a", [1, 2, 3]), inc("e-2", "chatcmpl-a", [1, 2, 3, 4, 5]),
                        inc("e-0", "chatcmpl-a", [1, 2, 3, 4], in_flight=False)])
    assert [r.known for r in done.replies] == [[1, 2, 3, 4, 5]]
    assert sorted(done.supersede) == ["e-1", "e-2"]  # the ended one is not ended again


def test_finished_replies_are_held_and_engine_requests_no_reply_continues_are_abandoned(tmp_path):
    state = replies_journal(str(tmp_path / "r"), {
        "chatcmpl-done": ([4, 5], {"status": "completed", "finish_reason": "stop"}),
        "chatcmpl-gone": ([6], None)})
    with kvj.Journal.open(str(tmp_path / "r")) as j:  # one whose retention ended: not restored
        j.end("chatcmpl-gone", "expired")
    state = kvj.replay(str(tmp_path / "r"))
    done = join(state, [inc("e-done", "chatcmpl-done", [4, 5, 6]), inc("e-gone", "chatcmpl-gone", [6, 7]),
                        inc("e-plain", None, []), inc("e-other", "chatcmpl-unknown", [1])])
    assert [(r.key, r.restored, r.finished) for r in done.replies] == [("chatcmpl-done", "held", True)]
    assert sorted(done.abandon) == ["e-done", "e-gone", "e-other", "e-plain"] and done.supersede == []


def test_a_reply_the_engine_never_saw_is_computed_from_scratch(tmp_path):
    state = replies_journal(str(tmp_path / "r"), {"chatcmpl-a": ([], None), "chatcmpl-b": ([7, 8], None)})
    done = join(state, [])
    assert [(r.key, r.known, r.restored) for r in done.replies] == [("chatcmpl-a", [], "scratch"),
                                                                    ("chatcmpl-b", [7, 8], "scratch")]


def test_incarnations_read_the_generated_tokens_after_the_original_prompt(tmp_path):
    """A continuation's start record holds prompt + known tokens; ``prompt_len`` is the original's."""
    with kvj.Journal.open(str(tmp_path / "e")) as j:
        j.start("e-1", None, [10, 11, 12, 1, 2], {"prompt_len": 3, "client": "chatcmpl-a", "format": "x"})
        j.tokens("e-1", 5, [3, 4])
        j.start("e-2", None, [10], {"prompt_len": 1})
        j.end("e-2", "stopped")
        j.start("e-3", None, [1], {})  # not the connector's
    found = {i.jid: i for i in incarnations(kvj.replay(str(tmp_path / "e")))}
    assert found["e-1"] == Incarnation("e-1", "chatcmpl-a", [1, 2, 3, 4], True)
    assert found["e-2"].in_flight is False and found["e-2"].client is None
    assert found["e-3"] == Incarnation("e-3", None, [], True)


def test_the_reply_record_folds_into_the_request_read_either_way(tmp_path):
    """Replay's one-decode path and the map path (fsck, inspect) read a reply record that leaves its
    defaults out alike (the map path once failed on the missing stop_reason)."""
    from kvj.journal.reader import Scan
    from kvj.journal.records import decode_payload
    from kvj.journal.state import JournalState

    path = str(tmp_path / "r")
    replies_journal(path, {"chatcmpl-a": ([1, 2], {"status": "completed", "finish_reason": "length"})})
    fast = kvj.replay(path).requests["chatcmpl-a"].reply
    slow = JournalState()
    for raw in Scan(path):
        slow.apply(raw.rtype, decode_payload(raw.rtype, bytes(raw.payload)), raw.lsn)
    assert fast == slow.requests["chatcmpl-a"].reply == {
        "status": "completed", "count": 2, "at": 100.0, "finish_reason": "length", "stop_reason": None,
        "cached_tokens": 0, "to": None}
    assert Reply.from_state(kvj.replay(path).requests["chatcmpl-a"]).end["count"] == 2


def test_a_reply_record_of_a_request_not_in_flight_is_a_warning(tmp_path):
    path = str(tmp_path / "r")
    with kvj.Journal.open(path) as j:
        j.append(RecordType.REPLY, {"id": "nobody", "status": "completed", "count": 0, "at": 1.0})
    state = kvj.replay(path)
    assert "nobody" not in state.requests and any("reply record" in w for w in state.warnings)


def held(key: str, at: float, tokens: int) -> Any:
    return SimpleNamespace(key=key, end={"at": at}, held_bytes=lambda: 4 * tokens)


def test_retention_ends_what_is_past_it_then_the_oldest_beyond_the_budget():
    running = SimpleNamespace(key="run", end=None, held_bytes=lambda: 10 ** 9)
    replies = [held("old", 0.0, 10), held("a", 50.0, 100), held("b", 60.0, 100), held("c", 70.0, 100), running]
    assert [(r.key, why) for r, why in doomed(replies, now=100.0, retention=90.0, budget=10 ** 6)] == [("old", "expired")]
    assert [(r.key, why) for r, why in doomed(replies, now=100.0, retention=90.0, budget=800)] == [
        ("old", "expired"), ("a", "evicted")]
    assert doomed(replies, now=100.0, retention=1000.0, budget=10 ** 6) == []  # a running reply is never ended
