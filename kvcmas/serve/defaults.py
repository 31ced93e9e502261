"""The options a served method runs with when the operator gives none, or only some.

Serving's default KVCMAS is the long-document operating point
(:data:`kvcmas.methods.kvcmas.LONG_CONTEXT`: reuse whenever the pool has anchors, repair a
128-token head plus up to 2% of the span), not the class defaults chosen on the short
roster: at the class defaults the gate sends a new document to dense prefill, which the
connector would then run outside vLLM's batch, slower than leaving it to vLLM. Which spans are
worth building at all is decided per claim from measured costs (:mod:`kvcmas.serve.costs`), so
short spans (all head) are left to vLLM. Options given explicitly override these field by
field.
"""

from __future__ import annotations

from typing import Any


def serving_defaults(method: str) -> dict[str, Any]:
    if method == "kvcmas":
        from kvcmas.methods.kvcmas import LONG_CONTEXT

        return dict(LONG_CONTEXT)
    return {}


def serving_options(method: str, given: dict[str, Any] | None) -> dict[str, Any]:
    """The options ``method`` is served with: its serving defaults, then ``given``."""
    return {**serving_defaults(method), **(given or {})}
