"""Incremental detokenization with stop strings, for streaming.

Two problems make "decode the new token" wrong:
  * A token may end in the middle of a multi-byte UTF-8 character (byte-level BPE splits
    "中" into three tokens). Decoding it alone gives U+FFFD. So, as vLLM and TGI do, decode a
    short window [prefix_offset:] and compare it with the window's already-emitted part
    [prefix_offset:read_offset]; emit only once the text no longer ends in U+FFFD.
  * A stop string may arrive across several tokens. Text that could still be the start of a
    stop string is held back until it is either completed (and cut) or ruled out.
"""

from __future__ import annotations

from iterserve.replica.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context: enough for tokenizers whose decoding of a token depends
# on its neighbours (sentencepiece's leading-space handling).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        # Only a short tail of the ids is kept: the decode window never reaches further back.
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""  # everything decoded so far, cut at a matched stop string
        self._num_emitted = 0  # characters of output_text already returned
        self.matched_stop: str | None = None

    @property
    def finished(self) -> bool:
        return self.matched_stop is not None

    def add(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Feed newly generated ids; return (text safe to emit now, stop string if matched).

        After a stop string matched, further calls return ("", None).
        """
        if self.finished:
            return "", None
        self._ids.extend(new_token_ids)
        previous_len = len(self.output_text)
        self.output_text += self._decode_new()
        stop, cut = self._find_stop(previous_len)
        if stop is not None:
            self.output_text = self.output_text[:cut]
            self.matched_stop = stop
            return self._emit(len(self.output_text)), stop
        return self._emit(len(self.output_text) - self._held_back()), None

    def flush(self) -> str:
        """At finish: whatever is still held back or undecoded (possibly ending in U+FFFD)."""
        if not self.finished:
            prefix = self._window_text(self._prefix_offset, self._read_offset)
            tail = self._window_text(self._prefix_offset, len(self._ids))
            self.output_text += tail[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(len(self.output_text))

    def _window_text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str:
        prefix = self._window_text(self._prefix_offset, self._read_offset)
        full = self._window_text(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or a token that decodes to nothing yet)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop the consumed ids, keeping the window's left context.
        drop = max(0, self._prefix_offset - CONTEXT_TOKENS)
        if drop:
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return full[len(prefix):]

    def _find_stop(self, previous_len: int) -> tuple[str | None, int]:
        """The stop string that completes first, and where the output is cut.

        "First" is the earliest end (ties: the longest), which is where generation would
        have stopped however the text was split into tokens and steps.
        """
        if not self.stop:
            return None, 0
        longest = max(len(s) for s in self.stop)
        # A match must end in the new text, so it starts at most len(stop) - 1 chars earlier;
        # and never in emitted text, since any possible stop start is held back.
        search_from = max(0, previous_len - longest + 1, self._num_emitted)
        best: tuple[int, int, str] | None = None  # end, start, stop
        for s in self.stop:
            index = self.output_text.find(s, search_from)
            if index >= 0 and (best is None or (index + len(s), index) < best[:2]):
                best = (index + len(s), index, s)
        if best is None:
            return None, 0
        end, start, s = best
        return s, end if self.include_stop_str_in_output else start

    def _held_back(self) -> int:
        """Length of the longest suffix of output_text that could begin a stop string."""
        text = self.output_text[self._num_emitted:]
        for length in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1),
                            0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0

    def _emit(self, upto: int) -> str:
        delta = self.output_text[self._num_emitted:upto]
        self._num_emitted = max(self._num_emitted, upto)
        return delta
