"""Reuse methods by command-line name, each built from its frozen config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcmas.errors import ConfigError
from kvcmas.methods.base import Method
from kvcmas.methods.cacheblend import CacheBlend
from kvcmas.methods.config import MethodConfig
from kvcmas.methods.droidspeak import DroidSpeak
from kvcmas.methods.fullshared import FullShared
from kvcmas.methods.graphflow import GraphFlow
from kvcmas.methods.headrecompute import HeadRecompute
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
        HeadRecompute,
    )
}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]


def method_config(
    name: str, options: Mapping[str, Any] | None = None, strict: bool = True
) -> MethodConfig:
    """``name``'s config from plain option values; ``strict=False`` ignores the options it
    does not take (one command line's knobs given to several methods)."""
    return method_class(name).Config.from_options(options or {}, strict)


def make_method(
    name: str, options: Mapping[str, Any] | None = None, strict: bool = True, **kw: Any
) -> Method:
    """``make_method("kvcmas", tau=0.9)`` or ``make_method(name, {"tau": "0.9"})``."""
    return method_class(name)(method_config(name, {**(options or {}), **kw}, strict))


def check_options_used(names: list[str], options: Mapping[str, Any]) -> None:
    """Every given option must be taken by at least one of the methods ``names``."""
    taken = {o for n in names for o in method_class(n).Config.option_names()}
    unused = sorted(set(options) - taken)
    if unused:
        raise ConfigError(
            f"option(s) {', '.join(unused)} are taken by none of the methods {', '.join(names)}"
        )
