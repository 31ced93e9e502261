"""The one description of the machine a timing was taken on, for every table and results file."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model (Linux ``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """CPU model, architecture, logical cores and torch threads: what a timing depends on."""
    import torch  # local: the report gatherer runs without loading a model

    return (
        f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} logical cores, "
        f"{torch.get_num_threads()} torch threads"
    )
