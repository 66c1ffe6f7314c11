#!/usr/bin/env bash
# The GPU proof on the device machine (benchmarks/gpu_proof.py says what runs): unpack the pack
# that benchmarks/gpu_pack.sh made here, put our Python side before the image's, run the stages.
#
#   run(command="GIT_COMMIT=<sha> benchmarks/gpu_proof.sh --stages serve:llama-1b,tests,roofline --budget-s 500",
#       carry=[".gpupack"], timeout_s=560)
#
# A later call on the still-warm machine (it goes back 30 s after a call) finds the pack
# unpacked in /tmp and needs no carry. Results: $OUT/gpu_proof.json (written after every run,
# so a call cut off keeps what finished) and $OUT/logs.tar.gz (server logs, pytest output).
set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu-proof-out}
WORK=/tmp/gpu-proof-work
mkdir -p "$OUT" "$WORK"
if [ ! -e /tmp/gpupack/.unpacked ]; then
    [ -f .gpupack/pack.tar.xz ] || { echo "no .gpupack/pack.tar.xz: run benchmarks/gpu_pack.sh and carry .gpupack"; exit 1; }
    rm -rf /tmp/gpupack && mkdir /tmp/gpupack
    xz -d -T0 < .gpupack/pack.tar.xz | tar -x -C /tmp/gpupack || { echo "unpacking failed"; exit 1; }
    touch /tmp/gpupack/.unpacked
fi
# The model folder without weights: the tokenizer for the dummy-weight shapes; tests that need
# the checkpoint are reported skipped (LLM_TESTS_WITHOUT_CHECKPOINT, set by gpu_proof.py).
mkdir -p models/smollm2-135m-instruct
cp /tmp/gpupack/devmodel/* models/smollm2-135m-instruct/
# A virtual environment over the image's site-packages with the pack first: Triton's Python stub
# ignores PYTHONPATH and finds its packages through the `python3` on PATH (server/launch.py).
if [ ! -x /tmp/gpu-venv/bin/python ]; then
    IMAGE_SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    python3 -m venv --without-pip /tmp/gpu-venv
    SITE=$(/tmp/gpu-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
    printf "/tmp/gpupack/numpy1\n/tmp/gpupack/osite\nimport site; site.addsitedir('%s')\n" "$IMAGE_SITE" \
        > "$SITE/zz_gpu_pack.pth"
fi
# The tests run on the image's own python (its numpy 2.x) with the pack's packages but numpy 1.26.
export GPU_PROOF_TEST_PYTHON=python3 GPU_PROOF_TEST_PYTHONPATH=/tmp/gpupack/osite PATH="$PATH:/tmp/gpupack/bin"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | head -2
/tmp/gpu-venv/bin/python -m benchmarks.gpu_proof --out "$OUT" --work "$WORK" "$@"
status=$?
tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude='model-*' . 2>/dev/null
exit $status
