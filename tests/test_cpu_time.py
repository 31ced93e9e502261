"""The servers' CPU seconds: every process of a process group counts, children included, and
nothing outside the group."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kvcmas.experiments.serve_bench.cpu_time import _stat_fields, group_cpu_s

# Burns 0.4 s of its own CPU, says so, then idles until killed.
BURN = (
    "import time\n"
    "while time.process_time() < 0.4: pass\n"
    "print('burnt', flush=True)\n"
    "time.sleep(60)\n"
)


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses():
    stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 0 0 0 0 7 3 5 1 20 0 1 0"
    fields = _stat_fields(stat)
    assert fields[0] == "S" and fields[2] == "42" and fields[11:15] == ["7", "3", "5", "1"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_group_cpu_counts_every_process_of_the_group_and_nothing_else():
    # A shell in its own session starts two burners: three processes in one group.
    group = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "$0" & "{sys.executable}" -c "$0" & wait', BURN],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert [group.stdout.readline() for _ in range(2)] == ["burnt\n", "burnt\n"]
        burnt = group_cpu_s([group.pid])
        # Both burners' 0.4 s, less tick rounding (one alone would give about half).
        assert burnt is not None and 0.7 <= burnt < 5.0
        # Our own group's time is not theirs: spend some and theirs does not move.
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
        assert group_cpu_s([group.pid]) - burnt < 0.1
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()


def test_no_groups_or_no_proc_give_none(tmp_path):
    assert group_cpu_s([]) is None
    assert group_cpu_s([1], proc=tmp_path / "absent") is None
