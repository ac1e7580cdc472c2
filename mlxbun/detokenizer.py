"""Streaming detokenization: text released token by token, always adding up to `decode`.

Built by `mlxbun.tokenizer.Tokenizer.detokenizer`; generation streams through it.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """Ids in, text out, one token at a time.

    Text is released only at a token boundary where decoding splits cleanly: the decoded window
    does not end in U+FFFD (an unfinished UTF-8 character of byte-level BPE) and, for ByteFallback
    decoders, the last token is not a `<0xHH>` byte (a byte run decodes as a whole, and a later
    invalid byte turns the whole run into U+FFFD), nor a special token that decoding skips.
    Each window is decoded after a context of already released tokens with non-empty text, so
    decoder effects at the start of a string (Metaspace, SentencePiece's `Strip`) land in the
    context and cancel. Hence `text` is always `decode(tokens[:k])` for the last released
    boundary k, and the pieces add up to `decode(tokens)`. `finalize()` ends the stream;
    `reset()` starts another.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        # tokenizer: an `mlxbun.tokenizer.Tokenizer` (its backend, byte and skippable ids)
        self._backend = tokenizer.backend
        self._byte_ids = tokenizer.byte_token_ids
        self._skip = skip_special_tokens
        # Skipped tokens are invisible to the decoder (bytes on both sides join one run), so they
        # are never a release point.
        self._hold_ids = self._byte_ids | (tokenizer.skippable_ids if skip_special_tokens else frozenset())
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.offset = 0  # for last_segment
        self._ctx = 0  # first token of the decoding context
        self._start = 0  # first token not yet released
        self._ctx_text = ""  # decode(tokens[_ctx:_start])

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _release(self, window_text: str) -> str:
        piece = window_text[len(self._ctx_text) :]
        self.text += piece
        end = len(self.tokens)
        chunk_text = window_text if self._ctx == self._start else self._decode(self.tokens[self._start : end])
        if chunk_text:  # a context with text keeps start-of-string effects out of the next window
            self._ctx, self._ctx_text = self._start, chunk_text
        else:
            self._ctx_text = window_text
        self._start = end
        return piece

    def add_token(self, token_id: int) -> str:
        """Consume one id; return the text it completes ('' while a character is unfinished)."""
        token_id = int(token_id)
        self.tokens.append(token_id)
        if token_id in self._hold_ids:
            return ""
        window = self._decode(self.tokens[self._ctx :])
        if window.endswith(_REPLACEMENT) or not window.startswith(self._ctx_text):
            return ""
        return self._release(window)

    def finalize(self) -> str:
        """Release everything held back (unfinished bytes decode to U+FFFD, as `decode` does)."""
        if self._start == len(self.tokens):
            return ""
        window = self._decode(self.tokens[self._ctx :])
        if window.startswith(self._ctx_text):
            return self._release(window)
        full = self._decode(self.tokens)  # cannot happen for known decoders; stay exact anyway
        piece = full[len(self.text) :] if full.startswith(self.text) else full
        self.text += piece
        self._ctx, self._start, self._ctx_text = 0, len(self.tokens), full
        return piece

    @property
    def last_segment(self) -> str:
        """Text released since the previous read of `last_segment` (mlx-lm's interface)."""
        segment = self.text[self.offset :]
        self.offset = len(self.text)
        return segment
