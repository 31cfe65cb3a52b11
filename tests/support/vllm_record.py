"""``KvjConnector`` that also writes down the raw KV it saves and loads, for the e2e tests.

With ``kv_connector_extra_config["record"] = DIR`` every block it saves is written to
``DIR/saved-<chain>.r<rank>.npy`` (read from vLLM's paged cache when the step's gather runs;
``rank`` is the worker's, 0 without parallelism) and every block it loads, read back from the
paged cache once the load is reported done, to ``DIR/loaded-<chain>.r<rank>.npy``: the test
compares a restarted engine's loaded KV with the KV an uninterrupted engine computed, byte for
byte, rank by rank. It also writes the worker's counters (blocks loaded, failed verification,
saved...) to ``DIR/stats-r<rank>-<pid>.json`` after every step that loaded or saved something,
and at shutdown.

``kv_connector_extra_config["pace"] = SECONDS`` makes every step that many seconds longer
(after the step's journaling is queued; kvj's threads keep writing meanwhile): a test that
kills the engine once the journal shows some progress then sees that progress before the
requests finish, however slowly a loaded machine runs the test's own polling.

``kv_connector_extra_config["drop"] = {"rank": R, "block": B}`` makes the worker of rank R
never save block B of any request (the other ranks do): a block durable on some ranks only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, List, Mapping, Optional, Set, Tuple

import numpy as np
import torch

from kvj.integrations.vllm import KvjConnector

_OWN = ("record", "pace", "drop")


class RecordingKvjConnector(KvjConnector):
    def _extra_config(self) -> Mapping[str, Any]:
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._record: Optional[str] = extra.get("record")
        self._pace = float(extra.get("pace") or 0)
        self._drop: Optional[Mapping[str, int]] = extra.get("drop")
        return {k: v for k, v in extra.items() if k not in _OWN}

    def _dump(self, kind: str, block_id: int, chain: str) -> None:
        raw = torch.stack([cache[block_id] for cache in self.worker.buffers.caches]).view(torch.uint8).numpy()
        np.save(os.path.join(self._record, f"{kind}-{chain}.r{self.layout.rank}.npy"), raw, allow_pickle=False)

    def _stats(self) -> None:
        with open(os.path.join(self._record, f"stats-r{self.layout.rank}-{os.getpid()}.json"), "w",
                  encoding="utf-8") as f:
            json.dump(self.worker.counters(), f)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        drop = self._drop
        if drop and self._role.name == "WORKER" and self.layout.rank == drop["rank"]:
            kv_connector_metadata = dataclasses.replace(
                kv_connector_metadata, saves=[s for s in kv_connector_metadata.saves if s.block != drop["block"]])
        if self._record:
            for save in kv_connector_metadata.saves:  # what the gather copies, as it is now
                self._dump("saved", save.block_id, save.chain)
            self._loads = getattr(self, "_loads", {})
            for load in kv_connector_metadata.loads:
                self._loads[load.vllm_id] = load.blocks
        super().handle_preemptions(kv_connector_metadata)
        if self._record and (kv_connector_metadata.saves or kv_connector_metadata.loads):
            self._stats()
        time.sleep(self._pace)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving = super().get_finished(finished_req_ids)
        if self._record and recving:
            failed = self.worker.loads._errors  # reported in this same pass
            for req_id in recving:
                blocks: List[Tuple[int, str]] = self._loads.pop(req_id, [])
                for block_id, chain in blocks:
                    if block_id not in failed:
                        self._dump("loaded", block_id, chain)
            self._stats()
        return sending, recving

    def shutdown(self) -> None:
        super().shutdown()
        if self._record and self._role.name == "WORKER":
            self._stats()

