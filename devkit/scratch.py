"""Throwaway state for tests, benchmarks and the demo: never ``~/airflow``, nothing left behind."""

from __future__ import annotations

import atexit
import shutil
import tempfile


def throwaway_dir(prefix: str) -> str:
    """
    A new temporary directory, removed when this process exits.

    For ``AIRFLOW_HOME``, use it only when the variable is unset (a user's choice, or a benchmark
    child inheriting its driver's, belongs to whoever set it)::

        os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-")
    """
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path
