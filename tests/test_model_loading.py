"""What loading a model costs beyond reading and packing its weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: this test process has imported torch._dynamo long ago (other tests).
_LOAD_AND_REPORT = """
import sys, torch
from backend.model.architecture import ModelArchitecture
from backend.model.loader import load_model
folder = sys.argv[1]
model = load_model(folder, ModelArchitecture.from_folder(folder), torch.float32, torch.device("cpu"))
print("torch._dynamo" in sys.modules)
"""


def test_loading_a_model_does_not_import_torch_dynamo(model_dir: Path) -> None:
    """Building the model on the meta device once ran torch's Python decompositions (the
    embedding's random init, the RoPE frequencies), whose first call imports torch._dynamo:
    ~1.5 s of every engine and server start on a 2-core AVX2 EPYC, for nothing."""
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_REPORT, str(model_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False", "loading the model imported torch._dynamo"
