"""Locust load tests of the Triton-served LLM: seeded mixed-length streaming scenarios, raw
per-request records, LLM metrics (TTFT, ITL, TPOT, goodput) and plots. See docs/loadtest.md.

    python -m loadtest run [--users 8 --duration 3m --rate 2 --tags chat,rag --host 127.0.0.1:8001]
    python -m loadtest compare         # batching=continuous vs batching=static, same seeded mix
    python -m loadtest report RUN_DIR  # re-render a run's report
"""
