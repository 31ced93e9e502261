"""NonShared: every hop prefills its whole prompt beyond its cached system prefix."""

from __future__ import annotations

from kvcmas.methods.base import Method, SegmentRecord, dense_shared


class NonShared(Method):
    """The exact reference every other method is measured against."""

    name = "nonshared"
    reads_sources = False

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        return dense_shared(seg, shared, model, cache)
