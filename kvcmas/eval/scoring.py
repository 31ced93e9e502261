"""Strict scorers for MMLU (letter), GSM8K (final number) and HumanEval (unit tests).

Answer-line convention (what the agents are asked to produce)
-------------------------------------------------------------
The final answer goes on a line of its own::

    Answer: B          (MMLU / ARC: one capital letter)
    Answer: 42         (GSM8K: one number)

The marker is case-insensitive (``answer:``, ``ANSWER:``), may be preceded by ``Final`` and
may carry markdown emphasis or a heading mark: ``**Answer: B**``, ``**Answer:** (B)``,
``### Final Answer: B``. The LAST line that starts with the marker decides.

MMLU is strict: that last answer line must hold exactly one letter, optionally in parentheses
or brackets and optionally followed by ``.``, ``)`` or ``:``. ``Answer: B. Paris`` or
``Answer: I think B`` are malformed (None), and there is no fallback to a letter found
elsewhere in the text.

GSM8K takes the first number after the last marker (the rest of the text, so
``Answer:\\n42`` works); without any marker it falls back to the last number in the whole
text, which is the usual GSM8K convention. Numbers are normalised (``$``, thousands
commas, trailing ``.``/``.0`` removed) and compared numerically.

HumanEval completions run in a separate, resource-limited process (:mod:`kvcmas.eval.sandbox`);
see ``run_humaneval``.
"""

from __future__ import annotations

import math
import re
import textwrap
from decimal import Decimal, InvalidOperation
from typing import Any

from kvcmas.eval.sandbox import run_python

__all__ = [
    "extract_code",
    "extract_final_number",
    "extract_mmlu_letter",
    "normalize_number",
    "run_humaneval",
    "score_gsm8k",
    "score_mmlu",
]

# ----------------------------------------------------------------------------- answer lines

# Start of an answer line: optional heading/quote mark, optional emphasis, optional "Final",
# "answer", optional emphasis, a colon, optional emphasis. "answer" is matched whole, so
# "Answers:" or "Answer choices:" are not answer lines.
_MARKER = re.compile(
    r"^[ \t]*(?:[#>]+[ \t]*)?[*_]{0,2}[ \t]*(?:final[ \t]+)?answer[ \t]*[*_]{0,2}[ \t]*:"
    r"[ \t]*[*_]{0,2}",
    re.IGNORECASE | re.MULTILINE,
)

# What may follow the marker on an MMLU answer line: one capital letter, optionally in
# parentheses/brackets, optional closing emphasis and a final period. Case-sensitive on
# purpose: the agents are told to answer with a capital letter.
_LETTER_REST = re.compile(
    r"[ \t]*[(\[]?[ \t]*(?P<letter>[A-Z])[ \t]*[)\]]?[ \t]*[.:]?[ \t]*[*_]{0,2}[ \t]*\.?[ \t]*"
)


def _last_marker(text: str) -> re.Match[str] | None:
    last = None
    for match in _MARKER.finditer(text):
        last = match
    return last


def extract_mmlu_letter(text: str, letters: str = "ABCD") -> str | None:
    """The letter on the last ``Answer: X`` line, or None when absent or malformed.

    ``letters`` is the set of valid options ("ABCD" for MMLU; ARC rows can have up to five
    choices, pass "ABCDE" there). See the module docstring for the accepted forms.
    """
    if not text:
        return None
    match = _last_marker(text)
    if match is None:
        return None
    rest = text[match.end() :].split("\n", 1)[0].rstrip("\r")
    letter = _LETTER_REST.fullmatch(rest)
    if letter is None or letter["letter"] not in letters:
        return None
    return letter["letter"]


def score_mmlu(text: str, gold_letter: str) -> bool:
    """True iff ``extract_mmlu_letter(text)`` equals the gold letter."""
    gold = gold_letter.strip().upper()
    return extract_mmlu_letter(text, letters="ABCDE") == gold


# ----------------------------------------------------------------------------- numbers

# A number with an optional sign and "$" glued to it ("-5", "$5", "-$5"; "10 - 5" is not -5),
# thousands groups ("1,234") or plain digits, optional
# decimals. The lookbehind keeps digits glued to words ("H2O", "x2") out; the group form
# is tried first so that "1,234" is one number while "1,2" is two.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<num>(?:[-−]\$[ \t]?|\$[ \t]?[-−]?|[-−])?"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+))"
)


