"""Incremental detokenization with stop strings.

Streamed deltas concatenate to exactly the full decode: a token's text is released only
once it no longer ends in an incomplete UTF-8 sequence, and decoding always includes a
few tokens of left context (so tokenizers that strip a leading space at the start of a
sequence still produce it mid-sequence). Stop strings end the request even when they
span tokens; they are not emitted, and any tail of the text that could still grow into a
stop string is held back, so no partial stop string ever reaches a client.

With ``include_stop`` (vLLM's ``include_stop_str_in_output``) the stop string is kept (the
text ends with it) and nothing is held back, as in vLLM: a partial stop string is text the
client gets either way.
"""

from __future__ import annotations

from typing import Any, Callable

from tokenizers.decoders import DecodeStream

# Prompt tokens kept as decoding context for the first generated tokens.
_CONTEXT_TOKENS = 5

IdsDecoder = Callable[[list[int]], str]


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer`` where its decode is exactly
    ``tokenizer.decode`` (a tokenizers-backed tokenizer that neither overrides ``_decode`` nor
    cleans up spaces afterwards), else None."""
    from transformers import TokenizersBackend

    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer
    return None


def ids_decoder(tokenizer: Any) -> IdsDecoder:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` as one callable, calling the Rust
    decode directly where it is the same (``rust_tokenizer``): transformers' wrapper around it
    (argument conversion, keyword handling) costs several times the decode itself."""
    rust = rust_tokenizer(tokenizer)
    if rust is not None:
        return lambda ids: rust.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], include_stop: bool = False,
                 decode: IdsDecoder | None = None, rust: Any | None = None) -> None:
        """``decode``: ``ids_decoder(tokenizer)``, made once by a caller that has many requests.
        ``rust``: ``rust_tokenizer(tokenizer)``; given, a token's text is released by the Rust
        tokenizers' ``DecodeStream``, one call per token instead of two decodes from Python.
        It keeps the same window as the Python path (the same left context, released where no
        incomplete character is left), so the deltas are the same; the Python path stays the
        reference, releases what is held at ``finish``, and takes over if the stream fails."""
        self._decode = decode or ids_decoder(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt given as ids may end inside a character (a generation cut there and sent
        # back to continue): its last tokens are then no context. Kept, the Python path would
        # swallow the character the new tokens complete, and the DecodeStream would never set
        # its prefix and release the context's own text as generated text.
        while self._ids and self._decode(self._ids).endswith("\ufffd"):
            self._ids.pop()
        self._prefix_offset = 0                 # decode window start (left context)
        self._read_offset = len(self._ids)      # tokens before this are already in `text`
        self.text = ""                          # all generated text so far (truncated at a stop string)
        self._num_emitted = 0                   # chars of `text` already returned as deltas
        self._rust = rust
        self._stream = None if rust is None else DecodeStream(ids=self._ids, skip_special_tokens=True)

    def _pending_text(self, force: bool) -> str:
        if self._stream is not None and not force:
            try:
                text = self._stream.step(self._rust, self._ids[-1])
            except Exception:  # noqa: BLE001 - e.g. its prefix check failed: the Python path from here
                self._stream = None
                return self._python_pending_text(force)
            if text is None:
                return ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text
        return self._python_pending_text(force)

    def _python_pending_text(self, force: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not force):
            return ""  # nothing printable yet (e.g. half of a multi-byte character)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def add_token(self, token_id: int, check_stop: bool = True) -> tuple[str, str | None]:
        """Feed one generated token. Returns (delta to emit now, the stop string that hit or None)."""
        self._ids.append(token_id)
        old_len = len(self.text)
        self.text += self._pending_text(force=False)
        if check_stop and self.stop and len(self.text) > old_len:
            # Only stop strings that end in the new text: one that ended before was either found
            # then or not looked for (min_tokens), and must not cut text already released.
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
            if hits:
                index, stop = min(hits)
                end = index + len(stop) if self.include_stop else index
                self.text = self.text[:end]
                return self._emit(end), stop
        return self._emit(len(self.text) - self._held_back()), None

    def finish(self) -> str:
        """The request ended for another reason: release everything still held back."""
        self.text += self._pending_text(force=True)
        return self._emit(len(self.text))

    @property
    def num_released_chars(self) -> int:
        """How many chars of ``text`` were returned as deltas. ``text`` before that never
        changes again (a stop string only ever truncates what was held back), so slicing it
        later gives the same released text."""
        return self._num_emitted

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string
        (none when stop strings stay in the text)."""
        tail = self.text[-self.max_stop_len:] if self.max_stop_len and not self.include_stop else ""
        for start in range(len(tail)):
            suffix = tail[start:]
            if any(s.startswith(suffix) for s in self.stop):
                return len(suffix)
        return 0

    def _emit(self, end: int) -> str:
        end = max(end, self._num_emitted)
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta
