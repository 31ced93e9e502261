"""FullShared: reuse the source cache of every shared segment, re-rotated, uncorrected."""

from __future__ import annotations

from kvcmas.methods.base import Method, SegmentRecord, dense_shared, reuse_shared


class FullShared(Method):
    """Reuses the latest earlier hop's cache of each shared segment; the first consumer of a
    segment has no source and prefills it densely (METHOD.md section 2, rule 4)."""

    name = "fullshared"

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        if shared.latest is None:
            return dense_shared(seg, shared, model, cache)
        return reuse_shared(seg, shared, shared.latest, model, cache, source=shared.latest_agent)
