"""Incremental detokenization and stop strings for the token stream.

Text is decoded over a sliding window of token ids and released only when it no longer ends in U+FFFD, so a
multi-byte character split across tokens is never sent broken. Stop strings are checked on the decoded text;
the tail that could still begin a stop string is held back, so a stop string never leaks to the client.
"""
from __future__ import annotations

from tandem.shared.errors import InvalidRequestError


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False):
        """include_stop: the text ends after the stop string that ended it instead of before."""
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded again for context
        self._read_offset = 0  # tokens whose text has been released into _text
        self._text = ""  # all decoded text so far
        self._sent = 0  # characters of _text already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send (possibly empty). With stop strings, tokens go
        in one at a time and those after the one that completes a stop string are dropped (a message of several
        tokens, from speculative decoding, may run past it), so token_ids ends where plain decoding would."""
        if not self.stop:
            self.token_ids.extend(new_token_ids)
            self._advance(final=False)
            return self._release(final=False)
        delta = ""
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.token_ids.append(token_id)
            self._advance(final=False)
            delta += self._release(final=False)
        return delta

    @property
    def text(self) -> str:
        """The text so far (all of it after finish()), cut at a stop string."""
        return self._text

    def finish(self) -> str:
        """Flush what is left at the end of the stream (an incomplete character is sent as U+FFFD)."""
        self._advance(final=True)
        return self._release(final=True)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        found = [(at, -len(s), s) for s in self.stop if (at := self._text.find(s, max(0, self._sent - len(s) + 1))) != -1]
        if found:  # the earliest stop string (the longest of those starting there) ends the text
            at, _, s = min(found)
            self.stopped, self.stop_string = True, s
            self._text = self._text[: at + len(s) if self.include_stop else at]
        end = len(self._text)
        if not (final or self.stopped) and self.stop:
            hold = max(len(s) for s in self.stop) - 1  # a stop string may be starting in this tail
            end = max(self._sent, end - hold)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta
