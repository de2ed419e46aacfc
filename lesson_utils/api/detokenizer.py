"""Streaming text out of a growing list of token ids.

A byte-level tokenizer splits one character across several tokens when its UTF-8 bytes do not all fit in one (an
accent, a CJK character, an emoji). Decoding such a token alone gives U+FFFD, the replacement character; a server
that sent each token's text as it came would print garbage. :class:`IncrementalDetokenizer` sends only text that is
final: it decodes a short window of tokens already sent plus the new ones, and holds the new text back while it
ends in U+FFFD (the character is not complete yet). Decoding a window rather than the token alone also keeps what a
tokenizer decides from context (a leading space) right.

:class:`StopStrings` finds stop strings across the pieces and holds back a tail that might still become one.

Invariant: the concatenation of everything :meth:`IncrementalDetokenizer.push` returned, then
:meth:`IncrementalDetokenizer.flush`, equals ``tokenizer.decode(all generated ids)`` for a byte-level tokenizer.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def safe_new_text(decode, ids: list[int], start: int, sent: int) -> tuple[str, int, int]:
    """The text ``ids[sent:]`` adds that is safe to send, and the window's new ``(start, sent)``.

    ``decode(ids) -> str``; ``ids[start:sent]`` are tokens whose text was already sent (the window's context). The
    new text is ``decode(ids[start:]) - decode(ids[start:sent])``; it is held back (``""`` and the window unchanged)
    while it is empty, ends in U+FFFD, or the context's text changed under the new tokens. When sent, the window moves
    on: the tokens just sent become the next call's context. The reference of lesson 13's exercise 1."""
    before = decode(ids[start:sent])
    after = decode(ids[start:])
    if len(after) <= len(before) or after.endswith(REPLACEMENT) or not after.startswith(before):
        return "", start, sent
    return after[len(before) :], sent, len(ids)


class IncrementalDetokenizer:
    """Text for one output stream. ``prompt_ids``' last tokens are the first window's context (so the first token's
    text is decoded as it follows the prompt); special tokens (an end of turn) are skipped."""

    def __init__(self, tokenizer, prompt_ids: list[int] = (), rule=safe_new_text, context: int = 4):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self._rule = rule
        self.ids = [int(t) for t in list(prompt_ids)[-context:]]
        self._start = 0
        self._sent = len(self.ids)
        self._first_output = len(self.ids)  # generated tokens start here
        self.text = ""  # everything sent so far

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; returns the text that became final (often ``""``)."""
        self.ids.extend(int(t) for t in token_ids)
        piece, self._start, self._sent = self._rule(self._decode, self.ids, self._start, self._sent)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, even an incomplete character (the model did produce it)."""
        whole = self._decode(self.ids[self._first_output :])
        rest = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += rest
        self._start = self._sent = len(self.ids)
        return rest


class StopStrings:
    """Cut a stream at the first of ``stops``: :meth:`feed` returns the text that may be sent now and whether a stop
    string ended the stream. A tail that could still grow into a stop string is held until it cannot."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at = min(hits)[0]
            self.stopped, self._held = True, ""
            return text[:at], True
        keep = 0
        for s in self.stops:  # the longest tail of text that is a prefix of some stop string
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if s.startswith(text[-n:]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of a stream no stop string ended: the held tail is text after all."""
        rest, self._held = self._held, ""
        return "" if self.stopped else rest
