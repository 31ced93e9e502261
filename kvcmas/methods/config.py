"""Method options as frozen, validated dataclasses, built alike from the CLI, YAML or Python.

Each method declares ``Config``, a subclass of :class:`MethodConfig`. Its fields are the
method's knobs; ``field(metadata={"help": ...})`` documents a knob once, for ``--help`` and the
README alike. :meth:`MethodConfig.from_options` turns a mapping of plain values (strings from
the command line, numbers from YAML) into a checked config, naming any bad field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from kvcmas.errors import ConfigError


def option(default: Any, help: str, flag: str | None = None) -> Any:
    """A config field with its help text (and a CLI flag, when not ``--<name>``)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Options of one method. Subclasses add fields and override :meth:`check`."""

    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the field when a value is out of range."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], strict: bool = True) -> MethodConfig:
        """A config from plain values; ``strict`` refuses options this method does not take."""
        names = cls.option_names()
        unknown = sorted(set(options) - set(names))
        if unknown and strict:
            takes = ", ".join(names) or "no options"
            raise ConfigError(
                f"method {cls.method!r} has no option {', '.join(map(repr, unknown))} "
                f"(it takes: {takes})"
            )
        hints = typing.get_type_hints(cls)
        values = {k: _coerce(cls.method, k, v, hints[k]) for k, v in options.items() if k in names}
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


def _coerce(method: str, name: str, value: Any, hint: Any) -> Any:
    """``value`` as the field's type; strings are parsed (the command line gives strings)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    base = args[0] if optional and len(args) == 1 else hint
    if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
        if optional:
            return None
        raise ConfigError(f"method {method!r}: option {name!r} needs a value")
    try:
        if base is bool:
            return _as_bool(value)
        if base in (int, float):
            if isinstance(value, bool):
                raise ValueError("a boolean is not a number")
            number = base(value)
            if base is int and isinstance(value, float) and number != value:
                raise ValueError("not an integer")
            return number
        if base is str:
            if not isinstance(value, str):
                raise ValueError("not a string")
            return value
        if typing.get_origin(base) is tuple:
            parts = value.split(":") if isinstance(value, str) else list(value)
            return tuple(int(p) for p in parts)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"method {method!r}: option {name!r} got {value!r} ({e})") from None
    return value


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def require(condition: bool, method: str, message: str) -> None:
    """Raise :class:`ConfigError` for ``method`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"method {method!r}: {message}")
