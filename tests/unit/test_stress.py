"""
``devkit.stress``: the burners really run (N processes in one group, each burning CPU) and really stop
(the whole group gone after the block, after an exception in it, at interpreter exit, and when the
parent is SIGKILLed). Real processes, read through ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.stress import cpu_count, cpu_stress, workers_from_env

ROOT = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...] (fields 3 and up)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def group_members(pgid: int) -> set[int]:
    """Every live (not zombie) process whose process group is ``pgid``."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.add(int(entry.name))
    return members


def cpu_seconds(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def kill_group_quietly(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def test_starts_n_burning_processes_in_one_group_and_kills_the_group() -> None:
    with cpu_stress(2) as stress:
        assert stress.pgid is not None
        pgid = stress.pgid
        assert len(stress.pids) == 2
        assert group_members(pgid) == set(stress.pids)
        assert stress.timeout_factor == pytest.approx(1 + 2 / cpu_count())
        # Each burns CPU: 0.2 s of CPU time each (about 0.1-0.4 s of wall time on a free core; a
        # sleeping process would never get there).
        wait_for(lambda: all(cpu_seconds(pid) >= 0.2 for pid in stress.pids), 30, "0.2 s of CPU per burner")
        assert stress.cpu_seconds() >= 0.4  # what the e2e fixture reports as the stress taken
        # Same priority as the caller (and so as Airflow): not reniced.
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) for pid in stress.pids)
        processes = list(stress.processes)
    assert group_members(pgid) == set()
    assert [proc.returncode for proc in processes] == [-signal.SIGKILL] * 2
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_an_exception_in_the_block_still_kills_every_burner() -> None:
    pgid = 0
    with pytest.raises(RuntimeError, match="boom"), cpu_stress(3) as stress:
        assert stress.pgid is not None
        pgid = stress.pgid
        wait_for(lambda: len(group_members(pgid)) == 3, 10, "3 burners")
        raise RuntimeError("boom")
    assert pgid
    assert group_members(pgid) == set()
    assert all(proc.returncode == -signal.SIGKILL for proc in stress.processes)


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_block_never_left_is_stopped_at_interpreter_exit() -> None:
    # The check runs as an atexit handler registered *before* the stress, so it runs *after*
    # the stress's own handler (LIFO) and while the parent is still alive: what it sees is the
    # atexit cleanup, not the burners' own parent-death check.
    child = run_child(
        """
        import atexit, os
        from devkit.stress import cpu_stress

        def check():
            try:
                os.killpg(stress.pgid_seen, 0)
            except ProcessLookupError:
                print("group gone", flush=True)
            else:
                print("group alive", flush=True)
                os.killpg(stress.pgid_seen, 9)

        atexit.register(check)
        block = cpu_stress(2)  # kept referenced: a collected generator would close (and stop) it
        stress = block.__enter__()
        stress.pgid_seen = stress.pgid
        """
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "group gone", child.stdout + child.stderr


def test_burners_stop_by_themselves_when_their_parent_is_sigkilled() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os, signal, sys
                from devkit.stress import cpu_stress
                block = cpu_stress(2)
                stress = block.__enter__()
                print(stress.pgid, flush=True)
                sys.stdin.read()  # until the test says go
                os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit
                """
            ),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    pgid = int(child.stdout.readline())
    try:
        wait_for(lambda: len(group_members(pgid)) == 2, 10, "2 burners")
        child.stdin.close()
        assert child.wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: not group_members(pgid), 10, "the orphaned burners to exit")
    finally:
        kill_group_quietly(pgid)
        child.stdout.close()


@pytest.mark.parametrize("workers", [None, 0])
def test_none_or_zero_starts_nothing(workers: int | None) -> None:
    with cpu_stress(workers) as stress:
        assert stress.workers == 0
        assert stress.pids == [] and stress.pgid is None
        assert stress.timeout_factor == 1.0


def test_negative_workers_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"), cpu_stress(-1):
        pass


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 0), ("", 0), ("0", 0), ("2", 2), (" 3 ", 3), ("all", cpu_count()), ("ALL", cpu_count())],
)
def test_starve_cpus_values(value: str | None, expected: int) -> None:
    assert workers_from_env({} if value is None else {"STARVE_CPUS": value}) == expected


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_starve_cpus_typos_fail_loudly(value: str) -> None:
    with pytest.raises(ValueError, match="STARVE_CPUS"):
        workers_from_env({"STARVE_CPUS": value})
