"""From sampled tokens to ``RequestOutput``s: stop checks, incremental detokenization, logprobs.

The engine core schedules, runs the model and samples; this module decides, token by token,
whether a request ends (EOS, stop ids, stop strings, min_tokens, max_tokens, the model's
length, a finished grammar) and builds what the caller streams. It never touches the
scheduler or the KV cache: the engine ends a request in the scheduler when an output here
says it finished.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from backend.core.request import Request
from backend.engine.detokenizer import IncrementalDetokenizer, ids_decoder, rust_tokenizer
from backend.outputs import FinishReason, Logprob, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer)
        self._rust = rust_tokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.generation_tokens_total = 0

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output, self._decode,
            self._rust)

    def append_tokens(self, request: Request, token_ids: list[int], logprobs: dict[int, Logprob] | None,
                      ) -> RequestOutput:
        """Append this step's tokens (more than one after accepted drafts) one by one, so
        that EOS, stop ids, stop strings, min_tokens and max_tokens end the request exactly
        where they would one token per step; tokens after the end are dropped. A finished
        output (``finish_reason`` set) releases the request's detokenizer."""
        params = request.sampling_params
        detok = self._detokenizers[request.request_id]
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        delta = ""
        appended: list[int] = []
        for token_id in token_ids:
            request.append_token(token_id)
            appended.append(token_id)
            self.generation_tokens_total += 1
            if token_id in self.eos_token_ids and not params.ignore_eos:
                finish, stop_reason = FinishReason.STOP, token_id
            elif token_id in params.stop_token_ids:
                finish, stop_reason = FinishReason.STOP, token_id
            if finish is not None:
                if params.include_stop_str_in_output:   # the stop token's text too, as in vLLM (EOS has none)
                    delta += detok.add_token(token_id, check_stop=False)[0]
            else:
                text, stop_string = detok.add_token(token_id, check_stop=request.num_output_tokens >= params.min_tokens)
                delta += text
                if stop_string is not None:
                    finish, stop_reason = FinishReason.STOP, stop_string
            if finish is None and request.constraint_complete:
                finish, stop_reason = FinishReason.STOP, token_id   # the grammar ended (ignore_eos too)
            if finish is None and (request.num_output_tokens >= request.max_tokens
                                   or request.num_tokens >= self.max_model_len):
                finish = FinishReason.LENGTH
            if finish is not None:
                break
        new_logprobs = None
        if logprobs is not None:   # requests with logprobs take no drafts: one token
            logprobs = {token: replace(entry, decoded_token=self._token_text(token))
                        for token, entry in logprobs.items()}
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token_ids[0]].logprob
            new_logprobs = [logprobs]
        if finish is not None and not isinstance(stop_reason, str):
            delta += detok.finish()  # release text held back for a stop string that never came
        output = self._output(request, appended, delta, new_logprobs, finish, stop_reason)
        if finish is not None:
            self.release(request.request_id)
        return output

    def final_output(self, request: Request, finish_reason: FinishReason, message: str | None = None,
                     ) -> RequestOutput:
        """The last output of a request ended outside a step (aborted): no new tokens."""
        output = self._output(request, [], "", [], finish_reason)
        output.finish_message = message
        self.release(request.request_id)
        return output

    def error_output(self, request: Request, error: BaseException) -> RequestOutput:
        """The last output of a request that failed: finish_reason "error", the error named."""
        self.release(request.request_id)
        return RequestOutput(request_id=request.request_id, new_token_ids=[], new_text="",
                             finish_reason=FinishReason.ERROR, num_prompt_tokens=request.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens or 0,
                             num_output_tokens=request.num_output_tokens,
                             finish_message=f"{type(error).__name__}: {error}", _all_token_ids=request.token_ids)

    def release(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def _token_text(self, token_id: int) -> str:
        """A token's text on its own, as the output text shows it (special tokens such as EOS
        are not in the text, so their text is ""): the rank-1 entries of a stream's logprobs
        concatenate to its text."""
        return self._decode([token_id])

    def _output(self, request: Request, new_ids: list[int], delta: str,
                new_logprobs: list[dict[int, Logprob]] | None, finish_reason: FinishReason | None,
                stop_reason: str | int | None = None) -> RequestOutput:
        want_logprobs = request.sampling_params.logprobs is not None
        detokenizer = self._detokenizers[request.request_id]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and request.num_output_tokens:   # the prompt is computed
            if request.num_output_tokens == len(new_ids):      # its first output: name the tokens once
                request.prompt_logprobs[1:] = [{token: replace(entry, decoded_token=self._token_text(token))
                                                for token, entry in position.items()}
                                               for position in request.prompt_logprobs[1:]]
            prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_ids, new_text=delta, finish_reason=finish_reason,
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens, new_logprobs=new_logprobs if want_logprobs else None,
            cumulative_logprob=request.cumulative_logprob if want_logprobs else None,
            stop_reason=stop_reason, _all_token_ids=request.token_ids, _detokenizer=detokenizer,
            _text_length=detokenizer.num_released_chars,
            _all_logprobs=request.logprobs if want_logprobs else None, prompt_logprobs=prompt_logprobs)
