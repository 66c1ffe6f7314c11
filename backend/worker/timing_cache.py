"""Step-cost calibrations kept on disk, so that a restart on the same machine skips them.

The engine's start-up calibration (backend/worker/step_calibration.py) times ~16 synthetic
steps, a noticeable part of a CPU start-up, paid again at every start, every stub restart and every
replica a supervisor brings back. Like TensorRT's timing cache, the timed samples are stored
under a key of everything that decides how long a step takes: the machine (CPU model and
flags, or the GPU), the threads, the model's config.json and dtype, the paths the runner
resolved (attention backend, linear layers, fused ops, quantization, CUDA graphs, LoRA slots),
the step limits, the calibration shapes, and a hash of the engine's own source. Any change
gives another key, so an entry is never read for a machine or code it was not timed on. The
engine refits the model from its own steps once serving (backend/core/step_cost.py), so an
entry timed under other load is corrected as traffic flows.

Where: ``$LLM_STEP_COST_CACHE``, else ``$XDG_CACHE_HOME/llm-engine-step-cost`` (default
``~/.cache``); ``calibration_cache=false`` in the engine config times every start. Unreadable
or unwritable entries are logged and the calibration runs as without a cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from backend.core.step_cost import NUM_FEATURES, Sample

logger = logging.getLogger(__name__)

ENV_VAR = "LLM_STEP_COST_CACHE"
FORMAT = 1                                # bump when the stored layout or the features change
_SOURCE_ROOTS = ("backend", "kernels")   # the code whose changes may change a step's time
_SOURCE_SUFFIXES = (".py", ".c", ".h")


def cache_dir() -> Path:
    base = os.environ.get(ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-engine-step-cost")
    return Path(base)


@functools.cache
def source_digest() -> str:
    """sha256 over the engine's and kernels' source files (path and bytes), once per process."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for top in _SOURCE_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


class TimingCache:
    """Calibration samples by key, one JSON file per key under ``directory``."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or cache_dir()

    def path(self, key: dict[str, Any]) -> Path:
        return self.directory / f"{key_digest(key)}.json"

    def load(self, key: dict[str, Any]) -> list[Sample] | None:
        """The samples stored under ``key``, or None (absent, unreadable, or another key's)."""
        path = self.path(key)
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("step-cost cache entry %s unreadable (%s): calibrating", path, exc)
            return None
        try:
            if stored["format"] != FORMAT or stored["key"] != json.loads(json.dumps(key, default=str)):
                return None
            samples = [Sample(tuple(float(x) for x in features), float(seconds))
                       for features, seconds in stored["samples"]]
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("step-cost cache entry %s malformed (%s): calibrating", path, exc)
            return None
        if not samples or any(len(s.features) != NUM_FEATURES or not 0 <= s.seconds < math.inf for s in samples):
            logger.warning("step-cost cache entry %s malformed: calibrating", path)
            return None
        logger.info("step-cost calibration read from %s", path)
        return samples

    def store(self, key: dict[str, Any], samples: list[Sample]) -> None:
        """Write atomically (replicas starting together may write the same key at once)."""
        path = self.path(key)
        entry = {"format": FORMAT, "key": key, "samples": [[list(s.features), s.seconds] for s in samples]}
        tmp_name = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
                tmp_name = tmp.name
                json.dump(entry, tmp, default=str)
            os.replace(tmp_name, path)
        except OSError as exc:
            logger.warning("step-cost cache %s not writable (%s): the next start calibrates again", path, exc)
            if tmp_name is not None:
                Path(tmp_name).unlink(missing_ok=True)
