"""Token constraints: what a request's next token may be, as a packed bitmask per position.

The bitmask layout is xgrammar's: ``[rows, ceil(vocab / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. A constraint fills one row for the request's next
token and, when the step verifies speculative drafts, one more row per draft: the row after
``drafts[:j]``. The engine tells the constraint every token the request emits (``advance``),
so a stateful constraint (a grammar matcher) follows the text; draft rows are computed from
a look-ahead that the constraint undoes before ``fill_bitmask`` returns.

``bitmask_to_bool`` is the obvious torch reference of the unpacking; ``mask_logits_`` is what
the engine runs, which must match it. (xgrammar's own CPU kernel, ``apply_token_bitmask_inplace``,
measured slower than both on an AVX-512 CPU: docs/structured_outputs.md.)
"""

from __future__ import annotations

import abc

import torch

BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens disallowed."""
    return torch.zeros((num_rows, bitmask_width(vocab_size)), dtype=torch.int32)




def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool, True where allowed. Columns beyond the bitmask's width (a
    model whose logits cover more ids than the tokenizer knows) are disallowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab_size - bits.shape[1])], dim=1)


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """``1 << i`` for i in 0..31 as int32 (bit 31 is the sign bit)."""
    if device not in _BIT_VALUES:
        values = torch.tensor([1 << i for i in range(BITS_PER_WORD)], dtype=torch.int64)
        _BIT_VALUES[device] = torch.where(values >= 2**31, values - 2**32, values).to(torch.int32).to(device)
    return _BIT_VALUES[device]


def bitmask_from_ids(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """One row with exactly ``token_ids`` allowed."""
    bits = torch.zeros(bitmask_width(vocab_size) * BITS_PER_WORD, dtype=torch.int32)
    bits[torch.tensor(sorted(set(token_ids)), dtype=torch.int64)] = 1
    # A word is the sum of its set bits' values: distinct powers of two (bit 31's negative in
    # int32), so the int32 sum never overflows.
    return (bits.view(-1, BITS_PER_WORD) * _bit_values(bits.device)).sum(dim=1, dtype=torch.int32).unsqueeze(0)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits`` to -inf where ``bitmask``'s bit is clear (row r of one masks row r of
    the other), in place: the caller passes a slice of the step's logits, so no row is
    gathered or scattered back. Columns beyond the bitmask's width are disallowed, as in
    ``bitmask_to_bool``."""
    vocab = logits.shape[-1]
    disallowed = (bitmask.unsqueeze(-1) & _bit_values(bitmask.device)).eq(0).flatten(1)
    if disallowed.shape[1] > vocab:
        disallowed = disallowed[:, :vocab]
    elif disallowed.shape[1] < vocab:
        logits[:, disallowed.shape[1]:] = float("-inf")
        logits = logits[:, :disallowed.shape[1]]
    logits.masked_fill_(disallowed, float("-inf"))


class TokenConstraint(abc.ABC):
    """A request's restriction of its next tokens."""
    # True when the constraint decides where the output ends (a grammar allows EOS exactly
    # where it may end, and only EOS once complete): min_tokens then does not apply.
    decides_end: bool = False

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        """Write ``len(drafts) + 1`` rows (they arrive all zero): the next token's, then the
        token's after each prefix of ``drafts``. Leaves the constraint's state as it was."""

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading ``drafts`` the constraint allows (the scheduler does not compute
        drafts that could never be accepted). Leaves the constraint's state as it was."""
        return len(drafts)

    def advance(self, token_id: int) -> None:
        """The request emitted ``token_id`` (it was allowed)."""

    def is_complete(self) -> bool:
        """Nothing more may follow (e.g. the grammar's root rule ended)."""
        return False


class AllowedTokenIds(TokenConstraint):
    """vLLM's ``allowed_token_ids``: the same fixed set at every position."""

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        self._row = bitmask_from_ids(token_ids, vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        bitmask[:] = self._row
