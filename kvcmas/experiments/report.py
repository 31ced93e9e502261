"""``kvcmas bench report DIR``: one ``REPORT.md`` from every experiment's results under DIR.

Each experiment writes ``results.json``, ``table.md`` and PNG plots into its own folder. The
report lists, per folder, the setup facts found in ``results.json`` (model, dtype, sizes,
machine), the folder's ``table.md`` with its headings moved under the folder's section, and
the plots as linked images.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from kvcmas.experiments.machine import machine_description

HELP = "gather every experiment's results under DIR into DIR/REPORT.md"
REPORT_NAME = "REPORT.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="folder holding experiment subfolders (results.json, table.md)")


def find_results(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) holding a ``results.json``, in path order."""
    return sorted(p.parent for p in root.rglob("results.json"))


NOT_SIZES = {"experiment", "model", "dtype", "machine", "torch_threads", "python", "torch"}


def _sizes(setup: dict[str, Any]) -> str:
    """``setup["sizes"]`` where an experiment gives one, else its other scalar or list keys."""
    sizes = setup.get("sizes")
    if sizes is None:
        sizes = {
            k: v
            for k, v in setup.items()
            if k not in NOT_SIZES and isinstance(v, (str, int, float, list, tuple))
        }
    if isinstance(sizes, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in sizes.items()) or "-"
    return _text(sizes)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_text(x) for x in value)
    return str(value)


def setup_facts(results: dict[str, Any], name: str = "-") -> dict[str, str]:
    """Model, dtype, sizes and machine of one experiment (``-`` where it does not say);
    ``name`` (the folder's) stands in for an experiment that does not name itself."""
    setup = results.get("setup", {}) if isinstance(results, dict) else {}
    return {
        "experiment": str(setup.get("experiment", results.get("experiment", name))),
        "model": str(setup.get("model", "-")),
        "dtype": str(setup.get("dtype", "-")),
        "sizes": _sizes(setup),
        "machine": str(setup.get("machine", "-")),
    }


def demote_headings(markdown: str, levels: int = 2) -> str:
    """Move every ``#`` heading down ``levels`` levels (capped at ``######``)."""

    def shift(m: re.Match[str]) -> str:
        return "#" * min(6, len(m.group(1)) + levels) + m.group(2)

    return re.sub(r"^(#{1,6})(\s)", shift, markdown, flags=re.MULTILINE)


def _load(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "results.json").read_text())
    except (OSError, ValueError) as e:
        return {"setup": {"experiment": f"unreadable results.json ({e})"}}


def _label(root: Path, folder: Path) -> str:
    """A results folder's name in the report: its path under ``root`` (``root``'s own name)."""
    return folder.relative_to(root).as_posix() if folder != root else root.resolve().name


def _section(root: Path, folder: Path, facts: dict[str, str]) -> list[str]:
    rel = _label(root, folder)
    lines = [f"## {rel}", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()]
    lines.append("")
    table = folder / "table.md"
    if table.is_file():
        lines += [demote_headings(table.read_text()).rstrip(), ""]
    else:
        lines += ["(no table.md)", ""]
    for png in sorted(folder.glob("*.png")):
        link = png.relative_to(root).as_posix()
        lines += [f"![{rel}: {png.stem}]({link})", ""]
    return lines


def build_report(root: Path) -> str:
    """The markdown of ``REPORT.md`` for every results folder under ``root``."""
    folders = find_results(root)
    facts = {f: setup_facts(_load(f), f.name) for f in folders}
    lines = [
        "# KVCMAS evaluation report",
        "",
        f"{len(folders)} experiment result folder(s) under `{root}`; "
        f"gathered on {machine_description()}.",
        "",
        "| folder | experiment | model | dtype | sizes | machine |",
        "|---|---|---|---|---|---|",
    ]
    for f in folders:
        rel = _label(root, f)
        x = facts[f]
        lines.append(
            f"| [{rel}](#{_anchor(rel)}) | {x['experiment']} | {x['model']} | {x['dtype']} "
            f"| {x['sizes']} | {x['machine']} |"
        )
    lines.append("")
    for f in folders:
        lines += _section(root, f, facts[f])
    return "\n".join(lines).rstrip() + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def write_report(root: Path) -> Path:
    path = root / REPORT_NAME
    path.write_text(build_report(root))
    return path


def run(args: argparse.Namespace) -> int:
    from kvcmas.errors import UsageError

    root = Path(args.dir)
    if not root.is_dir():
        raise UsageError(f"no such folder: {root}")
    if not find_results(root):
        raise UsageError(f"no results.json under {root}: run an experiment with --out there")
    path = write_report(root)
    print(f"wrote {path} ({len(find_results(root))} result folder(s))")
    return 0
