"""Which adapters a server offers, by name, and their loaded weights.

The vLLM backend's convention: ``multi_lora.json`` in the model folder maps names to PEFT
adapter folders (``{"sql": "/adapters/sql-lora"}``; a relative folder is relative to the
file), and a request names one with ``lora_name`` in its sampling parameters. Here the file
is re-read whenever it changes, so adapters are added and removed while serving by editing
it: no restart, and no model reload through Triton's model-control API, which would end
every stream of the model. An adapter's weights are loaded on its first request and kept;
a name removed from the file is refused from then on, while requests already running with
it finish (they hold the loaded adapter).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from pathlib import Path

import torch

from backend.errors import InvalidRequestError
from backend.lora.adapter import MAX_RANK, LoRAAdapter
from backend.model.architecture import ModelArchitecture

logger = logging.getLogger(__name__)

MULTI_LORA_FILE = "multi_lora.json"


class LoRARegistry:
    def __init__(self, model_folder: str | Path, arch: ModelArchitecture, dtype: torch.dtype,
                 device: torch.device, max_rank: int = MAX_RANK) -> None:
        self.path = Path(model_folder) / MULTI_LORA_FILE
        self.max_rank = max_rank
        self.arch, self.dtype, self.device = arch, dtype, device
        self._lock = threading.Lock()      # callers' threads resolve names; the loop thread reads by id
        self._mtime: tuple[int, int] | None = None   # (mtime, size) of the file last read
        self._folders: dict[str, str] = {}
        self._loaded: dict[str, LoRAAdapter] = {}       # by name
        self._by_id: dict[int, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        # Seconds of every adapter load, drained by the metrics publisher (another thread).
        self.load_seconds: deque[float] = deque(maxlen=1000)

    def names(self) -> list[str]:
        with self._lock:
            self._refresh()
            return sorted(self._folders)

    def resolve(self, name: object) -> LoRAAdapter:
        """The adapter ``name`` refers to now, loaded on first use. InvalidRequestError for a
        name that is not a string or not in multi_lora.json, or an adapter that does not load."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", "must be a non-empty string (an adapter of multi_lora.json)")
        with self._lock:
            self._refresh()
            folder = self._folders.get(name)
            if folder is None:
                known = ", ".join(sorted(self._folders)[:10]) or "none: the model folder has no multi_lora.json"
                raise InvalidRequestError("lora_name", f"unknown adapter {name[:100]!r} (known: {known})")
            adapter = self._loaded.get(name)
            if adapter is None or adapter.folder != folder:
                started = time.perf_counter()
                adapter = LoRAAdapter.load(name, next(self._ids), folder, self.arch, self.dtype, self.device,
                                           self.max_rank)
                seconds = time.perf_counter() - started
                self.load_seconds.append(seconds)
                logger.info("loaded LoRA adapter %r (rank %d, %.1f MiB) from %s in %.2f s", name, adapter.rank,
                            adapter.num_bytes / 2**20, folder, seconds)
                self._loaded[name] = adapter
                self._by_id[adapter.lora_id] = adapter
            return adapter

    def _refresh(self) -> None:
        try:
            stat = self.path.stat()
            mtime = (stat.st_mtime_ns, stat.st_size)   # the size too: two writes within a clock tick
        except OSError:
            self._folders, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        try:
            entries = json.loads(self.path.read_text())
            if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in entries.items()):
                raise ValueError("must be a JSON object of adapter name -> folder")
        except (OSError, ValueError) as exc:
            logger.error("%s is not usable (%s); keeping the adapters read before", self.path, exc)
            return
        self._mtime = mtime
        self._folders = {name: str((self.path.parent / folder).resolve()) for name, folder in entries.items()}
        for gone in set(self._loaded) - set(self._folders):
            logger.info("LoRA adapter %r removed from %s", gone, self.path)
            del self._loaded[gone]   # running requests keep their reference; _by_id keeps the id for them
