"""Readiness probe: exit 0 when the model is ready *and* not draining, 1 otherwise.

Triton's own /v2/health/ready stays 200 while our model drains (Triton does not know), so a
Kubernetes readiness probe that must turn not-ready at the start of a drain runs this:

    python -m server.ready [--http 127.0.0.1:8000] [--metrics http://127.0.0.1:8002/metrics]
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from server.launch import MODEL_NAME


def is_ready(http: str, metrics_url: str, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/models/{MODEL_NAME}/ready", timeout=timeout) as response:
            if response.status != 200:
                return False, f"model not ready ({response.status})"
        with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable: {exc}"
    for line in text.splitlines():
        if line.startswith("llm_draining{") and float(line.rsplit(" ", 1)[1]) != 0:
            return False, "draining"
    return True, "ready"


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
