"""``bad_words`` (vLLM's meaning): words the output must not contain, as token sequences.

Each word is tokenized as it stands and, as it would appear mid-sentence, after a space (in
byte-level BPE tokenizers the space is part of the word's first token, so " Paris" and
"Paris" are different tokens). A sequence is banned by banning its last token wherever the
tokens generated so far end with the rest of it; a one-token word is banned everywhere. Only
generated tokens count, not the prompt's (as in vLLM): a word whose first tokens end the
prompt is not banned at the first position.

Tokenizing happens once per request, at validation (``tokenize_bad_words``); ``BadWords`` is
the request's index of the sequences, which the logits processor and the scheduler query per
row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from backend.errors import InvalidRequestError, show
from backend.sampling_params import MAX_BAD_WORDS_SEQUENCES, MAX_BAD_WORDS_TOKENS

FIELD = "bad_words"
TokenSequences = tuple[tuple[int, ...], ...]


def tokenize_bad_words(tokenizer: Any, words: Iterable[str]) -> TokenSequences:
    """The token sequences ``words`` ban (vLLM's rule). A word that tokenizes to nothing, or
    more sequences or tokens than vLLM allows, is an InvalidRequestError naming ``bad_words``."""
    sequences: list[tuple[int, ...]] = []
    for given in words:
        word = given.lstrip()
        bare = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not bare:
            raise InvalidRequestError(FIELD, f"{show(given)} tokenizes to no tokens")
        sequences.append(bare)
        # The spelling after a space counts only as another whole-word spelling: a different
        # first token and as many tokens (vLLM's test; "Paris" / " Paris" qualify, while a word
        # whose spaced form splits differently is left to its bare form).
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS_SEQUENCES:
        raise InvalidRequestError(FIELD, f"tokenize to {len(sequences)} token sequences (with and without a "
                                         f"leading space); at most {MAX_BAD_WORDS_SEQUENCES} are allowed")
    num_tokens = sum(len(s) for s in sequences)
    if num_tokens > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequestError(FIELD, f"tokenize to {num_tokens} tokens in all; at most "
                                         f"{MAX_BAD_WORDS_TOKENS} are allowed")
    return tuple(sequences)


class BadWords:
    """A request's banned sequences, indexed by the token before their last one, so that a
    row's check looks only at the sequences its previous token can continue."""

    def __init__(self, sequences: TokenSequences) -> None:
        self.always = sorted({s[0] for s in sequences if len(s) == 1})
        self._by_previous: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for s in sequences:
            if len(s) > 1:
                self._by_previous.setdefault(s[-2], []).append((s[:-1], s[-1]))
        # How many trailing generated tokens a check reads.
        self.context = max(len(s) for s in sequences) - 1

    def banned(self, generated: Sequence[int]) -> list[int]:
        """The tokens that may not follow ``generated`` (the request's generated tokens, or at
        least their last ``context``)."""
        banned = list(self.always)
        if generated:
            for prefix, last in self._by_previous.get(generated[-1], ()):
                if len(prefix) <= len(generated) and tuple(generated[len(generated) - len(prefix):]) == prefix:
                    banned.append(last)
        return banned

    def num_valid_drafts(self, generated: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` are not banned where they stand (a banned draft could
        never equal the sample at its position)."""
        history = list(generated)
        for j, draft in enumerate(drafts):
            if draft in self.banned(history):
                return j
            history.append(draft)
        return len(drafts)


def generated_tail(token_ids: Sequence[int], num_prompt_tokens: int, context: int) -> list[int]:
    """The last ``context`` generated tokens of a request's ``token_ids`` (fewer when it has
    generated fewer): all that ``BadWords.banned`` reads, without copying the whole output."""
    return list(token_ids[max(num_prompt_tokens, len(token_ids) - context):])
