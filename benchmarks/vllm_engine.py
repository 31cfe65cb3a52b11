"""An engine process of ``kvj bench vllm`` (``benchmarks.vllm`` starts it): one vLLM engine, a job
per stdin line, a JSON line per job on the file descriptor it is given (vLLM's own processes
share its stdout).

vLLM runs in its usual processes (its engine core and worker apart from this one). A kvj
engine's timed region ends when everything it journaled is durable: this process follows the
journal (``kvj.journal.follow``, which shows only complete commit groups) until the END of every
request of the job has appeared, then fsyncs the newest log file, so that even the last group
is on disk when the clock stops. The worker-side connector's counters (fsyncs, bytes, blocks,
steps) are read with vLLM's ``collective_rpc`` (its control channel, which pickles the call:
``VLLM_ALLOW_INSECURE_SERIALIZATION``, set for this process only).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any, Dict, List, Optional

BLOCK = 32
VOCAB = 4096


def worker_counters(worker: Any) -> Dict[str, int]:
    """In vLLM's worker process (``collective_rpc``): the connector's counters, with the syncs of its
    journal and store (its counted file layer) and the bytes its store wrote."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    journal = get_kv_transfer_group().worker
    fs = journal.fs.counts
    return {**journal.counters(), "fsyncs": fs["file_syncs"] + fs["dir_syncs"],
            "bytes_stored": journal.journal.store.io_counts()["bytes_written"]}


class _Journal:
    """What has become durable in a kvj engine's journal, as this process follows it."""

    def __init__(self, path: str):
        from kvj.journal.follow import Follower

        self.path = path
        self.follower = Follower(path)
        self.ends = self.tokens = self.blocks = 0
        self.poll()

    def poll(self) -> None:
        from kvj.journal.records import RecordType

        for rec in self.follower.poll():
            if rec.rtype == RecordType.END and rec.payload["status"] != "resumed":
                self.ends += 1
            elif rec.rtype == RecordType.TOKENS:
                self.tokens += len(rec.payload["tokens"])
            elif rec.rtype == RecordType.SEGMENT:
                self.blocks += 1

    def wait_ends(self, n: int) -> None:
        """Until ``n`` requests ended (their segments before them), then make the log durable."""
        from kvj.fileio import fsync_path
        from kvj.journal.reader import list_logs

        while self.ends < n:
            time.sleep(0.002)
            self.poll()
        fsync_path(list_logs(self.path)[-1])


class Served:
    """This process's engine, and the journal it writes when it has KvjConnector."""

    def __init__(self, spec: Dict[str, Any]):
        # vLLM's CPU backend reserves one more core when a KV connector is configured (for NIXL);
        # on a 2-core machine that leaves the engine's scheduler none (see the README).
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(worker_counters)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        transfer = None
        kvj = spec["connector"] == "kvj"
        if kvj:
            transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                        kv_role="kv_both", kv_load_failure_policy="recompute",
                                        kv_connector_extra_config={"journal": spec["dir"], **spec.get("extra", {})})
        elif spec["connector"] == "example":
            transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                        kv_connector_extra_config={"shared_storage_path": spec["dir"]})
        self.llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                       enforce_eager=True, block_size=BLOCK, kv_transfer_config=transfer, seed=0,
                       max_num_batched_tokens=4096,
                       kv_cache_memory_bytes=1 << 30)  # no start-up check against the memory others use
        self.journal: Optional[_Journal] = _Journal(spec["dir"]) if kvj else None
        #: requests whose END the journal holds once all is settled (an earlier engine's too)
        self.submitted = self.journal.ends if self.journal is not None else 0

    def params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)

    def counters(self) -> Dict[str, int]:
        return self.llm.collective_rpc(worker_counters)[0] if self.journal is not None else {}

    def settle(self) -> None:
        """Until everything journaled for the requests submitted so far is durable."""
        if self.journal is not None:
            self.journal.wait_ends(self.submitted)

    def generate(self, job: Dict[str, Any]) -> Dict[str, Any]:
        from vllm.inputs import TokensPrompt

        before = self.counters()
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                                 self.params(job["max_tokens"]), use_tqdm=False)
        generated = time.perf_counter() - t0
        self.submitted += len(job["prompts"])
        self.settle()
        seconds = time.perf_counter() - t0
        after = self.counters()
        return {"seconds": seconds, "generate_seconds": generated,
                "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                "prompt": sum(len(o.prompt_token_ids or []) for o in outs),
                "cached": sum(o.num_cached_tokens or 0 for o in outs),
                "counters": {k: after[k] - before.get(k, 0) for k in after}}

    def sustain(self, job: Dict[str, Any]) -> Dict[str, Any]:
        """Requests arriving continuously: one whenever one finishes, ``in_flight`` at a time;
        each second, what was generated (this process sees it) and what is durable (it follows
        the journal)."""
        from vllm.inputs import TokensPrompt

        engine, rng = self.llm.llm_engine, random.Random(job["seed"])
        params = self.params(job["max_tokens"])
        produced: Dict[str, int] = {}
        active: set = set()
        samples: List[Dict[str, Any]] = []
        j = self.journal
        base = (j.tokens, j.blocks) if j is not None else (0, 0)

        def sample(t: float) -> Dict[str, Any]:
            generated = sum(produced.values())
            blocks = sum((job["prompt"] + n - 1) // BLOCK for n in produced.values() if n)
            if j is None:
                return {"t": t, "generated": generated}
            j.poll()
            return {"t": t, "generated": generated, "tokens_durable": j.tokens - base[0],
                    "blocks_durable": j.blocks - base[1], "backlog_blocks": blocks - (j.blocks - base[1])}

        t0 = time.perf_counter()
        next_sample, n = t0, 0
        while True:
            now = time.perf_counter()
            arriving = now - t0 < job["seconds"]
            while arriving and len(active) < job["in_flight"]:
                rid = f"s{n}"
                n += 1
                engine.add_request(rid, TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB)
                                                                        for _ in range(job["prompt"])]), params)
                active.add(rid)
            if not active and not arriving:
                break
            for out in engine.step():
                produced[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    active.discard(out.request_id)
            if now >= next_sample:
                samples.append(sample(now - t0))
                next_sample = now + 1.0
        generated_at = time.perf_counter() - t0
        self.submitted += n
        self.settle()
        # Whole blocks whose next token is known: the blocks the connector journals.
        blocks = sum((job["prompt"] + k - 1) // BLOCK for k in produced.values() if k)
        return {"samples": samples + [sample(time.perf_counter() - t0)], "generate_seconds": generated_at,
                "requests": n, "blocks": blocks}


def serve(spec: Dict[str, Any], results: Any) -> None:
    served = Served(spec)
    served.generate({"prompts": [[7] * 40], "max_tokens": 4})  # warm up
    results.write("{}\n")
    results.flush()
    for line in sys.stdin:
        job = json.loads(line)
        result = served.sustain(job) if job.get("sustain") else served.generate(job)
        results.write(json.dumps(result) + "\n")
        results.flush()


if __name__ == "__main__":
    with open(sys.argv[1]) as f, os.fdopen(int(sys.argv[2]), "w", encoding="utf-8") as out:
        serve(json.load(f), out)
