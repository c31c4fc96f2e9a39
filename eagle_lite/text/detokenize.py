"""Tokens in, text out, a step at a time: what the CLI, the library's `Pipeline.stream` and the server stream."""
from __future__ import annotations

from collections.abc import Callable, Sequence


class Detokenizer:
    """Tokens in, new text out: a partial character or a possible start of a stop string held back; `stopped` once
    a stop string appears (the text is cut before it).

    Each call decodes a short window of the latest tokens, not the whole answer (a long answer would cost its
    length at every step): the window starts a few tokens back, and only what decoding the window adds beyond
    decoding its older part is new text, so tokenizers that treat a text's first token specially (a leading
    space dropped) give the text decoding every token at once gives."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, list(stops)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""       # the decoded text of ids[:self.read]
        self.start = 0       # the window's first token
        self.read = 0        # tokens whose text is in self.text
        self.shown = 0
        self.stopped = False

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if len(self.ids) > self.read:
            older = self.decode(self.ids[self.start:self.read])
            window = self.decode(self.ids[self.start:])
            if final or (len(window) > len(older) and not window.endswith("\ufffd")):
                self.text += window[len(older):]   # a partial character waits for the token that completes it
                self.start, self.read = self.read, len(self.ids)
        text = self.text
        hits = [i for i in (text.find(s, max(0, self.shown - len(s))) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(text)
        else:
            end = max(self.shown, len(text) - self.hold)
        piece, self.shown = text[self.shown:max(end, self.shown)], max(end, self.shown)
        return piece
