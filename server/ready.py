"""Readiness probe: exit 0 when the model is ready *and* takes new requests (``llm_ready``:
not draining, engine healthy), 1 otherwise.

Triton's own /v2/health/ready stays 200 while our model drains or after its engine failed
(Triton does not know), so a Kubernetes readiness probe runs this:

    python -m server.ready [--http 127.0.0.1:8000] [--metrics http://127.0.0.1:8002/metrics]
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from server.launch import MODEL_NAME
from server.stub.metric_names import READY_FAMILY


def is_ready(http: str, metrics_url: str, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/models/{MODEL_NAME}/ready", timeout=timeout) as response:
            if response.status != 200:
                return False, f"model not ready ({response.status})"
        with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable: {exc}"
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in (READY_FAMILY, "llm_draining", "llm_engine_healthy"):
            values[name] = float(line.rsplit(" ", 1)[1])
    if values.get(READY_FAMILY) == 1:
        return True, "ready"
    if values.get("llm_draining"):
        return False, "draining"
    if values.get("llm_engine_healthy") == 0:
        return False, "engine unhealthy"
    return False, "not ready"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--metrics", default="http://127.0.0.1:8002/metrics")
    args = parser.parse_args(argv)
    ok, why = is_ready(args.http, args.metrics)
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
