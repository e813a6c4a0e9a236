"""After each step: append the sampled token, detokenize, apply stop conditions, emit deltas."""

from __future__ import annotations

from data_plane.engine.detokenizer import detokenize_incrementally
from data_plane.engine.outputs import CompletionDelta
from data_plane.engine.sequence import FinishReason, Sequence
from data_plane.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.max_model_len = max_model_len

    def append_token(
        self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None, grammar_done: bool = False
    ) -> None:
        """Record one sampled token and finish the sequence if a stop condition is met. grammar_done: its
        structured output's grammar is complete after this token, which ends the sequence (`stop`)."""
        params = seq.sampling_params
        seq.output_token_ids.append(token_id)
        if logprobs is not None and params.logprobs is not None:
            seq.output_logprobs.append(logprobs)
        num_out = len(seq.output_token_ids)
        min_reached = num_out >= params.min_tokens
        at_length = num_out >= params.max_tokens or len(seq) >= self.max_model_len
        # EOS and stop token ids end the sequence without adding their text
        if min_reached and not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish(FinishReason.STOP)
        elif min_reached and token_id in params.stop_token_ids:
            seq.finish(FinishReason.STOP, stop_reason=token_id)
        else:
            # the last token: emit a held-back partial character too
            self._detokenize(seq, flush=at_length or grammar_done)
            if min_reached and params.stop:
                self._check_stop_strings(seq)
        if not seq.is_finished and grammar_done:
            seq.finish(FinishReason.STOP)
        if not seq.is_finished and at_length:
            seq.finish(FinishReason.LENGTH)

    def _detokenize(self, seq: Sequence, flush: bool) -> None:
        text, seq.detok_prefix_offset, seq.detok_read_offset = detokenize_incrementally(
            self.tokenizer,
            seq.output_token_ids,
            seq.detok_prefix_offset,
            seq.detok_read_offset,
            seq.sampling_params.skip_special_tokens,
            flush=flush,
        )
        seq.output_text += text
        seq.detok_new_chars = len(text)

    def _check_stop_strings(self, seq: Sequence) -> None:
        params = seq.sampling_params
        new_chars = seq.detok_new_chars
        if not new_chars:
            return
        text = seq.output_text
        for stop in params.stop:
            # only look where the new text could complete a stop string
            begin = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, begin)
            if index != -1:
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = text[:end]
                seq.finish(FinishReason.STOP, stop_reason=stop)
                return

    def take_delta(self, seq: Sequence) -> CompletionDelta | None:
        """What the client has not seen yet; None when there is nothing new (a sequence's finish is news
        once: its request's later outputs, for siblings that still run, do not repeat it)."""
        text_end = len(seq.output_text)
        if not seq.is_finished and seq.sampling_params.stop:
            # hold back text that may turn out to be the start of a stop string
            text_end -= max(len(s) for s in seq.sampling_params.stop) - 1
        text_end = max(text_end, seq.sent_text_offset)
        new_tokens = seq.output_token_ids[seq.sent_token_offset :]
        if not new_tokens and text_end == seq.sent_text_offset and seq.is_finished == seq.sent_finish:
            return None
        logprobs = None
        if seq.sampling_params.logprobs is not None:
            logprobs = seq.output_logprobs[seq.sent_token_offset :]
        delta = CompletionDelta(
            index=seq.index,
            text=seq.output_text[seq.sent_text_offset : text_end],
            token_ids=new_tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
        )
        seq.sent_text_offset = text_end
        seq.sent_token_offset = len(seq.output_token_ids)
        seq.sent_finish = seq.is_finished
        return delta
