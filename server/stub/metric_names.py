"""Names of the model's Triton custom metrics that code outside the stub reads as well.

Plain constants, no imports: the readiness probe (server/ready.py) and the cluster launcher's
HAProxy health check (server/cluster.py) import them without pulling in the engine, and the
stub-side metrics (server/stub/metrics.py) import them without pulling in the launchers.
"""

# The model's gauge: 1 while it takes new requests (server/stub/metrics.py sets it). HAProxy's
# health check (server/cluster.py) and the readiness probe (server/ready.py) read it.
READY_FAMILY = "llm_ready"

# The model parameter (config.pbtxt `parameters`, or `--param` of server/launch.py) that Triton's
# vLLM backend reads to export its vllm:* families; server/stub/metrics.py says how it is read.
REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"
