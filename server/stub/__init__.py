"""Code imported by model_repository/llm/1/model.py inside Triton's Python stub process: the
vLLM backend's request and response conventions (``vllm_protocol``), the Triton custom metrics
(``metrics``) and the metric names the launchers read too (``metric_names``).

No launcher code: nothing here imports ``server.launch``, ``server.cluster`` or ``server.ready``
(they run outside the stub and may import the names from here).
"""
