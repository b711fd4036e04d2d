"""Incremental detokenization with stop strings, for streaming text deltas.

Tokens are decoded in a sliding window (the last few tokens before the unread ones) so each step
costs O(window), and a delta is held back while it ends in an incomplete UTF-8 sequence (U+FFFD)
or while its tail could still grow into a stop string, so no client ever sees text that is later
taken back.
"""

from __future__ import annotations

_WINDOW = 6  # tokens of left context re-decoded so merges at the boundary come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: object, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.token_ids: list[int] = []
        self.text = ""  # all text decoded so far (up to a stop string, exclusive)
        self._emitted = 0  # chars of self.text already returned
        self._prefix = 0  # token index where the decode window starts
        self._read = 0  # tokens whose text is already in self.text
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now final (may be empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        self._read_tokens(final=False)
        return self._release(final=False)

    def feed(self, new_ids: list[int], finish_reason: str | None) -> tuple[str, list[int], str | None]:
        """One engine step's tokens: returns the final text, the tokens kept (none past a stop
        string) and the finish reason ("stop" when a stop string ended the request). When the
        request ends, whatever was held back is flushed into the text."""
        text, kept = self.add_until_stop(new_ids)
        finish = "stop" if self.stopped else finish_reason
        if finish is not None:
            text += self.flush()
            finish = "stop" if self.stopped else finish  # a stop string in the flushed tail
        return text, kept, finish

    def add_until_stop(self, new_ids: list[int]) -> tuple[str, list[int]]:
        """Add tokens, stopping at the one that completes a stop string; return the final text
        and the tokens kept (those after a stop string are dropped)."""
        if not self.stop:
            return self.add(new_ids), new_ids
        text = ""
        for i, tok in enumerate(new_ids):
            text += self.add([tok])
            if self.stopped:
                return text, new_ids[: i + 1]
        return text, new_ids

    def _read_tokens(self, final: bool) -> None:
        """Move the unread tokens' text into ``self.text``; unless ``final``, wait while it
        ends in an incomplete multi-byte character (decoded as U+FFFD)."""
        if self._read == len(self.token_ids):
            return
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full = self._decode(self.token_ids[self._prefix :])
        if full.endswith("\ufffd") and not final:
            return
        self.text += full[len(prefix_text) :]
        self._read = len(self.token_ids)
        self._prefix = max(0, self._read - _WINDOW)

    def _release(self, final: bool) -> str:
        if self.stop:
            search_from = max(0, self._emitted - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for size in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:size]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        """The request ended: release whatever was held back (an unfinished character too)."""
        if not self.stopped:
            self._read_tokens(final=True)
        return self._release(final=True)
