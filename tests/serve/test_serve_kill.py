"""kvj serve against a real server on vLLM's CPU backend: several clients, the whole server process
group SIGKILLed mid-stream, ``kvj serve`` started again on the same journal, every client
re-attaches, and what it got before and after equals an uninterrupted server's reply, tokens
and text, greedy and seeded, with gapless event ids (DESIGN: test_serve_kill; two server starts).

The reference runs on the first server before any victim, so it owes nothing to kvj's KV. The
victims are the same requests under other ids; each client goes away after its own number of
events (chosen from a printed seed), then the group is killed while they are in flight.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict

import httpx

from support.e2e import rng
from support.serve_server import ROOMY, Server, ballast, data, kvj, normal, serving, sse, tokens_and_text

MAX_TOKENS = 6000  # no victim can finish before every client reached its cut point, even with the server's
# API process behind the engine on a loaded machine (at 2400 all five once had); the ballast's 9000 outlasts it
LONG = ("--max-model-len", "16384", *ROOMY)
MESSAGES = [{"role": "user", "content": "Write the journal of a long day at the harbour, with the boats and the gulls."}]


def requests(model: str) -> Dict[str, Dict[str, Any]]:
    """name -> (route, body): the clients of the test."""
    chat = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return {
        "chat": ("/v1/chat/completions", chat),
        "seeded": ("/v1/chat/completions", {**chat, "temperature": 1.0, "seed": 1234}),
        "completion": ("/v1/completions", {"model": model, "prompt": "Once upon a time, in the harbour,",
                                           "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True}),
        "responses": ("/v1/responses", {"model": model, "input": "Tell the story of the harbour at night.",
                                        "background": True, "max_output_tokens": MAX_TOKENS, "temperature": 0,
                                        "ignore_eos": True}),
        "whole": ("/v1/chat/completions", {**chat, "stream": False, "max_tokens": 400}),
    }


def key(name: str, route: str, rid: str) -> str:
    return {"/v1/chat/completions": f"chatcmpl-{rid}", "/v1/completions": f"cmpl-{rid}"}.get(route, rid)


def start(server: Server, name: str, route: str, body: Dict[str, Any], rid: str, limit: Any = None) -> Any:
    """A client's request: its stream's events (up to ``limit``), or a Responses POST then its stream."""
    if route == "/v1/responses":
        created = httpx.post(server.url + route, json={**body, "request_id": rid}, timeout=120).json()
        assert created["status"] == "queued" and created["background"] is True and created["id"] == rid, created
        return sse("GET", f"{server.url}{route}/{rid}?stream=true", limit=limit)[1]
    if not body["stream"]:
        try:
            return httpx.post(server.url + route, json=body, headers={"X-Request-Id": rid},
                              timeout=None if limit is None else 0.5).json()
        except httpx.TimeoutException:
            return None  # a client that gave up: it comes back once the reply finished
    return sse("POST", server.url + route, body, {"X-Request-Id": rid}, limit=limit)[1]


def test_clients_reattach_after_the_server_group_is_killed_and_get_the_uninterrupted_reply(serve_model, tmp_path):
    pick = rng("test_serve_kill")
    journal = str(tmp_path / "journal")
    clients = requests(serve_model)
    cut = {name: pick.randint(20, 120) for name in clients}
    print("clients go away after", cut)
    ref: Dict[str, Any] = {}
    before: Dict[str, Any] = {}
    with serving(serve_model, journal, str(tmp_path / "server1.log"), *LONG) as server:  # first boot, empty dir
        ballast(server, serve_model, "ref", tokens=9000)  # every step has 4 rows or more (see ballast)
        threads = [threading.Thread(target=lambda n=n: ref.__setitem__(n, start(server, n, *clients[n], f"ref-{n}")))
                   for n in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ballast(server, serve_model, "victims", tokens=9000)  # durable like any reply: resumes beside the victims
        # the victims: same requests, other ids, all at once; each client goes away after its own number of
        # events; a poll during generation says in_progress with the output so far (vLLM's says queued)
        route, body = clients["responses"]
        created = httpx.post(server.url + route, json={**body, "request_id": "resp_victim"}, timeout=120).json()
        poll = httpx.get(f"{server.url}{route}/resp_victim").json()
        assert created["status"] == "queued" and poll["status"] == "in_progress", poll

        def victim(name: str) -> None:
            if name == "responses":
                before[name] = sse("GET", f"{server.url}{route}/resp_victim?stream=true", limit=cut[name])[1]
            else:
                before[name] = start(server, name, *clients[name], f"v-{name}", limit=cut[name])

        threads = [threading.Thread(target=victim, args=(n,)) for n in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        state = {n: httpx.get(f"{server.url}{r}/{key(n, r, 'resp_victim' if n == 'responses' else f'v-{n}')}",
                              timeout=60).json()["status"] for n, (r, _) in clients.items()}
        server.kill()
    ledger = json.load(open(os.path.join(journal, "replies", "shm.json")))
    streams = {n: s for n, s in state.items() if n != "whole"}  # "whole" (400 tokens) may be done
    assert set(streams.values()) == {"in_progress"}, f"not in flight at the kill, the test proves nothing: {state}"

    restart = Server(serve_model, journal, str(tmp_path / "server2.log"), *LONG)
    try:
        took = restart.wait_healthy()
        print(f"restart after kill -9: healthy in {took:.1f} s")
        left = [n for n in ledger["names"] if os.path.exists(os.path.join("/dev/shm", n))]
        assert not left, f"/dev/shm names the killed server mapped are left: {left}"
        for name, (route, body) in clients.items():
            rid = "resp_victim" if name == "responses" else f"v-{name}"
            k, ref_key = key(name, route, rid), key(name, route, f"ref-{name}")
            if name == "whole":  # a client that gave up and returns once the reply finished: it gets it whole
                reply = httpx.get(f"{restart.url}{route}/{k}", timeout=60).json()
                while reply["status"] == "in_progress":
                    reply = httpx.get(f"{restart.url}{route}/{k}", timeout=60).json()
                assert reply["choices"][0]["message"]["content"] == ref[name]["choices"][0]["message"]["content"]
                assert reply["status"] == "incomplete" and reply["choices"][0]["finish_reason"] == "length"
                continue
            got = before[name]
            last = got[-1]["id"]
            _, after = sse("GET", f"{restart.url}{route}/{k}?stream=true", headers={"Last-Event-ID": str(last)})
            both = got + after
            assert [e["id"] for e in both] == list(range(len(both))), f"{name}: event ids not gapless"
            if name == "responses":
                seqs = [data(e)["sequence_number"] for e in both]
                assert seqs == list(range(len(both)))
            assert normal(both, k) == normal(ref[name], ref_key), f"{name}: before + after != uninterrupted"
            assert tokens_and_text(name, both) == tokens_and_text(name, ref[name])
            # at or past the last event: what there is, and the end (vLLM 0.32's in-memory version hangs)
            t = time.monotonic()
            assert sse("GET", f"{restart.url}{route}/{k}?stream=true&starting_after={len(both) - 1}")[1] == []
            assert time.monotonic() - t < 10
        status = httpx.get(f"{restart.url}/v1/kvj/status").json()
        assert status["held"] >= 2 * len(clients) and status["resumed"] >= 3, status
        # an unknown id is a 404 and a bad starting_after a 400, in OpenAI's error shape
        missing = httpx.get(f"{restart.url}/v1/responses/resp_nobody")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        bad = httpx.get(f"{restart.url}/v1/responses/resp_victim?stream=true&starting_after=x")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    finally:
        restart.close()
    fsck = kvj("fsck", "-j", journal)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    status = kvj("status", "-j", journal)
    assert "held" in status.stdout, status.stdout
