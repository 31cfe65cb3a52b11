"""``KvjConnector`` that also writes down the raw KV it saves and loads, for the e2e tests.

With ``kv_connector_extra_config["record"] = DIR`` every block it saves is written to
``DIR/saved-<chain>.npy`` and every block it loads, read back from vLLM's paged cache after
the copy, to ``DIR/loaded-<chain>.npy``: the test compares a restarted engine's loaded KV
with the KV an uninterrupted engine computed, byte for byte. It also counts, in
``DIR/stats-<pid>.json``, the blocks loaded and those that failed verification.

``kv_connector_extra_config["pace"] = SECONDS`` makes every step that many seconds longer
(after the step's blocks are queued; kvj's threads keep writing meanwhile): a test that kills
the engine once the journal shows some progress then sees that progress before the requests
finish, however slowly a loaded machine runs the test's own polling.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import torch

from kvj.integrations.vllm import KvjConnector, _Save


class RecordingKvjConnector(KvjConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._record = self._kv_transfer_config.kv_connector_extra_config.get("record")
        self._pace = float(self._kv_transfer_config.kv_connector_extra_config.get("pace") or 0)

    def _dump(self, kind: str, block_id: int, chain: str) -> None:
        if self._record:
            raw = torch.stack([cache[block_id] for cache in self._caches.values()]).view(torch.uint8).numpy()
            np.save(os.path.join(self._record, f"{kind}-{chain}.npy"), raw, allow_pickle=False)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        time.sleep(self._pace)

    def _save(self, save: _Save) -> None:
        self._dump("saved", save.block_id, save.chain)
        super()._save(save)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for _, blocks in self._get_connector_metadata().loads:
            for block_id, chain in blocks:
                if block_id not in self._failed_now:
                    self._dump("loaded", block_id, chain)
        if self._record and self._get_connector_metadata().loads:
            with open(os.path.join(self._record, f"stats-{os.getpid()}.json"), "w", encoding="utf-8") as f:
                json.dump(self.stats, f)
