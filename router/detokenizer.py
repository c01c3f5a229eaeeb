"""Token ids to streamed text: incremental detokenization and stop strings.

Decoding each new token on its own is wrong twice over: byte-level tokens may hold part of a
multi-byte UTF-8 character, and some tokenizers decode a token differently at the start of a
text (SentencePiece drops the leading space). So the detokenizer decodes a short window that
starts a few tokens before the new ones and emits what the window adds past the text already
sent, holding back while the window ends in an incomplete character.

Stop strings are matched on the text after that; text that could be the start of a stop string
is held back until the next delta decides, so nothing after a stop string is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# What the decoder yields for bytes that do not (yet) form a whole character.
_INCOMPLETE = "\ufffd"

# Prompt tokens decoded before the first generated one, so it decodes as it would in context.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns the token ids of one sequence, pushed as they are generated, into text deltas.

    `tokenizer` is a `tokenizers.Tokenizer` or a `transformers` fast tokenizer. It decodes
    without `transformers`' clean-up of spaces, which would make deltas disagree with each other.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # _ids is context then pending tokens. The context (the tokens last emitted, or the
        # prompt's tail) only shapes how the pending ones decode; its own text is _context_text.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._context_text = self._decode(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the text they complete (maybe "")."""
        # One at a time, so an incomplete character at the end holds back only itself.
        return "".join(self._push_one(token_id) for token_id in token_ids)

    def finish(self) -> str:
        """Returns the text still held back once the sequence has ended (incomplete bytes
        decode as U+FFFD)."""
        text = self._decode(self._ids)[len(self._context_text):]
        self._ids, self._num_context, self._context_text = [], 0, ""
        return text

    def _push_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._context_text) or text.endswith(_INCOMPLETE):
            return ""
        new_text = text[len(self._context_text):]
        del self._ids[:self._num_context]  # the pending tokens become the next context
        self._num_context = len(self._ids)
        self._context_text = self._decode(self._ids)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces.

    When several stop strings occur, the one that ends first wins (the one a character-by-
    character stream would have hit first); among those ending together, the longest.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Adds text; returns what is safe to emit. Sets `stopped` when a stop string was hit,
        after which everything fed is discarded."""
        if self.stopped:
            return ""
        text = self._held + text
        self._held = ""
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.stopped = True
            return text[:start + len(stop)] if self._include else text[:start]
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> str:
        """Returns the held-back text once generation ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        found = [(start + len(stop), -len(stop), start, stop)
                 for stop in self._stop if (start := text.find(stop)) >= 0]
        if not found:
            return None
        _, _, start, stop = min(found)
        return start, stop

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest end of text that a stop string starts with."""
        longest = min(len(text), max((len(s) - 1 for s in self._stop), default=0))
        for length in range(longest, 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0


@dataclass
class TextDelta:
    """What to stream for one choice after a step."""

    text: str
    # A stop string was hit: this is the choice's last text, and its request should be aborted.
    stopped: bool


class TextStream:
    """Detokenization and stop strings for one choice: token ids in, text to send out."""

    def __init__(self, tokenizer: Any | None, *, prompt_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        """`tokenizer` None: a model served on token ids only; every text is empty."""
        self._detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
                             if tokenizer is not None else None)
        self._stop = StopStringMatcher(stop, include_stop_str_in_output)

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Adds generated tokens; returns the text to send and whether a stop string ended it."""
        text = self._stop.feed(self._detokenizer.push(token_ids) if self._detokenizer else "")
        return TextDelta(text, self._stop.stopped)

    def finish(self) -> TextDelta:
        """Returns the remaining text once the worker ended the choice; `stopped` tells whether
        a stop string was completed by that last text."""
        text = self._stop.feed(self._detokenizer.finish() if self._detokenizer else "")
        return TextDelta(text + self._stop.finish(), self._stop.stopped)
