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

HumanEval completions run in a separate, resource-limited process; see ``run_humaneval``.
"""

from __future__ import annotations

import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

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

# Runs inside the child before the untrusted program. It reads the program, saves the few
# real functions the harness needs, replaces dangerous functions with ones that raise, then
# executes the program. Exit codes: 0 + token on stdout = passed, 1 = the program raised,
# 2 = the program does not compile, 3 = harness error.
_CHILD = r'''
import builtins, io, os, sys

_token = os.environ.pop("KVCMAS_TOKEN", "")
_real_exit = os._exit
_real_write = os.write
with open(sys.argv[1], encoding="utf-8") as fh:
    _source = fh.read()

import _io, posix, shutil, socket, _socket, subprocess


class SandboxViolation(PermissionError):
    pass


def _blocked(name):
    def refuse(*args, **kwargs):
        raise SandboxViolation(f"{name} is disabled in the HumanEval sandbox")
    return refuse


_WRITE_MODES = set("wax+")
_real_open = builtins.open
_real_os_open = os.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _read_only_open(file, mode="r", *args, **kwargs):
    if _WRITE_MODES & set(str(mode)):
        raise SandboxViolation(f"open(..., {mode!r}) for writing is disabled in the sandbox")
    return _real_open(file, mode, *args, **kwargs)


def _read_only_os_open(path, flags, *args, **kwargs):
    if flags & _WRITE_FLAGS:
        raise SandboxViolation("os.open for writing is disabled in the sandbox")
    return _real_os_open(path, flags, *args, **kwargs)


class _ReadOnlyFileIO(_io.FileIO):
    def __init__(self, file, mode="r", *args, **kwargs):
        if _WRITE_MODES & set(str(mode)):
            raise SandboxViolation("FileIO for writing is disabled in the sandbox")
        super().__init__(file, mode, *args, **kwargs)


for _mod in (builtins, io, _io):
    _mod.open = _read_only_open
for _mod in (io, _io):
    _mod.FileIO = _ReadOnlyFileIO
for _mod in (os, posix):
    _mod.open = _read_only_os_open

_OS_NAMES = (
    "system popen remove unlink rmdir removedirs rename renames replace truncate ftruncate "
    "chdir fchdir chroot chmod fchmod lchmod chown fchown lchown chflags lchflags mkdir "
    "makedirs mkfifo mknod link symlink utime kill killpg fork forkpty vfork "
    "execl execle execlp execlpe execv execve execvp execvpe spawnl spawnle spawnlp spawnlpe "
    "spawnv spawnve spawnvp spawnvpe posix_spawn posix_spawnp putenv unsetenv setuid seteuid "
    "setgid setegid setreuid setregid setresuid setresgid setsid setpgid setpgrp nice "
    "_exit abort plock sched_setaffinity"
).split()
for _mod in (os, posix):
    for _name in _OS_NAMES:
        if hasattr(_mod, _name):
            setattr(_mod, _name, _blocked(f"{_mod.__name__}.{_name}"))

for _name in ("rmtree", "move", "copy", "copy2", "copyfile", "copymode", "copystat",
              "copytree", "chown", "make_archive", "unpack_archive"):
    setattr(shutil, _name, _blocked(f"shutil.{_name}"))
for _name in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
              "getstatusoutput"):
    setattr(subprocess, _name, _blocked(f"subprocess.{_name}"))
for _name in ("_posixsubprocess", "_fork_exec"):
    if hasattr(subprocess, _name):
        delattr(subprocess, _name)
for _mod in (socket, _socket):
    for _name in ("socket", "socketpair", "fromfd", "create_connection", "create_server",
                  "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _blocked(f"{_mod.__name__}.{_name}"))


class _DenyImports:
    """Refuses modules that offer other routes to processes, raw memory or limits."""

    DENY = {"ctypes", "_ctypes", "multiprocessing", "_multiprocessing", "_posixsubprocess",
            "pty", "resource", "mmap", "_xxsubinterpreters"}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.DENY:
            raise ImportError(f"import of {name} is disabled in the HumanEval sandbox")
        return None


sys.meta_path.insert(0, _DenyImports())
for _name in list(sys.modules):
    if _name.split(".")[0] in _DenyImports.DENY:
        del sys.modules[_name]

try:
    _code = compile(_source, "<solution>", "exec")
except (SyntaxError, ValueError) as exc:
    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    _real_exit(2)

try:
    # "__name__" is not "__main__": demo blocks under `if __name__ == "__main__":` are skipped.
    exec(_code, {"__name__": "__solution__", "__builtins__": builtins})
except BaseException as exc:  # SystemExit too: leaving early is not passing
    try:
        sys.stderr.write(f"{type(exc).__name__}: {str(exc)[:500]}\n")
        sys.stderr.flush()
    finally:
        _real_exit(1)
try:
    sys.stdout.flush()
except BaseException:
    pass
_real_write(1, ("\n" + _token + "\n").encode())
_real_exit(0)
'''

_OUTPUT_LIMIT = 1 << 20  # RLIMIT_FSIZE: bounds stdout/stderr files and anything written
_MEMORY_LIMIT = 2 << 30  # RLIMIT_AS


def _limit_child(cpu_seconds: int) -> None:
    """preexec_fn: runs in the forked child before exec. Only setrlimit calls (the module is
    imported by the parent) to stay as safe as possible after fork."""

    def _set(kind: int, soft: int, hard: int | None = None) -> None:
        try:
            _, old_hard = resource.getrlimit(kind)
            hard = soft if hard is None else hard
            if old_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, old_hard), min(hard, old_hard)
            resource.setrlimit(kind, (soft, hard))
        except (ValueError, OSError):
            pass  # not allowed here (e.g. a lower hard limit set by a container)

    _set(resource.RLIMIT_AS, _MEMORY_LIMIT)
    _set(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)
    _set(resource.RLIMIT_FSIZE, _OUTPUT_LIMIT)
    _set(resource.RLIMIT_CORE, 0)
    # Forking is refused by the guard already; this also stops it for non-root users
    # (root ignores RLIMIT_NPROC).
    _set(resource.RLIMIT_NPROC, 1)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_humaneval(
    problem: dict[str, Any], completion_text: str, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Run a HumanEval completion against the problem's tests in a separate process.

    The program is ``extract_code(...) + "\\n" + problem["test"] + "\\ncheck(entry_point)\\n"``.
    It runs under ``sys.executable -I -S`` (no site-packages, no PYTHON* variables) with
    stdin from /dev/null, in a fresh empty temporary working directory (also HOME and
    TMPDIR), with a minimal environment, in its own process group, with rlimits (address
    space 2 GiB, CPU time, 1 MiB file size, no core files, NPROC 1) and a wall-clock
    timeout after which the whole process group is killed.

    Before the program runs, a prelude replaces file-writing, file-deleting, process,
    signal and socket functions (``open`` in write modes, ``os.remove``, ``os.system``,
    ``shutil.rmtree``, ``subprocess.Popen``, ``socket.socket``, ``os.fork``, ``os.kill``,
    ...) with functions that raise, and refuses imports such as ``ctypes`` and
    ``multiprocessing``. This is a GUARD against accidents by model-written code, NOT a
    security boundary: Python code can reach the originals (e.g. through object
    introspection) and the process runs as the calling user. Use a container or VM for
    code you do not trust at all. The limits are set in a ``preexec_fn`` (only ``setrlimit``
    calls); CPython documents ``preexec_fn`` as not fully safe in a multi-threaded parent.

    Returns ``{"passed": bool, "status": "passed"|"failed"|"timeout"|"error", "detail": str}``:
    "failed" when the program raises (a failed assertion, a blocked call, ``sys.exit``) or
    exceeds the output/memory limits, "error" when it does not compile or the harness
    cannot run it, "timeout" on the wall-clock or CPU limit.
    """
    entry_point = problem["entry_point"]
    code = extract_code(completion_text, problem["prompt"], entry_point)
    program = code + "\n" + problem["test"] + f"\ncheck({entry_point})\n"
    token = secrets.token_hex(16)

    root = Path(tempfile.mkdtemp(prefix="kvcmas-humaneval-"))
    try:
        workdir = root / "work"
        workdir.mkdir()
        program_path = root / "program.py"
        program_path.write_text(program, encoding="utf-8")
        stdout_path, stderr_path = root / "stdout", root / "stderr"
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "KVCMAS_TOKEN": token,
        }
        cpu_seconds = max(1, math.ceil(timeout_s)) + 1
        start = time.monotonic()
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _CHILD, str(program_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,  # own process group, killed as a whole
                    preexec_fn=lambda: _limit_child(cpu_seconds),
                    close_fds=True,
                )
            except OSError as exc:
                return {"passed": False, "status": "error", "detail": f"cannot start: {exc}"}
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                rc = proc.wait()
                timed_out = True
            _kill_group(proc.pid)  # leftovers, if anything escaped the guard
        elapsed = time.monotonic() - start
        stderr_tail = _tail(stderr_path)
        last_err = stderr_tail.splitlines()[-1] if stderr_tail else ""

        if timed_out:
            return {"passed": False, "status": "timeout", "detail": f"killed after {timeout_s}s"}
        if rc == 0:
            lines = _tail(stdout_path, 200).splitlines()
            if lines and lines[-1] == token:
                return {"passed": True, "status": "passed", "detail": f"{elapsed:.2f}s"}
            return {
                "passed": False,
                "status": "failed",
                "detail": "exited before the tests completed",
            }
        if rc == 1:
            return {"passed": False, "status": "failed", "detail": last_err}
        if rc == 2:
            return {"passed": False, "status": "error", "detail": last_err}
        if rc < 0:
            sig = -rc
            if sig == signal.SIGXCPU:
                return {"passed": False, "status": "timeout", "detail": "CPU time limit"}
            if sig == signal.SIGXFSZ:
                return {"passed": False, "status": "failed", "detail": "output limit exceeded"}
            name = signal.Signals(sig).name if sig in signal.Signals else str(sig)
            return {"passed": False, "status": "failed", "detail": f"killed by {name}"}
        return {"passed": False, "status": "error", "detail": f"exit code {rc}: {last_err}"}
    finally:
        shutil.rmtree(root, ignore_errors=True)
