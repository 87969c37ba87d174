"""
A starved machine: CPU-burning processes beside a real Airflow, to test what leans on wall-clock time.

Why. Production triggerers run hot, and restarts come when they are busiest. The guarantees that
lean on wall-clock quiet times are the first to give on a loaded 2-core VM: the cohort's
``cohort_settle`` window (``_core/cohort.py``: "no watcher joined for 3 s" assumes a triggerer loop
takes about one second), ``shared_stream_ack_timeout``, the triggerer's 2 s heartbeat against its
10 s health-check threshold (devkit's settings), a producer's lease renewals. An unloaded test
machine never puts them to the test.

What it measures. :func:`cpu_stress` starts ``workers`` processes that each run a plain Python busy
loop (no I/O, no memory: only run-queue pressure) at the **same priority as Airflow**. They are
not reniced (nice increment 0): they inherit the caller's niceness, exactly as the Airflow
components that devkit starts do. With ``n`` burners on ``c`` cores the kernel's fair scheduler
gives each runnable process about ``c / (n + runnable Airflow processes)`` of a core, so every
Airflow process (triggerer, its supervisor, the DB writers) runs roughly ``1 + n / c`` times slower
in wall-clock terms, and its sleeps and timeouts come due with less work done between them. A
niced stress (``nice 19``) would measure nothing: CFS would give Airflow nearly all the CPU it asks
for and the burners only the idle time.

Safety (the machine is shared): the burners run in a process group of their own, which is always
SIGKILLed as a whole on exit of the ``with`` block (also on an exception), at interpreter exit
(``atexit``, for a context entered and never left), and each burner also stops by itself within a
fraction of a second when its parent is gone (the parent SIGKILLed, where neither of the others
runs).

``STARVE_CPUS`` (:func:`stress_from_env`): unset, empty or ``0`` means no stress; an integer ``n``
means ``n`` burners; ``all`` means ``os.cpu_count()`` burners.

Manual runs::

    python -m devkit.stress --workers 2 --seconds 60
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ENV_VAR: Final = "STARVE_CPUS"

# The burner: a busy loop that checks, every few million iterations (tens of milliseconds), whether
# its parent is still the process that started it; re-parented (the parent died without cleaning
# up) it exits, so a SIGKILLed test run cannot leave burners on a shared machine. The parent's pid
# is passed in, not read at start: a parent killed before the burner's interpreter ran its first
# line would otherwise be taken for init, and the burner would never stop.
_BURN: Final = "import os\nwhile os.getppid() == {parent}:\n    for _ in range(2_000_000):\n        pass\n"


def cpu_count() -> int:
    """The number of CPUs this process may run on (``os.cpu_count()``, at least 1)."""
    return os.cpu_count() or 1


@dataclass
class CpuStress:
    """The running burners of one :func:`cpu_stress` block (``workers == 0``: none)."""

    workers: int
    pgid: int | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.processes]

    @property
    def timeout_factor(self) -> float:
        """
        How much longer a CPU-bound wait may take under this stress: ``1 + workers / cpus``.

        Derivation: with the cores already busy with Airflow (the case that matters), adding ``n``
        equal-priority runnable processes to ``c`` cores gives each Airflow process about
        ``c / (c + n)`` of what it had, so its work takes ``(c + n) / c`` times as long.
        """
        return 1.0 + self.workers / cpu_count()

    def cpu_seconds(self) -> float:
        """
        CPU seconds the burners have used so far (Linux ``/proc``; 0.0 where it cannot be read):
        over the wall time they ran, this is how many cores the stress actually took from the
        machine, the evidence that it starved anything.
        """
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids:
            try:
                text = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        return total / ticks

    def describe(self) -> str:
        if not self.workers:
            return "no CPU stress"
        return f"{self.workers} CPU burner(s) at nice 0 on {cpu_count()} CPU(s), process group {self.pgid}"

    def stop(self) -> None:
        """SIGKILL the whole group and reap every burner (idempotent)."""
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        for proc in self.processes:
            if proc.poll() is None:
                # A burner not (yet) in the group, e.g. a start that failed half-way.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.pgid = None


def _start_burner(pgid: int | None) -> subprocess.Popen[bytes]:
    """
    One burner: the first leads a new process group (its pid is the group id), the others join it.
    The group stays in the caller's session: a process may only join a group of its own session.
    """
    command = [sys.executable, "-I", "-S", "-c", _BURN.format(parent=os.getpid())]
    devnull = subprocess.DEVNULL
    group = 0 if pgid is None else pgid  # setpgid(0, 0): a new group led by the burner itself
    if sys.version_info >= (3, 11):
        return subprocess.Popen(command, stdin=devnull, stdout=devnull, process_group=group)
    # Python 3.10 has no ``process_group``; the hook makes one syscall and takes no lock, which is
    # what makes ``preexec_fn`` unsafe in a threaded parent.
    return subprocess.Popen(command, stdin=devnull, stdout=devnull, preexec_fn=lambda: os.setpgid(0, group))  # noqa: PLW1509


@contextlib.contextmanager
def cpu_stress(workers: int | None) -> Iterator[CpuStress]:
    """
    Run ``workers`` CPU-burning processes for the duration of the block (None or 0: none).

    Yields a :class:`CpuStress` (its pids, its process group, :attr:`CpuStress.timeout_factor`).
    The burners are SIGKILLed as one process group when the block ends, however it ends, and at
    interpreter exit if it never does.
    """
    count = workers or 0
    if count < 0:
        raise ValueError(f"cpu_stress: workers must be >= 0, got {workers}")
    stress = CpuStress(workers=count)
    if not count:
        yield stress
        return
    atexit.register(stress.stop)
    try:
        for _ in range(count):
            proc = _start_burner(stress.pgid)
            stress.processes.append(proc)
            if stress.pgid is None:
                stress.pgid = proc.pid
        yield stress
    finally:
        stress.stop()
        atexit.unregister(stress.stop)


def workers_from_env(environ: Mapping[str, str] | None = None) -> int:
    """
    The number of burners ``STARVE_CPUS`` asks for: unset / empty / ``0`` -> 0, ``all`` ->
    ``os.cpu_count()``, an integer -> itself. Anything else raises ValueError: a typo must not
    silently run an unstressed test that then reports "passed under stress".
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if not raw:
        return 0
    if raw == "all":
        return cpu_count()
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected an integer >= 0 or 'all'") from None
    if value < 0:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected an integer >= 0 or 'all'")
    return value


def stress_from_env(environ: Mapping[str, str] | None = None) -> contextlib.AbstractContextManager[CpuStress]:
    """:func:`cpu_stress` with the number of burners ``STARVE_CPUS`` asks for (none when unset)."""
    return cpu_stress(workers_from_env(environ))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=cpu_count(), help="CPU burners to run (default: os.cpu_count())")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to burn (default: 60)")
    args = parser.parse_args(argv)
    with cpu_stress(args.workers) as stress:
        print(f"{stress.describe()}: pids {stress.pids}, for {args.seconds:.0f} s", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.seconds)
    print(f"stopped; load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
