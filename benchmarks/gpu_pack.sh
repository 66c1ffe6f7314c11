#!/usr/bin/env bash
# Pack what the GPU proof (benchmarks/gpu_proof.sh) needs on the device machine and its image
# lacks, into one file that a device call carries beside the ~4 MB tree: .gpupack/pack.tar.xz
# (git-ignored, ~52 MB of the 64 MiB a call carries).
#
#   benchmarks/gpu_pack.sh          # then run(command="benchmarks/gpu_proof.sh ...", carry=[".gpupack"])
#
# In it: nvidia-pytriton (the tritonserver binary and its Python backend stub), numpy 1.26 (that
# stub's numpy; the image has 2.x), structured outputs' packages (xgrammar, apache-tvm-ffi,
# pydantic) and the tests' jsonschema, all for the device's Python 3.12; py-spy; and the SmolLM2 folder
# without its weights (config and tokenizer: the served dummy-weight models reuse the tokenizer).
# torch, triton, transformers, pytest and the rest come from the image (its versions, not our
# pins: the result files record them).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
MODEL=$REPO/models/smollm2-135m-instruct
[ -f "$MODEL/tokenizer.json" ] || { echo "no $MODEL/tokenizer.json: run make model first" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:)
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 \
           manylinux_2_35; do PLATFORM+=(--platform "${tag}_x86_64"); done
python3 -m pip install -q --disable-pip-version-check --no-deps --target "$WORK/osite" "${PLATFORM[@]}" \
    nvidia-pytriton==0.7.0 tritonclient==2.73.0 numpy==1.26.4 sh typing_inspect mypy_extensions \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic pydantic-core annotated-types typing-inspection \
    jsonschema==4.26.0 jsonschema-specifications referencing rpds-py
find "$WORK/osite" -name __pycache__ -type d -prune -exec rm -rf {} +
# numpy 1.26 apart: the server's venv puts it first (the stub's), the tests keep the image's 2.x
# (the image's scipy stack, which transformers' generation imports, needs it).
mkdir "$WORK/numpy1" && mv "$WORK"/osite/numpy "$WORK"/osite/numpy-*.dist-info "$WORK"/osite/numpy.libs "$WORK/numpy1/"
# py-spy, to sample the model stub's threads during one served run (gpu_proof --spy).
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 \
    -d "$WORK/spy" py-spy==0.4.3
unzip -j -q "$WORK"/spy/py_spy-*.whl '*/scripts/py-spy' -d "$WORK/bin" && chmod +x "$WORK/bin/py-spy"
mkdir "$WORK/devmodel"
find "$MODEL" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$WORK/devmodel/" \;
mkdir -p "$REPO/.gpupack"
grep -qx "/.gpupack/" "$REPO/.git/info/exclude" 2>/dev/null || echo "/.gpupack/" >> "$REPO/.git/info/exclude"
(cd "$WORK" && tar -cf - osite numpy1 bin devmodel | xz -6 -T0 > "$REPO/.gpupack/pack.tar.xz")
ls -l "$REPO/.gpupack"
