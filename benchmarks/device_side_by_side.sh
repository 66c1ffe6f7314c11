#!/usr/bin/env bash
# On the device machine's host CPU (a Xeon with AMX where it was lent so far): our server and vLLM
# CPU served side by side, one at a time, each pinned to 2 CPUs, as on the 2-core machines of
# docs/benchmarks.md. The Python packages that machine lacks travel as pieces made here by
# benchmarks/device_pack.sh, one piece per device call (64 MiB each), and stay in /tmp/pack
# while the machine is warm (it goes back 30 s after a call):
#
#   run(command="benchmarks/device_side_by_side.sh stash", carry=[".pk1"])       # at once, then
#   run(command="benchmarks/device_side_by_side.sh run", carry=[".pk2", ".devmodel"], timeout_s=600)
#
# .devmodel/ holds the model folder's config.json, tokenizer files and no weights (both servers
# load random weights, --load-format dummy: the checkpoint does not fit a call). `run` checks our
# bfloat16 kernels on that CPU first (tests/test_linear_bf16.py: the AMX version runs there),
# times the linear paths, then serves RUNS (default below) with benchmarks.serving, workloads A
# and B. Everything lands in $OUT: summary.txt and results.tar.gz (JSON, logs).
set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p /tmp/pack
cp .pk*/part* /tmp/pack/ 2>/dev/null
ls -l /tmp/pack
[ "${1:-run}" = stash ] && exit 0

OUT=${OUT:-/tmp/out}; WORK=$OUT/work; mkdir -p "$WORK"
SUMMARY=$OUT/summary.txt
log() { echo "$*" | tee -a "$SUMMARY"; }
if [ ! -d /tmp/vsite ]; then
    (cd /tmp && cat pack/part* | xz -d -T0 | tar -xi) || { log "unpacking failed"; exit 1; }
fi
IMAGE_SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
# Our server runs from a virtual environment: Triton's Python stub ignores PYTHONPATH and finds
# its packages through the `python3` on PATH (server/launch.py).
if [ ! -x /tmp/ours-venv/bin/python ]; then
    python3 -m venv --without-pip /tmp/ours-venv
    SITE=$(/tmp/ours-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
    printf "/tmp/osite\n/tmp/vsite\nimport site; site.addsitedir('%s')\n" "$IMAGE_SITE" > "$SITE/zz_device_pack.pth"
fi
OURS=/tmp/ours-venv/bin/python
mkdir -p models && rm -rf models/smollm2-135m-instruct && cp -r .devmodel models/smollm2-135m-instruct
{ date -u; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node0'
  grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  $OURS -c 'import torch, numpy, transformers; print("ours:", torch.__version__, numpy.__version__, transformers.__version__)'
  PYTHONPATH=/tmp/vsite python3 -c 'import vllm; print("vllm:", vllm.__version__)' 2>&1 | tail -1; } | tee -a "$SUMMARY"

export CUDA_VISIBLE_DEVICES=    # the CPU side by side: nothing may land on the GPU
PIN=0-1
log "== bfloat16 kernel tests on this CPU"
OMP_NUM_THREADS=2 timeout 240 $OURS -m pytest -q -p no:cacheprovider -rs tests/test_linear_bf16.py > "$WORK/tests.log" 2>&1
log "tests rc=$?: $(tail -1 "$WORK/tests.log")"
grep -E "^FAILED" "$WORK/tests.log" | head -10 | tee -a "$SUMMARY"
log "== linear paths, the model's 121 matmuls"
OMP_NUM_THREADS=2 timeout 200 taskset -c $PIN $OURS -m benchmarks.cpu_linear --dtype bfloat16 --rows ${ROWS:-1,2,4,16,64,512} \
    --rounds 3 --paths native,native-noamx,onednn 2>&1 | tee -a "$SUMMARY" | tail -12

pin() {  # every thread of every process matching $1 onto $PIN; threads bound to one CPU (vLLM's OpenMP ones) stay
    for p in $(pgrep -f "$1"); do for t in /proc/$p/task/*; do
        tid=${t##*/}; a=$(taskset -p -c "$tid" 2>/dev/null | sed 's/.*: //')
        case "$a" in 0|1) ;; *) taskset -p -c $PIN "$tid" >/dev/null 2>&1 ;; esac
    done; done; }
ready() { for _ in $(seq 1 "$2"); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }
bench() { taskset -c $PIN $OURS -m benchmarks.serving --server "$1" --workloads A,B --json "$WORK/$2.json" > "$WORK/$2.txt" 2>&1
          log "$2 rc=$?"; grep -E "^\| (ours|vllm)|failure" "$WORK/$2.txt" | tee -a "$SUMMARY"; }
# RUNS: ours[-PARAM=VALUE...] (engine parameters, e.g. ours-cpu_linear=native), vllm-DTYPE.
for run in ${RUNS:-ours-cpu_linear=native ours vllm-bfloat16}; do
    start=$SECONDS
    case $run in
    ours*)
        params=(--param load_format=dummy --param cpu_threads=2 --param device=cpu)
        IFS=- read -ra extra <<< "${run#ours}"
        for p in "${extra[@]}"; do [ -n "$p" ] && params+=(--param "$p"); done
        OMP_NUM_THREADS=2 setsid $OURS -m server.launch "${params[@]}" > "$WORK/server_$run.log" 2>&1 &
        ready http://127.0.0.1:8000/v2/models/llm/ready 240 || { log "$run: not ready"; tail -20 "$WORK/server_$run.log"; pkill -f server.launch; continue; }
        pin tritonserver; pin triton_python_backend_stub; pin server.launch
        log "$run ready in $((SECONDS - start)) s; $(grep -m1 -E 'linear' "$WORK/server_$run.log")"
        bench ours=triton@127.0.0.1:8000 "$run"
        pkill -INT -f server.launch; sleep 4; pkill -9 -f tritonserver; pkill -9 -f server.launch ;;
    vllm*)
        (cd /tmp && VLLM_CPU_OMP_THREADS_BIND=$PIN VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH=/tmp/vsite setsid python3 -m \
            vllm.entrypoints.openai.api_server --model "$REPO/models/smollm2-135m-instruct" --load-format dummy \
            --dtype "${run#vllm-}" --host 127.0.0.1 --port 8100 > "$WORK/server_$run.log" 2>&1 &)
        ready http://127.0.0.1:8100/health 300 || { log "$run: not ready"; tail -20 "$WORK/server_$run.log"; pkill -9 -f vllm; continue; }
        pin vllm; pin VLLM; pin EngineCore
        log "$run ready in $((SECONDS - start)) s"
        bench vllm=openai@127.0.0.1:8100 "$run"
        pkill -INT -f vllm.entrypoints; sleep 3; pkill -9 -f vllm; pkill -9 -f EngineCore ;;
    esac
done
tar -czf "$OUT/results.tar.gz" -C "$WORK" .
