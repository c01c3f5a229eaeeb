"""Batched sampling on the device: logit bias, allowed ids, penalties, bad words, temperature,
top-k/top-p/min-p, seeded draws; and the model's own logprobs (of drawn and of prompt tokens).

Randomness of a seeded sequence is a pure function of (seed, position, token id): a counter-
based hash gives each vocabulary entry a uniform number, and the token drawn is the winner of
an exponential race (`argmax p / -log u`, equivalent to sampling from p). So a seeded
sequence draws the same tokens whatever else is in the batch, and after preemption by
recompute or migration to another worker.
"""

from dataclasses import dataclass

import numpy as np
import torch

from common.sampling_params import SamplingParams
from worker.logits_processors import LogitsProcessor, ProcessorBatch
from worker.transfer import to_device

_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), one per (row, token): `seeds[B]`, `positions[B]` int64,
    `token_ids[V]` or `[B, V]`."""
    key = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ (positions * 0x9E3779B1 & _M32)))
    return uniform_from_bits(_mix32(key[:, None] ^ ((token_ids * 0x27D4EB2F) & _M32)))


def uniform_from_bits(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) as float32 numbers strictly inside (0, 1): the top 23 bits plus a
    half, over 2^23, every value exact. (With 24 bits, 2^24 - 1 + 0.5 rounds to 2^24 in float32:
    u = 1, whose -log is 0, and the exponential race divided a filtered token's zero
    probability by it: NaN, which argmax takes. One draw in 2^24 per token, about one step in
    340 over a 49k vocabulary, drew a token that top-k, top-p, a grammar or a ban had ruled out.)"""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class BadWords:
    """A request's bad words as token sequences (`LLMEngine.add_request` tokenizes them):
    `tokens`, the words of one token, never drawn; `sequences`, longer ones, each of whose last
    token is not drawn where the output so far ends with the rest of it."""
    tokens: tuple[int, ...] = ()
    sequences: tuple[tuple[int, ...], ...] = ()


@dataclass
class SamplingRow:
    """What sampling needs of one sequence; its token lists are read only when a penalty
    or a bad word of several tokens asks for them (copying them every step would cost
    O(length) per sequence)."""
    params: SamplingParams
    seed: int
    position: int                   # of the token being drawn
    token_ids: list[int]            # prompt followed by the generated tokens the host knows
    prompt_len: int
    banned: list[int]               # ids masked for min_tokens
    bad_words: BadWords | None = None
    # params.allowed_token_ids as a tensor, made once per sequence: a step does not walk the
    # lists (up to the vocabulary's size each) in Python.
    allowed_ids: torch.Tensor | None = None
    # Its pending token's row among the previous step's draws (`SamplingBatch.build`'s
    # `pending`), the last generated token, which the host does not know yet; -1: none.
    pending_row: int = -1

    def __post_init__(self):
        if self.allowed_ids is None and self.params.allowed_token_ids:    # not given cached
            self.allowed_ids = torch.tensor(self.params.allowed_token_ids, dtype=torch.long)


