#!/usr/bin/env bash
# On the device machine's host CPU (a Xeon with AMX where it was lent so far): our server and vLLM
# CPU served side by side, one at a time, each pinned to 2 CPUs, as on the 2-core machines of
# docs/benchmarks.md. The Python packages that machine lacks travel as pieces made here by
# benchmarks/device_pack.sh, one piece per device call (64 MiB each), and stay in /tmp/pack
# while the machine is warm (it goes back 30 s after a call):
#
#   run(command="benchmarks/device_side_by_side.sh stash", carry=[".pk1"])       # at once, then
#   run(command="STAGES='tests attention prewarm' benchmarks/device_side_by_side.sh run", carry=[".pk2", ".devmodel", ".whl", ".peerlibs"])
#   run(command="STAGES=serve benchmarks/device_side_by_side.sh run", carry=[".devmodel", ".peerlibs"])  # within 30 s
#
# That takes ~20 minutes of device time. A session lent 15 minutes (the machine's start counts)
# runs only what settles issue 20, in two calls (the second carries 59 of the 64 MiB; ~530 s):
#
#   run(command="benchmarks/device_side_by_side.sh stash", carry=[".pk1"])
#   run(command="STAGES=serve RUNS='vllm-bfloat16+preload ours vllm-bfloat16' benchmarks/device_side_by_side.sh run",
#       carry=[".pk2", ".devmodel", ".whl", ".peerlibs"], timeout_s=595)
#
# (a stash call per piece but the last). .devmodel/ holds the model folder's config.json and
# tokenizer, no weights: both servers load random ones (--load-format dummy; the checkpoint does
# not fit a call). Carry it (and .peerlibs/) in every call that serves: a call's ignored paths did
# not outlive it there (2026-11-26), while /tmp did. `run` does STAGES (default "tests linear
# serve"; each call above names its own): `tests`, our bfloat16 kernels' tests on that CPU (the AMX
# version runs there) and the attention ones; `linear`, the linear paths timed; `attention`, our
# attention against torch's SDPA for prompts, and the engine's choice between them (~2 minutes);
# `prewarm`, vLLM started once per dtype of RUNS, all at once, and stopped once ready (its first
# torch.compile warm-up takes 2-3.5 minutes; its compile cache then shortens the measured starts,
# so that the default's first four served runs may fit the 10 minutes of one call; the fifth, ours
# with our prompt attention forced, is a bonus); `serve`, RUNS served with benchmarks.serving,
# workloads A and B. RUNS items: `ours` plus engine parameters joined by "+"
# (ours+cpu_linear=native), vllm-DTYPE, or vllm-DTYPE+preload (with the LD_PRELOAD of vLLM's docs).
# vLLM goes first by default, so nothing of ours has run on the machine when it is measured.
# Results: $OUT/summary.txt and $OUT/results.tar.gz (JSON, logs).
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
if [ ! -e /tmp/pack.unpacked ]; then      # unpacked whole, or not at all
    rm -rf /tmp/unpack /tmp/osite.whl && mkdir /tmp/unpack
    (cd /tmp/unpack && cat /tmp/pack/part* | xz -d -T0 | tar -x) || { log "unpacking failed: pieces missing?"; exit 1; }
    rm -rf /tmp/vsite /tmp/osite && mv /tmp/unpack/vsite /tmp/unpack/osite /tmp/ && touch /tmp/pack.unpacked
