"""Command-line arguments shared by ``kvcmas run`` and the experiments: model and method knobs.

Method flags are generated from the methods' config dataclasses, so a knob is declared once.
Their values are collected into ``args.method_options`` (a dict of the flags the user set), and
each method takes the options its config has.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from kvcmas.methods import METHODS
from kvcmas.model.loader import DEFAULT_MODEL, DEVICES, DTYPES


def add_model_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    """``--model`` and ``--dtype``, and ``--device`` for commands that run kvcmas's runtime
    (``device=False`` where another engine places the model)."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'smollm2-135m' (embedded default), 'qwen2.5-coder-0.5b', a HF folder or a .gguf",
    )
    p.add_argument("--dtype", default="fp32", help=f"one of {', '.join(DTYPES)}")
    if device:
        p.add_argument(
            "--device", default="cpu", help=f"where the runtime runs: {', '.join(DEVICES)}[:N]"
        )


def add_floor_gemm_arg(p: argparse.ArgumentParser) -> None:
    """``--floor-gemm``: how the bf16 noise floor multiplies (its numbers stay bf16's)."""
    p.add_argument(
        "--floor-gemm", choices=("bf16", "fp32"), default="bf16",
        help="the noise floor's matrix products: native bf16, or fp32 over its bf16 weights and "
        "inputs with outputs rounded to bf16 (the same numbers up to summation order; about 6x "
        "faster on CPUs without bf16 instructions, e.g. AVX2-only)",
    )  # fmt: skip


SPLITS = ("test", "validation")  # disjoint: a knob chosen on one is reported on the other


def add_split_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--split``: where ``what`` comes from; calibrate on 'validation', report on 'test'."""
    p.add_argument(
        "--split", choices=SPLITS, default="test",
        help=f"the split {what} come from: choose knobs on 'validation' (calibration), "
        "report on 'test'",
    )  # fmt: skip


class _MethodOption(argparse.Action):
    """Stores ``--flag VALUE`` as ``namespace.method_options[field] = VALUE``."""

    def __call__(self, parser, namespace, values, option_string=None):
        options = dict(getattr(namespace, "method_options", None) or {})
        options[self.dest] = self.const if values is None or self.nargs == 0 else values
        namespace.method_options = options


def add_method_args(p: argparse.ArgumentParser) -> None:
    """One flag per method option (``--tau``, ``--ratio``, ``--no-chain``, ...), and
    ``--method-config FILE``: a YAML/JSON mapping of the same options (flags win)."""
    g = p.add_argument_group("method options (each method takes its own; see README)")
    p.set_defaults(method_options=None)
    g.add_argument("--method-config", help="YAML/JSON file of method options")
    seen: dict[str, list[str]] = {}
    fields: dict[str, dataclasses.Field] = {}
    for name, cls in METHODS.items():
        for f in dataclasses.fields(cls.Config):
            seen.setdefault(f.name, []).append(name)
            fields.setdefault(f.name, f)
    for option, f in fields.items():
        flag = f.metadata.get("flag") or "--" + option.replace("_", "-")
        owners = ", ".join(seen[option])
        help_text = f"{f.metadata.get('help', '')} [{owners}]"
        if typing.get_type_hints(_owner(option)).get(option) is bool:
            g.add_argument(
                flag, dest=option, action=_MethodOption, nargs="?", const="true",
                metavar="BOOL", help=help_text,
            )
            if f.default is True:
                g.add_argument(
                    "--no-" + option.replace("_", "-"), dest=option, action=_MethodOption,
                    nargs=0, const="false", help=f"set {option} to false",
                )
        else:
            g.add_argument(flag, dest=option, action=_MethodOption, help=help_text)


def _owner(option: str) -> type:
    for cls in METHODS.values():
        if option in cls.Config.option_names():
            return cls.Config
    raise KeyError(option)


def method_options(args: argparse.Namespace) -> dict[str, object]:
    """The method options the user set: ``--method-config`` file first, flags over it."""
    options: dict[str, object] = {}
    path = getattr(args, "method_config", None)
    if path:
        options.update(read_options_file(path))
    options.update(getattr(args, "method_options", None) or {})
    return options


def read_options_file(path: str) -> dict[str, object]:
    import yaml

    from kvcmas.errors import UsageError

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--method-config: file not found: {file}")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"--method-config {file}: not valid YAML/JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UsageError(f"--method-config {file}: expected a mapping of option names")
    return data


def add_saves_args(p: argparse.ArgumentParser) -> None:
    """Where the connector copies a finished request's KV into its span store (`kvcmas serve`
    and `kvcmas bench serve` alike)."""
    saves = p.add_mutually_exclusive_group()
    saves.add_argument("--sync-saves", action="store_true",
                       help="copy saves inside the engine step (the default on a CPU, whose "
                            "cores vLLM's forward uses)")
    saves.add_argument("--background-saves", action="store_true",
                       help="copy saves on a background thread while the engine runs on (the "
                            "default off the CPU)")
