"""Reuse methods by command-line name."""

from __future__ import annotations

from kvcmas.methods.base import Method
from kvcmas.methods.cacheblend import CacheBlend
from kvcmas.methods.droidspeak import DroidSpeak
from kvcmas.methods.fullshared import FullShared
from kvcmas.methods.graphflow import GraphFlow
from kvcmas.methods.kvcmas import KVCMAS, KVCOMM
from kvcmas.methods.nonshared import NonShared
from kvcmas.methods.relaycaching import RelayCaching

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        NonShared,
        FullShared,
        KVCMAS,
        KVCOMM,
        CacheBlend,
        DroidSpeak,
        RelayCaching,
        GraphFlow,
    )
}


def make_method(name: str, **params) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    import inspect

    accepted = inspect.signature(METHODS[name]).parameters
    unknown = [k for k in params if k not in accepted]
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ValueError(f"method {name!r} does not take {flags}")
    return METHODS[name](**params)