@dataclass
class BadWordSequences:
    """The bad words of several tokens of a step's rows, one entry each, on the device: entry e
    bans token `last[e]` in row `rows[e]` when `recent[e]`, the row's latest output tokens, end
    with `prefixes[e]` (both right-aligned over the longest prefix, -1 before their start)."""
    rows: torch.Tensor       # [E]
    last: torch.Tensor       # [E]
    prefixes: torch.Tensor   # [E, W]
    recent: torch.Tensor     # [E, W]

    @classmethod
    def build(cls, rows: list[SamplingRow], device: torch.device, pending: torch.Tensor | None
              ) -> "BadWordSequences | None":
        entries = [(i, word) for i, r in enumerate(rows) if r.bad_words for word in r.bad_words.sequences]
        if not entries:
            return None
        width = max(len(word) for _, word in entries) - 1

        def recent(row: SamplingRow) -> list[int]:
            # A pending token ends the output; its place is filled on the device below.
            has_pending = row.pending_row >= 0
            known = row.token_ids[max(row.prompt_len, len(row.token_ids) - width + has_pending):]
            tail = known + [-1] * has_pending
            return [-1] * (width - len(tail)) + tail

        long = lambda xs: to_device(xs, torch.long, device)  # noqa: E731
        out = cls(rows=long([i for i, _ in entries]), last=long([word[-1] for _, word in entries]),
                  prefixes=long([[-1] * (width + 1 - len(word)) + list(word[:-1]) for _, word in entries]),
                  recent=long([recent(rows[i]) for i, _ in entries]))
        waiting = [(e, rows[i].pending_row) for e, (i, _) in enumerate(entries) if rows[i].pending_row >= 0]
        if waiting:
            entry_ids, pending_rows = zip(*waiting)
            out.recent[long(entry_ids), -1] = pending[long(pending_rows)]
        return out


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's rows as device tensors."""
    # Per-row tensors; the sampling ones are None for an all-greedy batch, the penalty ones
    # when no row has a penalty.
    temperature: torch.Tensor | None   # [B] float, 0 = greedy
    top_k: torch.Tensor | None         # [B] int, vocab size when disabled
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: torch.Tensor | None         # [B] int64
    positions: torch.Tensor | None     # [B] position of the token being drawn
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: torch.Tensor | None  # [B, L] padded with -1, only when penalties are used
    prompt_ids: torch.Tensor | None  # [B, L'] padded with -1, only for repetition penalty
    banned: tuple[list[int], list[int]] | None  # (rows, token ids) masked: min_tokens, one-token bad words
    # (rows, token ids, biases) of logit_bias, and (rows, token ids) of allowed_token_ids.
    bias: tuple[list[int], list[int], list[float]] | None
    only: tuple[torch.Tensor, torch.Tensor] | None
    bad_sequences: BadWordSequences | None     # bad words of several tokens (one-token ones are banned)
    # The custom logits processors some row selected, in the worker's order, each with the
    # indices of those rows and what it knows of them.
    processors: list[tuple[LogitsProcessor, torch.Tensor, ProcessorBatch]]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # How many of the largest logits top-k/top-p look at: the widest top_k when every sampling
    # row sets one, else the whole vocabulary (a full sort; top-p alone needs one).
    candidates: int
    logprobs_top_n: int | None      # widest top-n asked for; None: no row wants logprobs
    # Rows under a grammar: (their row indices [k], bitmask int32 [k, ceil(V / 32)] of the
    # tokens each may draw, bit j of word w for token 32w + j), on the device. Set by the
    # engine after `build`, once the host knows the tokens the grammars follow.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device,
              pending: torch.Tensor | None = None, processors: dict[str, LogitsProcessor] | None = None
              ) -> "SamplingBatch":
        """`pending`: the previous step's draws on the device, where rows' pending tokens are;
        `processors`: the worker's custom logits processors, by name."""
        params = [r.params for r in rows]
        f32 = lambda xs: to_device(xs, torch.float32, device)  # noqa: E731
        penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                        for p in params)
        repetition = any(p.repetition_penalty != 1.0 for p in params)

        def padded(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            return to_device([x + [-1] * (width - len(x)) for x in lists], torch.long, device)

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        # min_tokens' bans, and the bad words of one token.
        banned = [(i, t) for i, r in enumerate(rows)
                  for t in (*r.banned, *(r.bad_words.tokens if r.bad_words else ()))]
        all_greedy = all(p.greedy for p in params)
        sampling = [p for p in params if not p.greedy]
        # A greedy batch needs none of the per-row tensors: skip their host-to-device copies.
        needs = lambda flag, make: make() if flag else None  # noqa: E731
        return cls(
            # 0 for every greedy row, also one whose tiny temperature would overflow the logits.
            temperature=needs(not all_greedy, lambda: f32([0.0 if p.greedy else p.temperature
                                                            for p in params])),
            top_k=needs(not all_greedy, lambda: to_device(
                [p.top_k if p.top_k > 0 else vocab_size for p in params], torch.long, device)),
            top_p=needs(not all_greedy, lambda: f32([p.top_p for p in params])),
            min_p=needs(not all_greedy, lambda: f32([p.min_p for p in params])),
            seeds=needs(not all_greedy, lambda: to_device([r.seed for r in rows], torch.long, device)),
            positions=needs(not all_greedy, lambda: to_device([r.position for r in rows], torch.long, device)),
            presence=needs(penalties, lambda: f32([p.presence_penalty for p in params])),
            frequency=needs(penalties, lambda: f32([p.frequency_penalty for p in params])),
            repetition=needs(penalties, lambda: f32([p.repetition_penalty for p in params])),
            output_ids=needs(penalties, lambda: padded([r.token_ids[r.prompt_len:] for r in rows])),
            prompt_ids=needs(repetition, lambda: padded([r.token_ids[:r.prompt_len] for r in rows])),
            banned=tuple(map(list, zip(*banned))) if banned else None,
            bias=tuple(map(list, zip(*bias))) if bias else None,
            only=_allowed_ids(rows, device),
            bad_sequences=BadWordSequences.build(rows, device, pending),
            processors=_processor_calls(rows, processors or {}, device),
            all_greedy=all_greedy,
            any_top_k=any(0 < p.top_k < vocab_size for p in sampling),
            any_top_p=any(p.top_p < 1.0 for p in sampling),
            any_min_p=any(p.min_p > 0.0 for p in sampling),
            candidates=(max(p.top_k for p in sampling) if sampling and all(0 < p.top_k < vocab_size
                                                                           for p in sampling)
                        else vocab_size),
            logprobs_top_n=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )


def _allowed_ids(rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row index, token id) of every id the rows' allowed_token_ids list, on `device`."""
    listed = [(i, r.allowed_ids) for i, r in enumerate(rows) if r.allowed_ids is not None]
    if not listed:
        return None
    counts = torch.tensor([len(ids) for _, ids in listed])
    row_index = torch.repeat_interleave(torch.tensor([i for i, _ in listed]), counts)
    return (to_device(row_index, torch.long, device),
            to_device(torch.cat([ids for _, ids in listed]), torch.long, device))


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the drawn token, [(token id, logprob) of the top n]) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class _HostCopies:
    """Device tensors on their way to the host: the copies start at once and `lists` waits for
    them only, so the host can prepare and launch the next step meanwhile."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self._host = [t.to("cpu", non_blocking=True) for t in tensors]
        self._ready = None
        if tensors[0].is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def lists(self) -> list[list]:
        if self._ready is not None:
            self._ready.synchronize()
        return [t.tolist() for t in self._host]


def _pair_logprobs(chosen: list[float], top_ids: list[list[int]], top_values: list[list[float]]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top_ids, top_values)]


# What the host reads for a row that drew nothing: every logit -inf (its constraints together
# allow no token), or NaN (the model, or its LoRA adapter, computed no number).
NO_TOKEN_ALLOWED = -1
NAN_LOGITS = -2


class SampledTokens:
    """One step's draws. `token_ids` stays on the device, where the next step reads the
    tokens it computes; their host copies (and the logprobs') are read by `read`. `reported`
    is what the host reads: `token_ids`, or NO_TOKEN_ALLOWED / NAN_LOGITS in a row that drew
    nothing (whose device id is still a valid one, since the next step may embed it)."""

    def __init__(self, token_ids: torch.Tensor, logprob_tensors: tuple[torch.Tensor, ...] | None,
                 reported: torch.Tensor):
        self.token_ids = token_ids
        self._copies = _HostCopies((reported, *(logprob_tensors or ())))

    def read(self) -> SampleResult:
        token_ids, *logprob_lists = self._copies.lists()
        if not logprob_lists:
            return SampleResult(token_ids, [None] * len(token_ids))
        return SampleResult(token_ids, _pair_logprobs(*logprob_lists))


@dataclass
class PromptScoring:
    """The prompt tokens one step scores (prompt logprobs), on the host: `rows` are the step's
    flat token indices whose logits predict them, `token_ids` the tokens (each the prompt
    token after its row's), `top_n` the widest top-n asked for."""
    rows: np.ndarray
    token_ids: list[int]
    top_n: int


class PromptLogprobs:
    """One step's prompt logprobs, `token_logprobs`' three tensors, on their way to the host."""

    def __init__(self, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        self._copies = _HostCopies(tensors)

    def read(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per scored token: (its logprob, [(token id, logprob) of the top n])."""
        return _pair_logprobs(*self._copies.lists())


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own logprobs (a log-softmax of `logits[R, V]`): of `token_ids[R]`, and the
    `top_n` largest of each row, as (chosen [R], top ids [R, top_n], top values [R, top_n])."""
    lp = logits.log_softmax(-1)
    top_values, top_ids = lp.topk(top_n, dim=-1)
    return lp.gather(1, token_ids[:, None])[:, 0], top_ids, top_values


def _processor_calls(rows: list[SamplingRow], processors: dict[str, LogitsProcessor], device: torch.device
                     ) -> list[tuple[LogitsProcessor, torch.Tensor, ProcessorBatch]]:
    """Each processor some row selected, with those rows and what it knows of them."""
    if not any(r.params.logits_processors for r in rows):
        return []
    long = lambda xs: to_device(xs, torch.long, device)  # noqa: E731
    calls = []
    for name, processor in processors.items():
        indices = [i for i, r in enumerate(rows) if name in r.params.logits_processors]
        if indices:
            selected = [rows[i] for i in indices]
            calls.append((processor, long(indices), ProcessorBatch(
                prompt_lens=long([r.prompt_len for r in selected]),
                output_lens=long([r.position - r.prompt_len for r in selected]),
                extra_args=[r.params.extra_args for r in selected])))
    return calls


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, torch.where(ids < 0, vocab_size, ids), torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _token_counts(b.output_ids, vocab)
    if b.prompt_ids is not None:
        seen = (out_counts + _token_counts(b.prompt_ids, vocab)) > 0
        rep = b.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - b.frequency[:, None] * out_counts
    return logits - b.presence[:, None] * (out_counts > 0).float()


def filter_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Masks tokens outside top-k, top-p and min-p with -inf (on temperature-scaled logits).
    Top-p keeps the smallest set of most likely tokens (after top-k) whose mass reaches top_p;
    min-p keeps tokens at least min_p times as likely as the most likely one."""
    inf = float("-inf")
    if b.any_top_k or b.any_top_p:
        # Sorted descending: over the widest top_k only, when every sampling row has one.
        values, order = logits.topk(b.candidates, dim=-1)
        if b.any_top_k:
            rank = torch.arange(b.candidates, device=logits.device)
            values = values.masked_fill(rank >= b.top_k[:, None], inf)
        if b.any_top_p:
            probs = values.softmax(-1)
            before = probs.cumsum(-1) - probs                       # mass ranked above each token
            values = values.masked_fill(before >= b.top_p[:, None], inf)   # the first one stays
        logits = torch.full_like(logits, inf).scatter(1, order, values)
    if b.any_min_p:
        # p_i >= min_p * p_max, in logits: the ratio does not depend on the normalization.
        floor = logits.max(-1, keepdim=True).values + b.min_p.log()[:, None]
        logits = logits.masked_fill(logits < floor, inf)
    return logits


def apply_bad_word_sequences(logits: torch.Tensor, b: BadWordSequences) -> torch.Tensor:
    """`logits` with each bad word's last token at -inf in its row where the row's output ends
    with the rest of the word: all entries compared at once, no host sync (the entries that
    do not match add 0)."""
    matches = ((b.recent == b.prefixes) | (b.prefixes < 0)).all(-1)
    return logits.index_put((b.rows, b.last), torch.where(matches, float("-inf"), 0.0), accumulate=True)


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token a row's bitmask does not allow at -inf (rows without a mask
    untouched); the bits unpack on the device, one int32 word per 32 tokens."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    return logits.index_copy(0, rows, logits[rows].masked_fill(~allowed, float("-inf")))


def sample(logits: torch.Tensor, b: SamplingBatch) -> SampledTokens:
    """Draws one token per row of `logits[B, V]` (float32), without waiting for the device."""
    raw = logits
    if b.bias is not None:
        rows, ids = (to_device(x, torch.long, logits.device) for x in b.bias[:2])
        logits = logits.index_put((rows, ids), to_device(b.bias[2], torch.float32, logits.device),
                                  accumulate=True)
    if b.only is not None:
        # Rows that list allowed ids keep only those; other rows are untouched.
        rows, ids = b.only
        keep = torch.zeros_like(logits, dtype=torch.bool).index_put((rows, ids), torch.tensor(True, device=logits.device))
        listed = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device).index_fill(0, rows, True)
        logits = logits.masked_fill(listed[:, None] & ~keep, float("-inf"))
    if b.output_ids is not None:
        logits = apply_penalties(logits, b)
    if b.banned is not None:
        rows, ids = (to_device(x, torch.long, logits.device) for x in b.banned)
        logits = logits.index_put((rows, ids), torch.full((), float("-inf"), device=logits.device))
    if b.bad_sequences is not None:
        logits = apply_bad_word_sequences(logits, b.bad_sequences)
    if b.allowed is not None:
        logits = apply_allowed(logits, *b.allowed)
    for processor, rows, state in b.processors:
        logits = logits.index_copy(0, rows, processor.apply(logits[rows], state))
    best, greedy_ids = logits.max(-1)
    if b.all_greedy:
        token_ids = greedy_ids
    else:
        temperature = torch.where(b.temperature > 0, b.temperature, 1.0)
        scaled = filter_logits(logits / temperature[:, None], b)
        probs = scaled.softmax(-1)
        vocab = torch.arange(logits.shape[1], device=logits.device)
        u = seeded_uniform(b.seeds, b.positions, vocab)
        drawn = (probs / -torch.log(u)).argmax(-1)
        token_ids = torch.where(b.temperature > 0, drawn, greedy_ids)

    drew_nothing = torch.where(best.isnan(), NAN_LOGITS, NO_TOKEN_ALLOWED)
    reported = torch.where(best > float("-inf"), token_ids, drew_nothing)
    logprobs = None if b.logprobs_top_n is None else token_logprobs(raw, token_ids, b.logprobs_top_n)
    return SampledTokens(token_ids, logprobs, reported)
