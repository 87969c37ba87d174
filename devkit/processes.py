"""Stopping the process groups devkit starts (each service runs in a session of its own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """
    SIGTERM ``proc``'s process group, wait up to ``timeout`` s, then SIGKILL whatever is left:
    children (Airflow's task and trigger runners, Spark's executor JVMs) may outlive the leader.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