def normalize_number(raw: str) -> str | None:
    """Canonical string of a number: ``"$1,234.50"`` -> ``"1234.5"``, ``"18.00"`` -> ``"18"``.

    Returns None when ``raw`` is not a number after removing ``$``, commas, spaces and a
    trailing period.
    """
    s = raw.strip().replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    s = s.replace("\t", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    # format(..., "f") avoids the exponent notation that Decimal.normalize() can produce.
    return format(value.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The GSM8K prediction, normalised by ``normalize_number``.

    With an answer line (see the module docstring): the first number on the last answer
    line, or on the next non-empty line when the answer line holds nothing after the marker
    (``Answer:\\n42``); None if that line has no number (no fallback then). Without any
    answer line: the last number in the text. None when there is no number.
    """
    if not text:
        return None
    match = _last_marker(text)
    if match is None:
        numbers = list(_NUMBER.finditer(text))
        return normalize_number(numbers[-1]["num"]) if numbers else None
    lines = text[match.end() :].split("\n")
    answer = lines[0]
    if not answer.strip(" \t\r*_"):
        answer = next((line for line in lines[1:] if line.strip()), "")
    found = _NUMBER.search(answer)
    return normalize_number(found["num"]) if found else None


def score_gsm8k(text: str, gold: str | int | float) -> bool:
    """True iff the extracted number equals ``gold`` within 1e-6 (absolute)."""
    pred = extract_final_number(text)
    want = normalize_number(str(gold))
    if pred is None or want is None:
        return False
    return math.isclose(float(pred), float(want), rel_tol=0.0, abs_tol=1e-6)


# ----------------------------------------------------------------------------- code extraction

_FENCE = re.compile(r"^[ \t]*```[ \t]*(?P<lang>[\w+-]*)[^\n]*\n", re.MULTILINE)
_FENCE_END = re.compile(r"^[ \t]*```", re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each fenced block; an unclosed last fence runs to the end
    (generations are often cut off by the token budget)."""
    blocks = []
    pos = 0
    while True:
        start = _FENCE.search(text, pos)
        if start is None:
            return blocks
        end = _FENCE_END.search(text, start.end())
        body_end = end.start() if end else len(text)
        blocks.append((start["lang"].lower(), text[start.end() : body_end]))
        if end is None:
            return blocks
        pos = end.end()


def _defines(code: str, entry_point: str) -> bool:
    pattern = rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\("
    return re.search(pattern, code, re.MULTILINE) is not None


def extract_code(text: str, prompt: str, entry_point: str) -> str:
    """Program text for a HumanEval completion.

    Takes the first ```python (or ```py) fenced block, else the first fenced block of any
    kind, else the raw text. If that code does not define ``entry_point`` at top level it is
    taken as a function-body continuation and the prompt is prepended. If it does, the part
    of the prompt *before* the ``def entry_point`` line (its imports and helper functions,
    which complete solutions often rely on without repeating them) is prepended instead.
    """
    blocks = _fenced_blocks(text)
    python = [body for lang, body in blocks if lang in _PYTHON_TAGS]
    if python:
        code = python[0]
    elif blocks:
        code = blocks[0][1]
    else:
        code = text
    # Drop leading blank lines but keep the indentation of a function-body completion.
    code = re.sub(r"\A(?:[ \t]*\n)+", "", code).rstrip() + "\n"
    if not _defines(code, entry_point):
        dedented = textwrap.dedent(code)
        if _defines(dedented, entry_point):
            code = dedented  # a complete function that was indented as a whole
        else:
            return prompt + code
    head = re.search(
        rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", prompt, re.MULTILINE
    )
    preamble = prompt[: head.start()] if head else ""
    return (preamble.rstrip() + "\n\n\n" + code) if preamble.strip() else code


# ----------------------------------------------------------------------------- execution


def run_humaneval(
    problem: dict[str, Any], completion_text: str, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Run a HumanEval completion against the problem's tests in the sandbox.

    The program is ``extract_code(...) + "\\n" + problem["test"] + "\\ncheck(entry_point)\\n"``,
    run by :func:`kvcmas.eval.sandbox.run_python` (a separate, resource-limited process under
    a guard that is not a security boundary; see there). Returns its
    ``{"passed", "status", "detail"}``: "passed" only when every test ran.
    """
    entry_point = problem["entry_point"]
    code = extract_code(completion_text, problem["prompt"], entry_point)
    return run_python(code + "\n" + problem["test"] + f"\ncheck({entry_point})\n", timeout_s)
