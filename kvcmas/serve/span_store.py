"""Saved KV of finished requests, per session, bounded in bytes, least recently used evicted.

Two halves, because vLLM runs the connector twice (scheduler side and worker side, possibly in
different processes): :class:`SpanIndex` holds what the scheduler needs to decide claims (the
token ids of each saved request, its session, its byte size, the LRU order and the byte bound);
:class:`SpanStore` holds the tensors on the worker and obeys the index's save / drop orders.
No vllm import here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SavedRequest:
    key: str
    session: str
    agent: str
    token_ids: np.ndarray  # int64, tokens 0..n-1 whose KV is saved (prompt, then output)
    num_bytes: int


@dataclass(frozen=True)
class PrefixMatch:
    key: str
    length: int  # tokens 0..length-1 of the prompt equal the saved request's


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class SpanIndex:
    """Scheduler-side index of saved requests; owns the byte bound and the LRU order."""

    def __init__(self, capacity_bytes: int, bytes_per_token: int):
        if capacity_bytes < 0 or bytes_per_token <= 0:
            raise ValueError("capacity_bytes must be >= 0 and bytes_per_token > 0")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[str, SavedRequest] = OrderedDict()  # oldest first
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(
        self, key: str, session: str, agent: str, token_ids: Sequence[int]
    ) -> tuple[bool, list[str]]:
        """Admit a saved request; returns (admitted, keys evicted to make room).

        A request larger than the whole bound is not admitted (nothing is evicted for it).
        """
        if key in self._entries:
            raise ValueError(f"span store already holds {key!r}")
        num_bytes = len(token_ids) * self.bytes_per_token
        if num_bytes > self.capacity_bytes or not len(token_ids):
            return False, []
        evicted = []
        while self.bytes_used + num_bytes > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.bytes_used -= old.num_bytes
            evicted.append(old_key)
        tokens = np.asarray(token_ids, dtype=np.int64)
        self._entries[key] = SavedRequest(key, session, agent, tokens, num_bytes)
        self.bytes_used += num_bytes
        return True, evicted

    def longest_prefix(self, session: str, prompt_ids: Sequence[int]) -> PrefixMatch | None:
        """The saved request of ``session`` sharing the longest prefix with the prompt.

        A shared prefix is what makes saved KV exact: the KV of token p depends on tokens 0..p.
        Marks the match as recently used. Linear in the session's saved tokens (fine for a
        spike; a token trie or block hashes would make it sublinear).
        """
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        best: PrefixMatch | None = None
        for entry in reversed(self._entries.values()):  # newest first wins ties
            if entry.session != session:
                continue
            length = common_prefix_length(entry.token_ids, prompt)
            if length and (best is None or length > best.length):
                best = PrefixMatch(entry.key, length)
        if best is not None:
            self._entries.move_to_end(best.key)
        return best


class SpanStore:
    """Worker-side tensors: per saved request, per layer, K and V stacked [2, heads, n, D]."""

    def __init__(self) -> None:
        self._kv: dict[str, dict[str, torch.Tensor]] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._kv)

    def put(self, key: str, layers: dict[str, torch.Tensor]) -> None:
        self.drop(key)
        self._kv[key] = layers
        self.num_bytes += sum(t.numel() * t.element_size() for t in layers.values())

    def get(self, key: str) -> dict[str, torch.Tensor]:
        if key not in self._kv:
            raise KeyError(f"span store holds no saved request {key!r}")
        return self._kv[key]

    def drop(self, key: str) -> None:
        layers = self._kv.pop(key, None)
        if layers is not None:
            self.num_bytes -= sum(t.numel() * t.element_size() for t in layers.values())
