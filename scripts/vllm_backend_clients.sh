#!/usr/bin/env bash
# Runs Triton's vLLM backend's own clients and CI tests against our server, unchanged except
# for the model name and URL (and, for the accuracy test, a transformers baseline instead of
# vLLM's). docs/vllm_backend_compat.md has the results and the reason for every failing case.
#
#   scripts/vllm_backend_clients.sh VLLM_BACKEND_CHECKOUT [GRPC_URL]
#
# Needs a running server (make serve) and a checkout of triton-inference-server/vllm_backend;
# the metrics test starts servers of its own (below). Nothing is installed into the project:
# the tests need only tritonclient, requests and pytest, which the project's venv has.
set -uo pipefail
SRC=$(cd "${1:?usage: $0 VLLM_BACKEND_CHECKOUT [GRPC_URL]}" && pwd)
URL=${2:-127.0.0.1:8001}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$SRC/ci" "$SRC/samples" "$WORK/"
# The only edits: where the server is and what the model is called.
grep -rl --include=*.py -e localhost:8001 -e vllm_opt "$WORK" | xargs sed -i "s/localhost:8001/$URL/g; s/\"vllm_opt\"/\"llm\"/g"

run() { echo; echo "== $1"; shift; (cd "$WORK/$1" && shift && "$@") 2>&1 | tail -n 25; }

for mode in "" "--exclude-inputs-in-outputs" "-s --exclude-inputs-in-outputs" "-s"; do
    run "samples/client.py ${mode:-(non-streaming)}" samples "$PY" client.py -m llm -u "$URL" $mode \
        --results-file "$WORK/results.txt"
done
run "ci/L0_additional_outputs_vllm" ci/L0_additional_outputs_vllm \
    "$PY" -m pytest -q -p no:cacheprovider additional_outputs_test.py
run "ci/L0_backend_vllm/enabled_stream" ci/L0_backend_vllm/enabled_stream "$PY" enabled_stream_test.py -v
run "ci/L0_backend_vllm/request_cancellation" ci/L0_backend_vllm/request_cancellation \
    "$PY" request_cancellation_test.py -v
# accuracy_test.py imports vLLM only to make its baseline, which comes from transformers here
# (scripts/vllm_backend_baseline.py). The file stays as it is; its `from vllm ...` imports
# resolve to placeholders that only hold their arguments (the baseline code that would use
# them is not run).
SHIM="$WORK/vllm_shim/vllm"
mkdir -p "$SHIM/engine" "$SHIM/sampling_params"
cat > "$SHIM/__init__.py" <<'PY'
class SamplingParams:  # placeholder: accuracy_test.py builds one at import, for its vLLM baseline
    def __init__(self, **kwargs):
        self.kwargs = kwargs
PY
echo 'from vllm import SamplingParams as StructuredOutputsParams' > "$SHIM/sampling_params/__init__.py"
echo 'AsyncEngineArgs = None' > "$SHIM/engine/arg_utils.py"
echo 'AsyncLLMEngine = None' > "$SHIM/engine/async_llm_engine.py"
echo 'random_uuid = None' > "$SHIM/utils.py"
export PYTHONPATH="$WORK/vllm_shim:$ROOT"
run "ci/L0_backend_vllm/accuracy_test (baseline: transformers)" ci/L0_backend_vllm/accuracy_test \
    bash -c "'$PY' '$ROOT/scripts/vllm_backend_baseline.py' accuracy_test.py --compare '$URL' && '$PY' accuracy_test.py"

# ci/L0_backend_vllm/metrics_test reads absolute counts, so its test.sh starts a fresh server for
# each case, with REPORT_CUSTOM_METRICS absent, "false" or "true" in config.pbtxt. The same cases
# here: a fresh server of ours per case (server.launch, the switch as --param, ports of its own,
# plus SERVER_ARGS, e.g. SERVER_ARGS="--param dtype=float32"), and the test file with the same
# two edits as above and, third, the metrics port. The two cases of test.sh that do not apply
# here (disable_log_stats in model.json, --allow-metrics=false) are in docs/vllm_backend_compat.md.
unset PYTHONPATH   # the accuracy test's vLLM placeholders: not for these servers and clients
METRICS_DIR="$WORK/ci/L0_backend_vllm/metrics_test"
metrics_case() {   # TEST_NAME [server.launch arguments...]
    local test=$1 http grpc metrics pid
    shift
    read -r http grpc metrics < <(cd "$ROOT" && "$PY" -c 'from server.launch import free_ports; print(*free_ports(3))')
    (cd "$ROOT" && exec "$PY" -m server.launch --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
        ${SERVER_ARGS:-} "$@") > "$WORK/metrics_server.log" 2>&1 &
    pid=$!
    until grep -q "is ready" "$WORK/metrics_server.log"; do
        if ! kill -0 "$pid" 2>/dev/null; then echo "== $test: the server did not start"; tail "$WORK/metrics_server.log"; return; fi
        sleep 1
    done
    sed "s/localhost:8001/127.0.0.1:$grpc/g; s/\"vllm_opt\"/\"llm\"/g; s/:8002\/metrics/:$metrics\/metrics/g" \
        "$SRC/ci/L0_backend_vllm/metrics_test/vllm_metrics_test.py" > "$METRICS_DIR/vllm_metrics_test.py"
    run "ci/L0_backend_vllm/metrics_test $test (server: ${*:-config.pbtxt as it is})" ci/L0_backend_vllm/metrics_test \
        env TRITONSERVER_IPADDR=127.0.0.1 "$PY" vllm_metrics_test.py "VLLMTritonMetricsTest.$test" -v
    kill -INT "$pid"
    wait "$pid"
}
metrics_case test_vllm_metrics_disabled
metrics_case test_vllm_metrics_disabled --param REPORT_CUSTOM_METRICS=false
metrics_case test_vllm_metrics --param REPORT_CUSTOM_METRICS=true
metrics_case test_custom_sampling_params --param REPORT_CUSTOM_METRICS=true
