"""The servers' CPU seconds: every process of a process group counts, reaped children
included, and nothing outside the group."""

import os
import signal
import subprocess
import sys

import pytest

from kvcmas.experiments.serve_bench.cpu_time import cpu_spent, group_cpu_s
from tests.test_serve_cli import read_line

TICK = os.sysconf("SC_CLK_TCK")
# Burns 0.4 s of its own CPU, says so, then idles until killed (or exits with "exit").
BURN = (
    "import sys, time\n"
    "while time.process_time() < 0.4: pass\n"
    "print('burnt', flush=True)\n"
    "if sys.argv[1:] != ['exit']: time.sleep(60)\n"
)


def fake_stat(pid, comm, ppid, pgrp, session, utime, stime, cutime, cstime):
    # Fields 1-20 of /proc/PID/stat, with non-zero neighbours of the ones that count.
    return (f"{pid} ({comm}) S {ppid} {pgrp} {session} 34816 {pgrp} 4194560 111 222 333 444 "
            f"{utime} {stime} {cutime} {cstime} 20 0 1 0\n")  # fmt: skip


def test_a_fake_proc_counts_the_group_by_its_pgrp_field_only(tmp_path):
    processes = {
        # pid: (comm, ppid, pgrp, session, utime, stime, cutime, cstime)
        100: ("python3", 1, 100, 100, 50, 10, 7, 3),  # the group leader
        101: ("VLLM::Engine (core) x", 100, 100, 100, 400, 40, 0, 0),  # spaces, parentheses
        102: ("sleeper", 1, 55, 100, 9000, 900, 90, 9),  # the leader's session, another group
        103: ("other", 1, 7, 100, 5000, 500, 50, 5),  # its session id is not the group either
    }
    for pid, fields in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(fake_stat(pid, *fields))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "104").mkdir()  # exited while we looked: no stat, skipped
    assert group_cpu_s([100], proc=tmp_path) == pytest.approx((70 + 440) / TICK)
    assert group_cpu_s([100, 55], proc=tmp_path) == pytest.approx((70 + 440 + 9999) / TICK)
    assert group_cpu_s([100, 3], proc=tmp_path) is None  # group 3 has no process: died


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_group_cpu_counts_live_and_reaped_processes_of_the_group_and_nothing_else():
    py = sys.executable
    # A shell in its own session: one burner it waits for (reaped: its time moves to the
    # shell's children's counters), then one that stays alive.
    group = subprocess.Popen(
        ["sh", "-c", f'"{py}" -c "$0" exit; "{py}" -c "$0" & wait', BURN],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    # A burner outside the group, at the same time.
    outside = subprocess.Popen([py, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        lines = [read_line(group, 60), read_line(group, 60), read_line(outside, 60)]
        assert lines == ["burnt\n"] * 3
        burnt = group_cpu_s([group.pid])
        # Both group burners' 0.4 s, less tick rounding (one alone, or the outsider added,
        # would give about 0.4 or 1.2 s).
        assert burnt is not None and 0.7 <= burnt < 1.1
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        outside.kill()
        group.wait()
        outside.wait()


def test_no_groups_or_no_proc_give_none(tmp_path):
    assert group_cpu_s([]) is None
    assert group_cpu_s([1], proc=tmp_path / "absent") is None


def test_cpu_spent_is_none_when_a_reading_is_missing_or_went_back():
    assert cpu_spent(2.0, 5.5) == 3.5
    assert cpu_spent(None, 5.5) is None and cpu_spent(2.0, None) is None
    assert cpu_spent(5.0, 2.0) is None
