"""Constrained decoding on the worker: a grammar matcher per constrained sequence, and the
token masks of a step's constrained rows.

A matcher (llguidance's `LLMatcher`) follows one sequence's output tokens and says which
tokens may come next. Grammars compile once per distinct constraint (cached); a new sequence
gets a copy of the compiled matcher. Matcher state is a function of the output tokens alone,
so a sequence resumed elsewhere (migration, re-dispatch) rebuilds it by consuming the tokens
it carries, and one preempted here keeps it.

The masks of a step are computed on the host, in parallel over the rows with the GIL released
(`LLExecutor`), into a bitmask of 32 tokens per int32 word, which the sampler unpacks on the
device (`worker.sampler`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.hf
import torch

from common import structured_output
from common.sampling_params import InvalidRequest, StructuredOutput
from worker.transfer import to_device

# Distinct constraints kept compiled: a service sees the same few schemas again and again.
CACHE_SIZE = 256


class Grammars:
    """Compiles constraints for the model's tokenizer, which is read on first use
    (`tokenizer_loader`, returning None for a model served without one)."""

    def __init__(self, tokenizer_loader: Callable[[], object], vocab_size: int) -> None:
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._hf_tokenizer = None
        self._special_texts: list[str] = []
        self._text_tokenizer: llguidance.LLTokenizer | None = None      # built on first need
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    def use_tokenizer(self, hf_tokenizer) -> None:
        """Builds the grammar engine's view of the tokenizer now (about 0.3 s for a 50k
        vocabulary), from a tokenizer already loaded, instead of on the first constraint."""
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size)
        specials = [t for t in range(self._tokenizer.vocab_size) if self._tokenizer.is_special_token(t)]
        self._special_texts = [text for text in map(self._tokenizer.decode_str, ([t] for t in specials)) if text]
        self._text_tokenizer = None

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `constraint`; raises InvalidRequest naming what does not compile."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
            self._compiled[constraint] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return compiled.deep_copy()

    def forget(self, constraint: StructuredOutput) -> None:
        """Drops a compiled constraint (if cached), so that its next request compiles it anew."""
        self._compiled.pop(constraint, None)

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            hf_tokenizer = self._load_tokenizer()
            if hf_tokenizer is None:
                raise InvalidRequest("structured_output: this model is served without a tokenizer, "
                                     "so there is no text to constrain", "structured_output")
            self.use_tokenizer(hf_tokenizer)
        field = f"structured_output.{constraint.kind}"
        try:
            grammar = structured_output.grammar_of(constraint)
        except ValueError as error:
            raise InvalidRequest(f"{field} does not compile: {error}", field) from None
        matcher = llguidance.LLMatcher(self._tokenizer_for(grammar), grammar)
        if matcher.is_error():
            raise InvalidRequest(f"{field} does not compile: {matcher.get_error()}", field)
        # A grammar that no text satisfies ("start: a\na: a") fails its first mask (which then
        # allows only the end, and would take it): refused now, before its prompt runs, rather
        # than ended as if complete. Any other first-mask error is passed on as llguidance says it.
        first = matcher.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            reason = first.get_error().splitlines()[0][:500]
            if reason == "NoExtensionBias":
                raise InvalidRequest(f"{field} admits no output: no text satisfies it", field)
            raise InvalidRequest(f"{field} cannot be followed: the grammar engine stopped before its first "
                                 f"token: {reason}", field)
        return matcher

    def _tokenizer_for(self, grammar: str) -> llguidance.LLTokenizer:
        """The tokenizer's view, or for a grammar that spells a special token `text_tokenizer`'s."""
        if not spells(grammar, self._special_texts):
            return self._tokenizer
        if self._text_tokenizer is None:
            self._text_tokenizer = text_tokenizer(self._tokenizer, self._hf_tokenizer)
        return self._text_tokenizer

    def allowed(self, rows: list[int], matchers: list[llguidance.LLMatcher], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`SamplingBatch.allowed` for sampling rows `rows` under `matchers` (which have
        consumed every token drawn so far): the rows and their bitmask, on `device`."""
        # Pinned, and copied without blocking: the host goes on while the forward runs. The
        # caching host allocator reuses the buffer only once its copy has run.
        bitmask = self.bitmask(matchers, pinned=device.type == "cuda")
        return to_device(rows, torch.long, device), bitmask.to(device, non_blocking=True)

    def bitmask(self, matchers: list[llguidance.LLMatcher], pinned: bool = False) -> torch.Tensor:
        """The allowed next tokens of each matcher: int32 `[len(matchers), ceil(vocab / 32)]`,
        bit j of word w set when token 32w + j is allowed (on the host)."""
        words = -(-self.vocab_size // 32)
        mask = torch.empty(len(matchers), words, dtype=torch.int32, pin_memory=pinned)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # One matcher may stand for several rows (the first draws of an n > 1 request), and
        # the executor may not use one matcher twice at once: each is computed once, copied.
        first: dict[int, int] = {}
        for row, matcher in enumerate(matchers):
            first.setdefault(id(matcher), row)
        self._executor.unsafe_compute_mask_ptr([(matchers[row], row) for row in first.values()],
                                               mask.data_ptr(), words * 4, len(matchers))
        for row, matcher in enumerate(matchers):
            if first[id(matcher)] != row:
                mask[row] = mask[first[id(matcher)]]
        return mask


def spells(grammar: str, texts: list[str]) -> bool:
    """Whether a grammar's text holds one of `texts`, read past the escapes and one-character
    classes a pattern may write it with (`<\\|im_end\\|>`, `<[|]im_end[|]>`)."""
    plain = grammar.translate(_ESCAPES)
    return any(text in plain for text in texts)


_ESCAPES = str.maketrans("", "", "\\[]")


def text_tokenizer(table: llguidance.LLTokenizer, hf_tokenizer) -> llguidance.LLTokenizer:
    """A view of the tokenizer, for grammars whose text spells a special token ("<|im_end|>"),
    that tokenizes such text as text.

    llguidance keeps special tokens apart from text: none of them matches a literal. But the
    tokenizer it builds (`llguidance.hf.from_tokenizer`, `table`) tokenizes the text a grammar
    forces as the model's tokenizer does, reading "<|im_end|>" as the special token: a grammar
    forcing that literal would offer only a token it then refuses, and the request would fail
    there. This one takes its token table from `table` and tokenizes forced text through
    `_TextTokenizer`, a Python call from the mask computation's threads under the GIL, which
    made the masks of a JSON schema with forced keys 2.2-2.8 times slower (16 cores, 64-256
    rows; docs/BENCHMARKS.md): so only such grammars get it."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextTokenizer(table, hf_tokenizer)),
                                  n_vocab=table.vocab_size)


class _TextTokenizer:
    """What `llguidance.TokenizerWrapper` reads: each token's bytes, which are special, and a
    tokenizer that splits special tokens' text like any other."""

    def __init__(self, table: llguidance.LLTokenizer, hf_tokenizer) -> None:
        self.eos_token_id = table.eos_token
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.tokens = [table.decode_bytes([token]) for token in range(table.vocab_size)]
        self.special_token_ids = [t for t in range(table.vocab_size) if table.is_special_token(t)]
        self._split = copy.copy(hf_tokenizer.backend_tokenizer)
        self._split.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        return self._split.encode(text, add_special_tokens=False).ids


def consume(matcher: llguidance.LLMatcher, tokens: list[int]) -> None:
    """Advances a matcher over tokens already generated (a resumed sequence's); raises
    InvalidRequest when they do not follow the constraint."""
    for position, token in enumerate(tokens):
        if not matcher.consume_token(token):
            raise InvalidRequest(f"output_token_ids[{position}]={token} does not follow the "
                                 f"structured_output constraint: {matcher.get_error()}",
                                 "output_token_ids")
