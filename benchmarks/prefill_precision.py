"""How far each of our bfloat16 prefill functions is from the reference as the scores widen.

A float16 sum's error grows with its magnitude, so the float16 prefill function
(kernels/csrc/paged_attention.c, prefill_task_fp16) loses accuracy where a model's attention
scores are wide or one query dimension stands far above the others; the float32-FMA one does
not. Two sweeps over one fresh 64-token prompt (8 query heads, 2 KV heads, head_dim 128, blocks
of 16, tests/paged_batches.py's random batch), each function's largest error over the output's
largest magnitude against kernels/reference.py:

- ``wide_scores``: K scaled by 1-16 (the scores' spread scales with it);
- ``query_outlier``: query dimension 0 of every row scaled by 2^4-2^20.

    python -m benchmarks.prefill_precision --out benchmarks/results/prefill_precision-CPU.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.step_cost import cpu_name
from kernels import cpu_native
from kernels.cpu_attention import plan_attention_cpu
from kernels.reference import paged_attention_reference
from tests.paged_batches import make_batch

KERNELS = ("fma", "fp16")
KEY_SCALES = (1, 2, 4, 8, 16)
OUTLIER_SCALES = tuple(2 ** e for e in (4, 8, 10, 12, 16, 20))


def relative_errors(key_scale: float = 1.0, outlier: float = 1.0) -> dict[str, float]:
    """Each function's max |out - reference| / max |reference| on the sweep's batch."""
    head_dim, block_size = 128, 16
    batch = make_batch(3, [(0, 64)], 8, 2, head_dim, block_size, torch.bfloat16, torch.device("cpu"))
    batch.key_cache.mul_(key_scale)
    batch.query[:, :, 0] *= outlier
    scale = head_dim ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale).float()
    plan = plan_attention_cpu(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              torch.zeros(batch.query.shape[0], dtype=torch.int64), block_size)
    errors = {}
    try:
        for kernel in KERNELS:
            if cpu_native.select_prefill_bf16_kernel(kernel) != kernel:
                continue    # not built here
            out = torch.full_like(batch.query, float("nan"))
            cpu_native.paged_prefill_attention(batch.query, out, plan.prefill_starts, plan.prefill_query_lens,
                                               plan.prefill_seq_lens, plan.prefill_tables, batch.key_cache,
                                               batch.value_cache, scale)
            errors[kernel] = round(((out.float() - expected).abs().max() / expected.abs().max()).item(), 5)
    finally:
        cpu_native.select_prefill_bf16_kernel("dp")
    return errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if cpu_native.load() is None:
        raise SystemExit("the C kernels did not build here")
    result = {"cpu": cpu_name(), "what": __doc__.split("\n\n")[0],
              "wide_scores": {f"K x{s}": relative_errors(key_scale=s) for s in KEY_SCALES},
              "query_outlier": {f"dim 0 x2^{r.bit_length() - 1}": relative_errors(outlier=r) for r in OUTLIER_SCALES}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
