"""The LoRA kernels against the torch reference (kernels/reference.py is the spec): the Triton
shrink/expand pair (in the interpreter on CPU, compiled with CUDA) and the C kernel of the
CPU path, on random adapter stacks with rows of several slots and of none (-1) in any order.
Poison: NaN in a slot no row uses and in the output rows of no adapter, which must stay as
they were; the shrink's rows of no adapter are never read."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_native
from kernels.reference import lora_expand_reference, lora_shrink_reference
from kernels.triton_lora import lora_expand, lora_shrink

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# (tokens, in_features, out_features, max_rank): a decode batch, a prefill chunk, widths and
# ranks that are not multiples of the kernels' blocks.
SHAPES = [(16, 576, 960, 48), (37, 200, 130, 24), (3, 1536, 576, 192)]


def make_case(seed: int, tokens: int, in_features: int, out_features: int, max_rank: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    num_slots = 4
    a_stack = torch.randn(num_slots, max_rank, in_features, generator=generator) / in_features ** 0.5
    b_stack = torch.randn(num_slots, max_rank, out_features, generator=generator) / max_rank ** 0.5
    a_stack[3] = float("nan")                 # slot 3 is resident but no row uses it
    b_stack[3] = float("nan")
    # Slot 1's adapter has half the rank the stacks hold: past it, NaN that must not be read.
    ranks = torch.tensor([max_rank, max_rank // 2, max_rank, max_rank], dtype=torch.int32)
    a_stack[1, ranks[1]:] = float("nan")
    b_stack[1, ranks[1]:] = float("nan")
    rng = random.Random(seed)
    slot_ids = torch.tensor([rng.choice([-1, 0, 1, 2, 2]) for _ in range(tokens)], dtype=torch.int32)
    slot_ids[0], slot_ids[-1] = -1, 1
    x = torch.randn(tokens, in_features, generator=generator)
    out = torch.randn(tokens, out_features, generator=generator)
    out[slot_ids < 0] = float("nan")          # rows of no adapter: untouched, whatever they hold
    cast = lambda t: t.to(dtype=dtype, device=DEVICE)   # noqa: E731
    return cast(x), cast(a_stack), cast(b_stack), slot_ids.to(DEVICE), ranks.to(DEVICE), cast(out)


def expected(x, a_stack, b_stack, slot_ids, ranks, out):
    """The reference reads zero padding past each slot's rank (its stacks' convention)."""
    a_stack, b_stack = a_stack.clone(), b_stack.clone()
    for slot, rank in enumerate(ranks.tolist()):
        a_stack[slot, rank:] = 0
        b_stack[slot, rank:] = 0
    reference = out.clone()
    lora_expand_reference(lora_shrink_reference(x, a_stack, slot_ids), b_stack, slot_ids, reference)
    return reference


def check(actual: torch.Tensor, reference: torch.Tensor, out_before: torch.Tensor, slot_ids: torch.Tensor,
          dtype: torch.dtype, seed: int) -> None:
    base_rows = slot_ids < 0
    assert actual[base_rows].isnan().all(), f"seed {seed}: a row of no adapter was written"
    assert not actual[~base_rows].isnan().any(), f"seed {seed}: an unused slot leaked in"
    torch.testing.assert_close(actual[~base_rows].float(), reference[~base_rows].float(), **TOLERANCES[dtype],
                               msg=lambda m: f"seed {seed}: {m}")
    assert not torch.equal(actual[~base_rows], out_before[~base_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_shrink_and_expand_match_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    seed = random.randrange(1 << 30)
    x, a_stack, b_stack, slot_ids, ranks, out = make_case(seed, *shape, dtype)
    reference = expected(x, a_stack, b_stack, slot_ids, ranks, out)
    y = lora_shrink(x, a_stack, slot_ids, ranks)
    clean_a = a_stack.clone()
    clean_a[1, ranks[1]:] = 0
    for row in (slot_ids >= 0).nonzero().flatten().tolist():
        width = int(ranks[slot_ids[row]])
        torch.testing.assert_close(y[row, :width], lora_shrink_reference(x[row:row + 1], clean_a, slot_ids[row:row + 1])[0, :width],
                                   **TOLERANCES[torch.float32], msg=lambda m: f"seed {seed}, row {row}: {m}")
    actual = out.clone()
    lora_expand(y, b_stack, slot_ids, ranks, actual)
    check(actual, reference, out, slot_ids, dtype, seed)


def test_triton_kernels_read_strided_rows() -> None:
    """x as a column slice of a wider tensor (the MLP's activation is half of gate_up)."""
    seed = random.randrange(1 << 30)
    x, a_stack, b_stack, slot_ids, ranks, out = make_case(seed, 9, 128, 64, 16, torch.float32)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)
    actual = out.clone()
    lora_expand(lora_shrink(wide[:, :128], a_stack, slot_ids, ranks), b_stack, slot_ids, ranks, actual)
    check(actual, expected(x, a_stack, b_stack, slot_ids, ranks, out), out, slot_ids, torch.float32, seed)


@pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_c_kernel_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """The C kernel reads each part's own B: slot 2's adapter has two parts (like gate and up),
    each its half of the ranks and of the output columns; the reference gets them as one
    block matrix, zeros elsewhere."""
    if DEVICE.type != "cpu":
        pytest.skip("the C kernel is the CPU path")
    seed = random.randrange(1 << 30)
    x, a_stack, b_stack, slot_ids, ranks, out = make_case(seed, *shape, dtype)
    max_rank, out_features = b_stack.shape[1], b_stack.shape[2]
    half_rank, half_out = max_rank // 2, out_features // 2
    b_stack[2, :half_rank, half_out:] = 0
    b_stack[2, half_rank:, :half_out] = 0
    reference = expected(x, a_stack, b_stack, slot_ids, ranks, out)
    rows, held = [], []    # held: the tensors behind the table's addresses, alive for the call
    for slot in range(4):
        rank = int(ranks[slot])
        if slot == 2:
            parts = [(b_stack[2, :half_rank, :half_out].contiguous(), 0, half_rank, 0, half_out),
                     (b_stack[2, half_rank:, half_out:].contiguous(), half_rank, max_rank, half_out, out_features)]
        else:
            parts = [(b_stack[slot, :rank].contiguous(), 0, rank, 0, out_features)]
        a = a_stack[slot, :rank].contiguous()
        held += [a, *(part[0] for part in parts)]
        rows.append(cpu_native.lora_slot_fields(a, parts))
    actual = out.clone()
    cpu_native.lora_apply(x, actual, slot_ids, torch.tensor(rows))
    check(actual, reference, out, slot_ids, dtype, seed)
