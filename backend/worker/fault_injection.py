"""Fault injection for the server's health tests and for chaos runs (docs/reliability.md).

With ``LLM_INJECT_STEP_FAULT=<path>`` in the server's environment, every engine step raises
while the file at ``path`` exists, as a broken device would; removing the file ends it.
Without the variable nothing is installed.
"""

from __future__ import annotations

import os
from typing import Any

FAULT_FILE_ENV = "LLM_INJECT_STEP_FAULT"


class InjectedStepFault(RuntimeError):
    """Raised by the injected fault hook."""


def install_from_environment(runner: Any) -> None:
    """Set ``runner.fault_hook`` (called with each batch's requests) from the environment."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return

    def fail_while_the_file_exists(requests: list[Any]) -> None:
        if os.path.exists(path):
            raise InjectedStepFault(f"injected step fault ({path} exists)")

    runner.fault_hook = fail_while_the_file_exists
