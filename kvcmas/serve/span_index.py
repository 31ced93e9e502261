"""The scheduler's index of saved requests: what a claim is decided from.

vLLM runs the connector twice (scheduler side and worker side, possibly in different
processes). :class:`SpanIndex` holds what the scheduler needs to decide claims (the token ids
of each saved request, its session and namespace, which of its positions are prompt and which
exact, its byte size, the LRU order, the byte bound, and a per-session index of its token
windows for span matching); the worker's :class:`kvcmas.serve.span_store.SpanStore` holds the
tensors and obeys the index's save / drop orders. No torch or vllm import here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Token windows the span index hashes: the shortest span it can find.
GRAM = 16


@dataclass(frozen=True)
class SavedRequest:
    key: str
    session: str
    agent: str
    token_ids: np.ndarray  # int64, tokens 0..n-1 whose KV is saved (prompt, then output)
    num_bytes: int
    namespace: str | None  # tenant; None is the default namespace
    prompt_len: int  # tokens 0..prompt_len-1 were the prompt, the rest its output
    exact_upto: int  # KV of positions < exact_upto equals a dense prefill's; later may not
    seq: int  # admission counter: lower is saved earlier, whatever the LRU order says


@dataclass(frozen=True)
class PrefixMatch:
    key: str
    length: int  # tokens 0..length-1 of the prompt equal the saved request's


@dataclass(frozen=True)
class Occurrence:
    key: str
    offset: int  # first position of the matched run in that saved request
    agent: str
    # The run holds output tokens of that request: an agent's reply, usually read with the
    # token or two that precede it in both prompts (a newline), which are the producer's prompt.
    in_output: bool


@dataclass(frozen=True)
class SpanMatch:
    start: int  # position of the run in the prompt
    length: int
    origin: Occurrence  # earliest-admitted saved request holding the whole run
    latest: Occurrence  # most recently admitted saved request holding the whole run


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def run_length(a: np.ndarray, i: int, b: np.ndarray, j: int, limit: int) -> int:
    """Length (<= limit) of the common run of a[i:] and b[j:].

    Compares in doubling chunks: most candidates differ early, so comparing whole remainders
    would make every probe cost the length of the prompt.
    """
    n, step = 0, 64
    while n < limit:
        m = min(step, limit - n)
        differ = np.flatnonzero(a[i + n : i + n + m] != b[j + n : j + n + m])
        if differ.size:
            return n + int(differ[0])
        n, step = n + m, step * 2
    return n


def gram_hashes(tokens: np.ndarray, gram: int) -> list[int]:
    """Hash of every window tokens[i:i+gram], i = 0..len-gram (none if shorter than gram).

    Collisions are allowed: every candidate is verified against the tokens.
    """
    raw = tokens.tobytes()
    width = gram * tokens.itemsize
    return [hash(raw[s : s + width]) for s in range(0, len(raw) - width + 1, tokens.itemsize)]


class SpanIndex:
    """Scheduler-side index of saved requests; owns the byte bound and the LRU order.

    Besides the LRU, keeps per session a hash index from each ``gram``-token window of its
    saved requests to where it starts, so that :meth:`find_spans` probes a prompt position in
    O(1) instead of scanning every saved token.
    """

    def __init__(self, capacity_bytes: int, bytes_per_token: int, gram: int = GRAM):
        if capacity_bytes < 0 or bytes_per_token <= 0:
            raise ValueError("capacity_bytes must be >= 0 and bytes_per_token > 0")
        if gram < 1:
            raise ValueError(f"gram must be >= 1, got {gram}")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.gram = gram
        self._entries: OrderedDict[str, SavedRequest] = OrderedDict()  # oldest first
        self.bytes_used = 0
        self._seq = 0
        # session -> window hash -> (key, offset), grouped by key, offsets ascending per key
        self._grams: dict[str, dict[int, list[tuple[str, int]]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(
        self,
        key: str,
        session: str,
        agent: str,
        token_ids: Sequence[int],
        *,
        namespace: str | None = None,
        prompt_len: int | None = None,
        exact_upto: int | None = None,
    ) -> tuple[bool, list[str]]:
        """Admit a saved request; returns (admitted, keys evicted to make room).

        ``prompt_len`` and ``exact_upto`` default to the whole request (all prompt, all exact).
        A request larger than the whole bound is not admitted (nothing is evicted for it).
        """
        if key in self._entries:
            raise ValueError(f"span store already holds {key!r}")
        n = len(token_ids)
        prompt_len = n if prompt_len is None else prompt_len
        exact_upto = n if exact_upto is None else exact_upto
        if not 0 <= prompt_len <= n:
            raise ValueError(f"prompt_len must be in [0, {n}], got {prompt_len}")
        if not 0 <= exact_upto <= n:
            raise ValueError(f"exact_upto must be in [0, {n}], got {exact_upto}")
        num_bytes = n * self.bytes_per_token
        if num_bytes > self.capacity_bytes or not n:
            return False, []
        evicted = []
        while self.bytes_used + num_bytes > self.capacity_bytes:
            evicted.append(self._evict_oldest())
        tokens = np.asarray(token_ids, dtype=np.int64)
        self._seq += 1
        self._entries[key] = SavedRequest(
            key, session, agent, tokens, num_bytes, namespace, prompt_len, exact_upto, self._seq
        )
        self.bytes_used += num_bytes
        hashes = gram_hashes(tokens, self.gram)  # none for a request shorter than gram
        if hashes:
            grams = self._grams.setdefault(session, {})
            for offset, h in enumerate(hashes):
                grams.setdefault(h, []).append((key, offset))
        return True, evicted

    def _evict_oldest(self) -> str:
        key, old = self._entries.popitem(last=False)
        self.bytes_used -= old.num_bytes
        grams = self._grams.get(old.session, {})
        for h in set(gram_hashes(old.token_ids, self.gram)):
            kept = [c for c in grams.get(h, ()) if c[0] != key]
            if kept:
                grams[h] = kept
            else:
                grams.pop(h, None)
        if not grams:
            self._grams.pop(old.session, None)
        return key

    def longest_prefix(
        self, session: str, prompt_ids: Sequence[int], exact_only: bool = False
    ) -> PrefixMatch | None:
        """The saved request of ``session`` sharing the longest prefix with the prompt.

        A shared prefix is what makes saved KV exact (the KV of token p depends on tokens
        0..p) where the saved request's own KV was: ``exact_only`` caps the length at its
        ``exact_upto``. Marks the match as recently used.
        """
        return self._longest(prompt_ids, lambda e: e.session == session, exact_only)

    def longest_exact_prefix(
        self, namespace: str | None, prompt_ids: Sequence[int]
    ) -> PrefixMatch | None:
        """The longest exact prefix any session of ``namespace`` saved (capped at each
        request's ``exact_upto``).

        Exact KV of the same tokens at the same positions is the same whoever computed it,
        so sharing it across a tenant's sessions is what vLLM's prefix cache does: a new
        session reads its agents' system prompts instead of prefilling them again. KV a
        method approximated (past ``exact_upto``) never crosses sessions, nor anything
        crosses namespaces.
        """
        return self._longest(prompt_ids, lambda e: e.namespace == namespace, True)

    def _longest(self, prompt_ids, eligible, exact_only: bool) -> PrefixMatch | None:
        """Linear in the eligible saved tokens (a token trie or block hashes would make it
        sublinear; a prompt against a few hundred saved requests takes about a ms)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        best: PrefixMatch | None = None
        for entry in reversed(self._entries.values()):  # newest first wins ties
            if not eligible(entry):
                continue
            length = common_prefix_length(entry.token_ids, prompt)
            if exact_only:
                length = min(length, entry.exact_upto)
            if length and (best is None or length > best.length):
                best = PrefixMatch(entry.key, length)
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def find_spans(
        self,
        session: str,
        prompt_ids: Sequence[int],
        begin: int = 0,
        end: int | None = None,
        min_span: int | None = None,
    ) -> list[SpanMatch]:
        """Runs of ``prompt_ids[begin:end]`` of >= ``min_span`` tokens found in the session's
        saved requests (prompt, output or across), left to right, non-overlapping.

        Greedy: at each position the longest run any saved request offers; none long enough,
        advance one token; after a match, continue right after it. ``min_span`` defaults to
        ``gram`` and may not be smaller (the index only sees runs of ``gram`` tokens). Marks
        each request used as origin or latest as recently used.

        Cost: one probe per saved occurrence of each probed window, so typical prompts take a
        few ms, but text whose windows repeat hundreds of times per request is much slower.
        """
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        end = len(prompt) if end is None else end
        min_span = self.gram if min_span is None else min_span
        if min_span < self.gram:
            raise ValueError(f"min_span must be >= gram ({self.gram}), got {min_span}")
        if not 0 <= begin <= end <= len(prompt):
            raise ValueError(f"need 0 <= begin <= end <= {len(prompt)}, got {begin}, {end}")
        grams = self._grams.get(session)
        if not grams or end - begin < min_span:
            return []
        hashes = gram_hashes(prompt[begin:end], self.gram)
        matches: list[SpanMatch] = []
        p = begin
        while p + min_span <= end:
            found = self._longest_run(prompt, p, end, grams.get(hashes[p - begin], ()))
            if found is None or found[0] < min_span:
                p += 1
                continue
            length, holders = found
            holders.sort(key=lambda holder: self._entries[holder[0]].seq)
            origin = self._occurrence(*holders[0], length)
            latest = self._occurrence(*holders[-1], length)
            matches.append(SpanMatch(p, length, origin, latest))
            p += length
        return matches

    def _longest_run(
        self, prompt: np.ndarray, p: int, end: int, candidates: Sequence[tuple[str, int]]
    ) -> tuple[int, list[tuple[str, int]]] | None:
        """Longest verified run at prompt position p; with, per saved request holding a run of
        that length, its first offset. None without any verified candidate."""
        best: dict[str, tuple[int, int]] = {}  # key -> (longest run, first offset with it)
        for key, offset in candidates:
            tokens = self._entries[key].token_ids
            bound = min(end - p, len(tokens) - offset)
            held = best.get(key)
            # Offsets ascend per key, so bounds only shrink: a later offset cannot beat this
            # key's longest run nor be the first to reach it.
            if held is not None and bound <= held[0]:
                continue
            length = run_length(prompt, p, tokens, offset, bound)
            # A run shorter than gram means the window only collided in hash: no match.
            if length >= self.gram and (held is None or length > held[0]):
                best[key] = (length, offset)
        if not best:
            return None
        longest = max(length for length, _ in best.values())
        return longest, [(k, off) for k, (length, off) in best.items() if length == longest]

    def _occurrence(self, key: str, offset: int, length: int) -> Occurrence:
        self._entries.move_to_end(key)
        entry = self._entries[key]
        return Occurrence(key, offset, entry.agent, offset + length > entry.prompt_len)