fi
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/osite.whl ]; then   # structured outputs' packages
    python3 -m pip install -q --no-deps --upgrade --target /tmp/osite .whl/*.whl > "$WORK/pip_whl.log" 2>&1 \
        && touch /tmp/osite.whl || log "installing .whl failed: $(tail -1 "$WORK/pip_whl.log")"
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
if [ -f .devmodel/config.json ]; then
    mkdir -p models && rm -rf models/smollm2-135m-instruct && cp -r .devmodel models/smollm2-135m-instruct
elif [ ! -f models/smollm2-135m-instruct/config.json ]; then
    log "no model folder: carry .devmodel (benchmarks/device_pack.sh makes it)"; exit 1
fi
{ date -u; echo "kernel $(uname -r)"; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node0'
  grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  $OURS -c 'import torch, numpy, transformers; print("ours:", torch.__version__, numpy.__version__, transformers.__version__)'
  PYTHONPATH=/tmp/vsite python3 -c 'import vllm; print("vllm:", vllm.__version__)' 2>&1 | tail -1; } | tee -a "$SUMMARY"

export CUDA_VISIBLE_DEVICES=    # the CPU side by side: nothing may land on the GPU
PIN=0-1
# Does taskset hold here? 4 busy processes pinned to 2 CPUs take ~2x as long as 2 where it does
# (the device kinds have run under Firecracker and gVisor; vLLM served 0.55-0.59x as much on one
# Xeon as on another, 2026-11-26, with the same pinning).
busy() { taskset -c $PIN python3 -c "
import multiprocessing as mp, time
def spin(_):
    x = 0
    for i in range(20_000_000): x += i
if __name__ == '__main__':
    start = time.perf_counter()
    with mp.Pool($1) as pool: pool.map(spin, range($1))
    print(f'{time.perf_counter() - start:.2f}')"; }
log "taskset check: 2 busy processes on CPUs $PIN took $(busy 2) s, 4 took $(busy 4) s (~2x: the pinning holds)"
STAGES=${STAGES:-tests linear serve}
if [[ " $STAGES " == *" tests "* ]]; then
    log "== bfloat16 kernel tests on this CPU"
    # The tiles in a child process first (kernels/amx_probe.py): whether they run here at all.
    log "$(timeout 120 $OURS -c 'import torch; from kernels import cpu_native as c; r = c.amx_probe_result()
print(c.linear_bf16_version(), r.describe() if r else "(no AMX version built)")' 2>&1 | tail -1)"
    # test_cpu_attention: the AVX-512 attention versions, and torch's SDPA on prompts (oneDNN's AMX
    # path here) against the reference; test_prefill_attention_choice: the start-up choice's timing.
    OMP_NUM_THREADS=2 timeout 240 $OURS -m pytest -q -p no:cacheprovider -rs tests/test_linear_bf16.py \
        tests/test_cpu_attention.py tests/test_prefill_attention_choice.py > "$WORK/tests.log" 2>&1
    log "tests rc=$?: $(tail -1 "$WORK/tests.log")"
    grep -E "^FAILED|NOT RUN" "$WORK/tests.log" | sort | uniq -c | head -10 | tee -a "$SUMMARY"
fi
if [[ " $STAGES " == *" linear "* ]]; then
    log "== linear paths, the model's 121 matmuls"
    OMP_NUM_THREADS=2 timeout 120 taskset -c $PIN $OURS -m benchmarks.cpu_linear --dtype bfloat16 \
        --rows "${ROWS:-1,2,4,16,64,512}" --rounds 3 --paths native,native-noamx,onednn,onednn-hint 2>&1 | tee -a "$SUMMARY" | tail -9
fi

if [[ " $STAGES " == *" attention "* ]]; then
    # Prefill attention was half a 512-token prefill step here (107 of ~200 ms, 2026-11-26): ours
    # against torch's SDPA (oneDNN's flash attention, AMX on this CPU), decode ours against generic.
    log "== attention, ours against torch SDPA and the generic build"
    OMP_NUM_THREADS=2 timeout 150 taskset -c $PIN $OURS -m benchmarks.cpu_attention --sdpa --dtypes bfloat16,float32 \
        --rounds 5 2>&1 | tee -a "$SUMMARY" | tail -7
    # The engine's start-up choice (ours or SDPA, by prompt length) and one 512-token prefill step
    # each way (docs/benchmarks.md, "Prompts through SDPA where it wins").
    log "== prompt attention: the start-up choice, and a prefill step with ours and with SDPA"
    OMP_NUM_THREADS=2 timeout 120 taskset -c $PIN $OURS -c "
from backend import Engine, EngineConfig
engine = Engine(EngineConfig(dtype='bfloat16', load_format='dummy', num_kv_blocks=128, itl_target_ms=0.0))
print(next(n for n in engine.runner.startup_notes if 'prompt attention' in n))" 2>&1 | tail -1 | tee -a "$SUMMARY"
    OMP_NUM_THREADS=2 timeout 150 taskset -c $PIN $OURS -m benchmarks.prefill_roofline --dtypes bfloat16 \
        --prefill-attention native,sdpa --load-format dummy --peak-iters 20000000 \
        --json "$WORK/prefill_attention.json" 2>&1 | tail -5 | tee -a "$SUMMARY"
fi

tree() { echo "$1"; for child in $(pgrep -P "$1"); do tree "$child"; done; }   # $1 and its descendants
pin() {  # every thread of process $1 and its descendants (our launcher starts tritonserver in a
         # session of its own) onto $PIN; threads bound to one CPU (vLLM's OpenMP ones) stay
    for p in $(tree "$1"); do for t in /proc/$p/task/*; do
        tid=${t##*/}; a=$(taskset -p -c "$tid" 2>/dev/null | sed 's/.*: //')
        case "$a" in 0|1) ;; *) taskset -p -c $PIN "$tid" >/dev/null 2>&1 ;; esac
    done; done; }
ready() {  # URL $1 answers within $2 s, while process $3 lives (a server that died fails at once)
    for _ in $(seq 1 "$2"); do
        curl -sf -o /dev/null "$1" && return 0
        kill -0 "$3" 2>/dev/null || return 1
        sleep 1
    done; return 1; }
stop() {  # process $1 (Ctrl-C: our launcher drains and stops its server), then its whole tree;
          # then wait until port $2 refuses connections
    local procs; procs=$(tree "$1")
    kill -INT "$1" 2>/dev/null
    for _ in $(seq 1 20); do curl -s -o /dev/null "http://127.0.0.1:$2/" || break; sleep 1; done
    kill -9 $procs 2>/dev/null
    for _ in $(seq 1 10); do curl -s -o /dev/null "http://127.0.0.1:$2/" || return 0; sleep 1; done
    log "port $2 still answers"; }
