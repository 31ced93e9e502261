"""The worker's saved KV of finished requests, one tensor per saved request.

It obeys the save and drop orders of the scheduler's :class:`kvcmas.serve.span_index.SpanIndex`
(which owns the byte bound and the LRU order) and reads spans as views for the builds.
No vllm import here.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


def _storage_users(t: torch.Tensor) -> int | None:
    """Tensors sharing ``t``'s memory, ``t`` included (None where torch cannot tell)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return count(t.untyped_storage()._cdata) - 1  # less the storage object made to ask


class PendingFill(Protocol):
    def wait(self) -> BaseException | None: ...  # block until filled; the error, if any


class SpanStore:
    """Worker-side tensors: per saved request one tensor ``[layers, 2, heads, n, D]`` (K and
    V of every layer in model order), so that a span of it is read as views, not copied.

    A dropped request's memory is kept as a spare for the next save (:meth:`new`), within
    ``max_bytes`` together with the saved ones: writing into fresh memory of that size costs
    its page faults each time (a 1100-token save of SmolLM2 in bf16, 25 MB: 55 ms fresh
    against 11 ms into mapped memory, measured on the 2-core AMX host), and under load the
    store is full, so every save follows a drop. Memory still read elsewhere (a view kept
    past a build) is never reused: it is released as before."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self._kv: dict[str, torch.Tensor] = {}
        self._filling: dict[str, PendingFill] = {}  # entries a copy still writes
        self.num_bytes = 0
        self.max_bytes = max_bytes  # None: keep no spares
        self._spares: list[torch.Tensor] = []  # flat buffers of dropped requests
        self.reused_saves = 0

    @property
    def spare_bytes(self) -> int:
        return sum(b.nbytes for b in self._spares)

    def new(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialized tensor to save a request into: the smallest spare that holds it,
        else new memory."""
        numel = math.prod(shape)
        fits = [i for i, b in enumerate(self._spares)
                if b.numel() >= numel and b.dtype == dtype and b.device == torch.device(device)]
        if not fits:
            return torch.empty(shape, dtype=dtype, device=device)
        spare = self._spares.pop(min(fits, key=lambda i: self._spares[i].numel()))
        self.reused_saves += 1
        return spare[:numel].view(shape)

    def __len__(self) -> int:
        return len(self._kv)

    def __contains__(self, key: str) -> bool:
        return key in self._kv

    def put(self, key: str, kv: torch.Tensor, filling: PendingFill | None = None) -> None:
        """Hold ``kv`` as ``key``; ``filling``: a copy still writing it, which every read and
        the drop of ``key`` wait for (:mod:`kvcmas.serve.save_copier`)."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"saved KV must be [layers, 2, heads, n, D], got {tuple(kv.shape)}")
        self.drop(key)
        self._kv[key] = kv
        if filling is not None:
            self._filling[key] = filling
        self.num_bytes += kv.nbytes
        self._trim()

    def get(self, key: str) -> torch.Tensor:
        filling = self._filling.pop(key, None)
        if filling is not None and (error := filling.wait()) is not None:
            self.drop(key)
            raise KeyError(f"saving request {key!r} failed: {error!r}") from error
        if key not in self._kv:
            raise KeyError(f"span store holds no saved request {key!r}")
        return self._kv[key]

    def read(self, key: str, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, heads, length, D]`` of positions [offset, offset + length) of a
        saved request: views into the store, which its readers never write into."""
        kv = self.get(key)
        if offset < 0 or length < 0 or offset + length > kv.shape[3]:
            raise ValueError(
                f"positions [{offset}, {offset + length}) are outside saved request {key!r} "
                f"of {kv.shape[3]} tokens"
            )
        window = kv[:, :, :, offset : offset + length]
        return window[:, 0], window[:, 1]

    def drop(self, key: str) -> None:
        filling = self._filling.pop(key, None)
        if filling is not None:
            filling.wait()  # never hand out memory a copy still writes into
        kv = self._kv.pop(key, None)
        if kv is None:
            return
        self.num_bytes -= kv.nbytes
        flat = kv if kv._base is None else kv._base
        # Only this entry (and the flat buffer it was cut from) may hold the memory.
        if self.max_bytes is not None and _storage_users(kv) == (1 if flat is kv else 2):
            self._spares.append(flat.view(-1))
        self._trim()

    def _trim(self) -> None:
        """Release spares, the smallest first, until entries and spares fit ``max_bytes``."""
        self._spares.sort(key=torch.Tensor.numel)
        while self._spares and self.num_bytes + self.spare_bytes > (self.max_bytes or 0):
            self._spares.pop(0)
