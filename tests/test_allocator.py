"""The allocator policy: a freed activation's memory is reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A 64 MiB tensor allocated, written and freed once, then again: the second round's minor page
# faults. Run in a fresh interpreter, since the policy is process-wide and cannot be undone.
PROBE = """
import resource, sys, torch
from kvcmas.model.allocator import keep_freed_memory, freed_memory_kept
if sys.argv[1] == "keep":
    assert keep_freed_memory() and freed_memory_kept()
def touch():
    x = torch.empty(16 * 2**20, dtype=torch.float32)
    x.fill_(1.0)
    del x
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES = 64 * 2**20 // 4096


def second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_not_faulted_in_again():
    # Without the policy glibc maps the block anew: every page faults again.
    assert second_round_faults("default") > PAGES // 2
    assert second_round_faults("keep") < PAGES // 20


def test_machine_description_states_the_policy():
    from kvcmas.experiments.machine import machine_description
    from kvcmas.model.allocator import freed_memory_kept, keep_freed_memory

    keep_freed_memory()
    assert freed_memory_kept() == machine_description().endswith(", freed memory kept")
