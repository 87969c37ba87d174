"""
Local patches of the installed Airflow 3.3.2, for the upstream proposal measurements only (never
shipped, never imported by the provider), chosen by ``AIRFLOW_BENCH_PATCH``:

* ``one-session``: the triggerer's supervisor persists all TriggerEvents of one sync in **one** DB
  session and one commit, instead of one session per event (``TriggerRunnerSupervisor.handle_events``
  -> ``Trigger.submit_event`` under ``@provide_session``).
* ``housekeeping-once-a-second``: the supervisor's loop (``run_once``) runs its trigger assignment
  (``load_triggers``) and ``clean_unused`` at most once a second instead of after every socket
  read; everything else of the loop (events, failures, heartbeat) is unchanged. Today every 4 KiB
  read of the runner's log channel wakes a whole loop.

Loaded as ``sitecustomize`` (Python imports it at start when its folder is on ``PYTHONPATH``):
``bench/triggerer_bench.py --patch one-session`` puts ``bench/patches`` on the triggerer's path.
See docs/upstream-proposals.md for what it gives.

Semantics kept: a persist seq is confirmed only after the commit that stored its event; if the
commit fails, none of the batch's seqs are confirmed and the shared-stream producers redeliver
(the same outcome as today's per-event failure, for the whole sync).
"""

from __future__ import annotations

import os

_PATCH = os.environ.get("AIRFLOW_BENCH_PATCH")

if _PATCH == "one-session":
    from typing import Any

    def _install() -> None:
        from airflow._shared.observability.metrics import stats
        from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
        from airflow.models.trigger import Trigger
        from airflow.utils.helpers import prune_dict
        from airflow.utils.session import create_session

        def handle_events(self: Any) -> None:
            if not self.events:
                return
            entries = list(self.events)
            self.events.clear()
            with create_session() as session:
                for entry in entries:
                    Trigger.submit_event(trigger_id=entry.trigger_id, event=entry.event, session=session)
            for entry in entries:
                if entry.persist_seq is not None:
                    self.persisted_event_seqs.append(entry.persist_seq)
                stats.incr("triggers.succeeded", tags=prune_dict({"team_name": self.team_name}))

        TriggerRunnerSupervisor.handle_events = handle_events  # type: ignore[method-assign]

    _install()

if _PATCH == "housekeeping-once-a-second":
    import time
    from typing import Any

    def _install_housekeeping() -> None:
        from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor

        last_housekeeping: dict[int, float] = {}  # the supervisor is a slotted attrs class

        def run_once(self: Any) -> None:
            now = time.monotonic()
            housekeeping = now - last_housekeeping.get(id(self), 0.0) >= 1.0
            if housekeeping:
                last_housekeeping[id(self)] = now
                self.load_triggers()
            self._service_subprocess(1)
            self.handle_events()
            self.handle_failed_triggers()
            if housekeeping:
                self.clean_unused()
            self.heartbeat()
            self.emit_metrics()

        TriggerRunnerSupervisor.run_once = run_once  # type: ignore[method-assign]

    _install_housekeeping()
