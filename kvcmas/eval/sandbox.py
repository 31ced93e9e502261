"""Run a model-written Python program in a separate, resource-limited process.

One job: :func:`run_python` executes a program text under a guard and reports whether it
ran to its end. What the program is (a HumanEval completion plus its tests) is the scorer's
business (:func:`kvcmas.eval.scoring.run_humaneval`).

The guard stops accidents by model-written code; it is NOT a security boundary (see
:func:`run_python`).
"""

from __future__ import annotations

import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_python"]

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


def run_python(program: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Run ``program`` in a separate process; did it run to its end without raising?

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
    "passed" only when the program reached its end (a random token printed after it proves
    that it did not leave early), "failed" when it raises (a failed assertion, a blocked
    call, ``sys.exit``) or exceeds the output/memory limits, "error" when it does not compile
    or the harness cannot run it, "timeout" on the wall-clock or CPU limit.
    """
    token = secrets.token_hex(16)
    root = Path(tempfile.mkdtemp(prefix="kvcmas-sandbox-"))
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
                return _result("error", f"cannot start: {exc}")
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                rc = proc.wait()
                timed_out = True
            _kill_group(proc.pid)  # leftovers, if anything escaped the guard
        elapsed = time.monotonic() - start
        if timed_out:
            return _result("timeout", f"killed after {timeout_s}s")
        return _outcome(rc, token, elapsed, stdout_path, stderr_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _result(status: str, detail: str) -> dict[str, Any]:
    return {"passed": status == "passed", "status": status, "detail": detail}


def _outcome(rc: int, token: str, elapsed: float, stdout: Path, stderr: Path) -> dict[str, Any]:
    """The result of a finished child from its exit code and output (see ``_CHILD``)."""
    stderr_tail = _tail(stderr)
    last_err = stderr_tail.splitlines()[-1] if stderr_tail else ""
    if rc == 0:
        lines = _tail(stdout, 200).splitlines()
        if lines and lines[-1] == token:
            return _result("passed", f"{elapsed:.2f}s")
        return _result("failed", "exited before the tests completed")
    if rc == 1:
        return _result("failed", last_err)
    if rc == 2:
        return _result("error", last_err)
    if rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return _result("timeout", "CPU time limit")
        if sig == signal.SIGXFSZ:
            return _result("failed", "output limit exceeded")
        name = signal.Signals(sig).name if sig in signal.Signals else str(sig)
        return _result("failed", f"killed by {name}")
    return _result("error", f"exit code {rc}: {last_err}")
