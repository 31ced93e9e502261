"""The allocator policy: a forward's freed activations are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Prefills of 2048 tokens through a tiny random-weight Qwen2 whose MLP activations are 64 MiB
# each (above glibc's largest dynamic mmap threshold, 32 MiB, as a real model's are at a few
# thousand tokens); the minor page faults of every prefill after the first. Run in a fresh
# interpreter, since the policy is process-wide and cannot be undone.
PROBE = """
import resource, sys, torch
sys.path.insert(0, sys.argv[2])
from conftest import ours_from_hf, tiny_hf_model
from kvcmas.model.allocator import keep_freed_memory, freed_memory_kept
if sys.argv[1] == "keep":
    assert keep_freed_memory() and freed_memory_kept()
torch.set_num_threads(1)
model = ours_from_hf(tiny_hf_model("qwen2", num_hidden_layers=2, intermediate_size=8192,
                                   max_position_embeddings=4096))
tokens = torch.arange(2048) % 128
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.inference_mode():
        model.prefill(tokens, model.new_cache(len(tokens)))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""

ACTIVATION_PAGES = 2048 * 8192 * 4 // 4096  # one MLP activation in 4 KiB pages
LATER_PREFILLS = 5


def later_prefills_faults(mode: str) -> int:
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(tests)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_not_faulted_in_again():
    # glibc's default maps each large activation anew: every later prefill faults all of them.
    default = later_prefills_faults("default")
    assert default > LATER_PREFILLS * ACTIVATION_PAGES
    # Kept, the heap serves them again. Not always zero: glibc's aligned allocation asks a
    # little more than the block it frees, so the heap can grow by a block now and then.
    kept = later_prefills_faults("keep")
    assert kept < default / 5


def test_machine_description_states_the_policy():
    from kvcmas.experiments.machine import machine_description
    from kvcmas.model.allocator import freed_memory_kept, keep_freed_memory

    keep_freed_memory()
    assert freed_memory_kept() == machine_description().endswith(", freed memory kept")