bench() { timeout 200 taskset -c $PIN $OURS -m benchmarks.serving --server "$1" --workloads A,B --json "$WORK/$2.json" \
              > "$WORK/$2.txt" 2>&1
          log "$2 rc=$?"; grep -E "^\| (ours|vllm)|failure" "$WORK/$2.txt" | tee -a "$SUMMARY"
          tar -czf "$OUT/results.tar.gz" -C "$WORK" .; }   # after every run: a call cut off keeps what ran
RUNS=${RUNS:-vllm-bfloat16+preload ours vllm-bfloat16 vllm-float32+preload ours+cpu_prefill_attention=native}   # most wanted first
# vLLM's CPU docs ask to LD_PRELOAD tcmalloc and Intel's OpenMP runtime for its best speed; the
# image has neither, benchmarks/device_pack.sh puts both in .peerlibs/ (carry it).
PRELOAD=$REPO/.peerlibs/libtcmalloc_minimal.so.4:$REPO/.peerlibs/libiomp5.so
vllm_server() {  # vllm_server DTYPE[+preload] PORT LOG: one vLLM CPU server, OpenMP on $PIN, in the background
    local preload=
    if [[ $1 == *+preload ]]; then
        preload=$PRELOAD
        [ -f .peerlibs/libiomp5.so ] || log "no .peerlibs/: vLLM runs without its preload"
    fi
    (cd /tmp && LD_PRELOAD=$preload VLLM_CPU_OMP_THREADS_BIND=$PIN VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH=/tmp/vsite \
        exec setsid python3 -m \
        vllm.entrypoints.openai.api_server --model "$REPO/models/smollm2-135m-instruct" --load-format dummy \
        --dtype "${1%+preload}" --host 127.0.0.1 --port "$2" > "$3" 2>&1) &
}
if [[ " $STAGES " == *" prewarm "* ]]; then
    # Their OpenMP threads bound as in the measured runs: Inductor's C++ kernels may fix their
    # thread count when compiled. The compiling itself runs on the other CPUs, as in those runs.
    log "== vLLM warm-ups (compile cache)"
    pids=(); port=8200
    for dtype in $(tr ' ' '\n' <<< "$RUNS" | sed -n 's/^vllm-\([a-z0-9]*\).*/\1/p' | sort -u); do
        vllm_server "$dtype" $port "$WORK/prewarm_$dtype.log"
        pids+=("$! $port $dtype"); port=$((port + 1))
    done
    for entry in "${pids[@]}"; do
        read -r pid port dtype <<< "$entry"; start=$SECONDS
        if ready "http://127.0.0.1:$port/health" 420 "$pid"; then log "vllm-$dtype warm in $((SECONDS - start)) s more"
        else log "vllm-$dtype warm-up failed"; tail -5 "$WORK/prewarm_$dtype.log" | tee -a "$SUMMARY"; fi
    done
    for entry in "${pids[@]}"; do read -r pid port dtype <<< "$entry"; stop "$pid" "$port"; done
fi
if [[ " $STAGES " == *" serve "* ]]; then
    for run in $RUNS; do
        start=$SECONDS
        case $run in
        ours*)
            params=(--param load_format=dummy --param cpu_threads=2 --param device=cpu)
            IFS=+ read -ra extra <<< "${run#ours}"
            for p in "${extra[@]}"; do [ -n "$p" ] && params+=(--param "$p"); done
            OMP_NUM_THREADS=2 setsid $OURS -m server.launch "${params[@]}" > "$WORK/server_$run.log" 2>&1 &
            pid=$!
            if ! ready http://127.0.0.1:8000/v2/models/llm/ready 120 $pid; then
                log "$run: not ready"; tail -20 "$WORK/server_$run.log"; stop $pid 8000; continue
            fi
            pin $pid
            log "$run ready in $((SECONDS - start)) s; $(grep -m1 -E 'linear layers' "$WORK/server_$run.log")"
            log "  $(grep -m1 -o -E 'fused layer ops.*' "$WORK/server_$run.log")"   # the C layer loop, callbacks
            log "  $(grep -m1 -o -E "prompt attention: .*" "$WORK/server_$run.log")"   # ours or SDPA, timed
            bench ours=triton@127.0.0.1:8000 "$run"
            stop $pid 8000 ;;
        vllm*)
            vllm_server "${run#vllm-}" 8100 "$WORK/server_$run.log"
            pid=$!
            if ! ready http://127.0.0.1:8100/health 420 $pid; then   # its first torch.compile warm-up: 130-210 s
                log "$run: not ready"; tail -20 "$WORK/server_$run.log"; stop $pid 8100; continue
            fi
            pin $pid
            log "$run ready in $((SECONDS - start)) s"
            bench vllm=openai@127.0.0.1:8100 "$run"
            stop $pid 8100 ;;
        esac
    done
fi
tar -czf "$OUT/results.tar.gz" -C "$WORK" .
