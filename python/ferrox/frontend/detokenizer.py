"""Incremental detokenization of one sequence, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tokenizers import Tokenizer

from ferrox.common.errors import UnsupportedModelError
from ferrox.common.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so the first output token is spaced as it is
# after the prompt (SentencePiece drops the "▁" of a text's first token).
PROMPT_CONTEXT_TOKENS = 4
MAX_PROMPT_CONTEXT_TOKENS = 16
# Past this many undecided tokens the window is emitted even if it still ends in U+FFFD,
# so that a stream of invalid bytes costs O(1) per token, not O(length).
MAX_PENDING_TOKENS = 64


class IncrementalDetokenizer:
    """Turns the output token ids of one sequence into text, a few tokens at a time.

    The decode window holds the last few token ids:

        | prefix: text already emitted | pending: text not emitted yet |
        ^ window start                 ^ read index                    ^ end

    Each update decodes the prefix and the whole window and emits what the pending tokens
    add: the text after the common prefix of the two. It emits nothing while the window's
    text ends in U+FFFD (a multi-byte character whose bytes have not all arrived) or
    adds nothing (skipped special tokens); otherwise the pending tokens become the next
    prefix. Both decodes cover a few tokens, never the whole output. The first window
    starts with the last prompt tokens, so output text is what the output adds to the
    prompt's text.

    ``get_delta`` returns the emitted text not returned before, minus any tail that may
    still turn into a stop string; ``finish`` releases it. ``spaces_between_special_tokens``
    is not applied: fast tokenizers have no such option, so the text matches their decode.
    """

    def __init__(
        self,
        tokenizer: object,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = cast(list[str], params.stop)
        self._max_stop_len = max((len(stop) for stop in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._window = self._prompt_context(prompt_token_ids)
        self._read_index = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._chunks: list[str] = []  # the emitted text, in pieces
        self._num_chars = 0
        self._num_returned_chars = 0
        self._num_output_tokens = 0
        self._stop_string: str | None = None
        self._is_finished = False
        self._anchor: tuple[list[int], str] | None = None
        self._token_texts: dict[int, str] = {}

    @property
    def output_text(self) -> str:
        """All output text so far; cut at the stop string once one matched."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends tokens; returns the stop string they completed, if any.

        Tokens given after a stop string matched or after ``finish`` are ignored.
        """
        if self._is_finished:
            return None
        self._window.extend(int(token_id) for token_id in new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        num_old_chars = self._num_chars
        self._emit(force=len(self._window) - self._read_index >= MAX_PENDING_TOKENS)
        return self._check_stop(num_old_chars)

    def finish(self) -> str | None:
        """Emits the tokens held back and releases all text to ``get_delta``.

        Returns the stop string the released text completed, if any.
        """
        if self._is_finished:
            return None
        num_old_chars = self._num_chars
        self._emit(force=True)
        stop = self._check_stop(num_old_chars)
        self._is_finished = True
        return stop

    def get_delta(self) -> str:
        """Text not returned by earlier calls that no later stop string can cut."""
        text = self._tail(self._num_chars - self._num_returned_chars)
        if not (self._is_finished or self._include_stop):
            text = text[: len(text) - _partial_stop_len(text, self._stop)]
        self._num_returned_chars += len(text)
        return text

    def decode_token(self, token_id: int) -> str:
        """The text of one token as it reads after other text (for logprobs)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode_in_context(token_id)
        return text

    def _emit(self, force: bool) -> None:
        if self._read_index == len(self._window):
            return
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) and not force:
            return
        delta = text[_common_prefix_len(self._prefix_text, text) :]
        if not delta:
            if force:  # keep the prefix as context; the pending tokens add no text
                del self._window[self._read_index :]
            return
        self._chunks.append(delta)
        self._num_chars += len(delta)
        del self._window[: self._read_index]
        self._read_index = len(self._window)
        self._prefix_text = self._decode(self._window)

    def _check_stop(self, num_old_chars: int) -> str | None:
        num_new_chars = self._num_chars - num_old_chars
        if not self._stop or num_new_chars == 0 or self._num_output_tokens < self._min_tokens:
            return None
        # A new match ends in the new text, so it starts at most max_stop_len - 1 before it.
        text = self._tail(num_new_chars + self._max_stop_len - 1)
        match = _find_stop(text, len(text) - num_new_chars, self._stop)
        if match is None:
            return None
        stop, start = match
        end = start + len(stop) if self._include_stop else start
        kept = self.output_text[: self._num_chars - len(text) + end]
        self._chunks = [kept]
        self._num_chars = len(kept)
        self._stop_string = stop
        self._is_finished = True
        return stop

    def _tail(self, num_chars: int) -> str:
        """The last ``num_chars`` characters of the emitted text (fewer if shorter)."""
        pieces: list[str] = []
        size = 0
        for chunk in reversed(self._chunks):
            if size >= num_chars:
                break
            pieces.append(chunk)
            size += len(chunk)
        text = "".join(reversed(pieces))
        return text[len(text) - min(num_chars, len(text)) :]

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        # Start at a token that decodes to text on its own: not a skipped special token,
        # not the middle of a multi-byte character (its decode would start with U+FFFD).
        tail = [int(token_id) for token_id in prompt_token_ids[-MAX_PROMPT_CONTEXT_TOKENS:]]
        start = max(0, len(tail) - PROMPT_CONTEXT_TOKENS)
        while start > 0:
            head = self._decode(tail[start : start + 1])
            if head and not head.startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        return tail[start:]

    def _decode_in_context(self, token_id: int) -> str:
        # Decoded alone, a SentencePiece token loses its leading space; after an anchor
        # token (one that decodes to plain text) it keeps it.
        if self._anchor is None:
            ids = self._tokenizer.encode("a", add_special_tokens=False).ids
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
            self._anchor = (ids, text) if len(ids) == 1 and text else ([], "")
        anchor_ids, anchor_text = self._anchor
        text = self._tokenizer.decode([*anchor_ids, token_id], skip_special_tokens=False)
        if text.startswith(anchor_text):
            return text[len(anchor_text) :]
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def backend_tokenizer(tokenizer: object) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a fast Hugging Face tokenizer, or the argument."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise UnsupportedModelError(
        "detokenization needs a fast tokenizer (PreTrainedTokenizerFast or "
        f"tokenizers.Tokenizer), got {type(tokenizer).__name__}"
    )


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    size = 0
    for char_a, char_b in zip(a, b, strict=False):
        if char_a != char_b:
            break
        size += 1
    return size


def _find_stop(text: str, num_old_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that ends first in ``text[num_old_chars:]`` (longest on a tie)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, num_old_chars - len(stop) + 1))
        if start < 0:
            continue
        if best is None or (start + len(stop), start) < (best[1] + len(best[0]), best[1]):
            best = (stop, start)
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
