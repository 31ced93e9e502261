"""Record the hops of a workflow run so that methods can be replayed on them one hop at a time.

A :class:`Recorder` runs like NonShared (every shared segment prefilled densely) or like
FullShared (``reuse=True``) inside the ordinary :class:`~kvcmas.workflow.runner.Runner`, and
keeps, per hop: the hop's segments with a frozen copy of its shared segments' sources, the
agent's system-prefix cache, the prompt cache it built and its last-token logits, and the
hidden states of the hop that produced each source (``capture`` layers; agent outputs are
captured while their producer decodes them). Profiles and the coverage analysis build on it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvcmas.methods.base import Hop, HopBuild, Method, SegmentRecord, reuse_shared
from kvcmas.methods.selective import segment_rows
from kvcmas.model.cache import KVCache


@dataclass
class RecordedHop:
    hop: Hop  # segments and a frozen copy of the shared segments (their sources at hop time)
    prefix: KVCache  # the agent's system-prefix cache
    cache: KVCache  # the prompt cache the recorder built (dense, or FullShared's)
    last_logits: torch.Tensor
    records: list[SegmentRecord]
    source_hidden: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def has_sources(self) -> bool:
        return any(s.latest is not None for s in self.hop.shared.values())

    def replay(self, method: Method, model) -> HopBuild:
        """Build this hop again with ``method`` on a copy of the prefix cache."""
        cache = self.prefix.clone()
        cache.reserve(len(self.hop.tokens) + 1)
        return method.build(self.hop, model, cache)

    def dense(self, model) -> tuple[KVCache, torch.Tensor]:
        """The dense prompt cache and last-token logits of this hop's token sequence."""
        cache = self.prefix.clone()
        logits = model.prefill(self.hop.tokens[cache.length :], cache)
        return cache, logits


class Recorder(Method):
    """Builds hops densely (or reusing sources, ``reuse=True``) and records them."""

    name = "recorder"

    def __init__(self, reuse: bool = False, capture: tuple[int, ...] = ()):
        super().__init__()
        self.reuse = reuse
        self.capture = tuple(sorted(set(capture)))
        self.hops: list[RecordedHop] = []
        # (session, segment tokens, computing agent) -> layer -> hidden input of that layer
        self._hidden: dict[tuple[str, tuple[int, ...], str], dict[int, torch.Tensor]] = {}

    def build(self, hop, model, cache):
        frozen = {k: copy.copy(v) for k, v in hop.shared.items()}
        sources = {
            slot: self._hidden[key]
            for slot, s in frozen.items()
            if s.latest is not None
            and (key := (hop.session, s.tokens, s.latest_agent)) in self._hidden
        }
        prefix = cache.clone()
        out = super().build(hop, model, cache)
        record = Hop(hop.agent, hop.session, hop.step, hop.segments, frozen)
        self.hops.append(
            RecordedHop(record, prefix, out.cache.clone(), out.last_logits, out.records, sources)
        )
        return out

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        if self.reuse and shared.latest is not None:
            return reuse_shared(seg, shared, shared.latest, model, cache)
        start, n = cache.length, len(seg)
        out = model.forward(
            torch.tensor(seg.tokens, device=cache.device),
            segment_rows(start, n, cache.device),
            cache,
            logits_rows=None,
            capture=self.capture,
        )
        if self.capture:
            self._hidden[(hop.session, seg.tokens, hop.agent)] = out.captured
        return SegmentRecord(seg.slot, shared.kind, start, n, "dense", n * model.config.n_layers)

    def decode_capture_layers(self) -> tuple[int, ...]:
        return self.capture

    def after_decode(self, hop, tokens, captured: dict[int, torch.Tensor]) -> None:
        self._hidden[(hop.session, tuple(tokens), hop.agent)] = captured


def record_hops(
    loaded,
    workflow,
    requests: Iterable[dict],
    reuse: bool = False,
    capture: tuple[int, ...] = (),
    progress: Callable[[str], None] | None = None,
) -> list[RecordedHop]:
    """Run ``requests`` through ``workflow`` with a :class:`Recorder`; every hop recorded."""
    from kvcmas.workflow.runner import Runner

    recorder = Recorder(reuse=reuse, capture=capture)
    runner = Runner(loaded, workflow, recorder)
    for i, request in enumerate(requests):
        runner.run(request)
        if progress:
            progress(f"recorded request {i + 1}: {len(recorder.hops)} hops so far")
    return recorder.hops
