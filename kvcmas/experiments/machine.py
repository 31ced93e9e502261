"""The one description of the machine a timing was taken on, for every table and results file."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from kvcmas.model.allocator import freed_memory_kept


def _cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in Linux ``/proc/cpuinfo``; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model, else the platform's processor string."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# The widest matrix/vector extension first: bf16 speed (and some fp32 kernels) follow it, and
# virtual machines of one CPU model name differ in it.
_ISA_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
              ("avx2", "AVX2"))  # fmt: skip


def vector_isa() -> str:
    """The CPU's widest extension of :data:`_ISA_FLAGS`, else ''."""
    flags = set((_cpuinfo("flags") or "").split())
    return next((name for flag, name in _ISA_FLAGS if flag in flags), "")


# Extensions with bf16 matrix instructions: there bf16 prefill is 3-4x faster than fp32 (what a
# user would serve in); elsewhere bf16 is emulated and slower than fp32.
BF16_ISAS = ("AMX", "AVX512-BF16")


def serving_dtype() -> str:
    """The dtype a user would serve in on this CPU: bf16 where it has bf16 matrix instructions
    (:data:`BF16_ISAS`), else fp32."""
    return "bf16" if vector_isa() in BF16_ISAS else "fp32"


def machine_description() -> str:
    """CPU model, architecture and widest vector extension, logical cores, torch threads and,
    where this process keeps freed memory (:mod:`kvcmas.model.allocator`), that: what a timing
    depends on."""
    import torch  # local: the report gatherer runs without loading a model

    arch = ", ".join(x for x in (platform.machine(), vector_isa()) if x)
    kept = ", freed memory kept" if freed_memory_kept() else ""
    return (
        f"{cpu_name()} ({arch}), {os.cpu_count()} logical cores, "
        f"{torch.get_num_threads()} torch threads{kept}"
    )
