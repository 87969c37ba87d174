"""
Soak: a real triggerer for tens of minutes at a steady rate, restarted now and then; RSS, asyncio
tasks and file descriptors must stay flat, and no watcher may lose a message.

Not a test. From the repository root::

    .venv/bin/python -m bench.soak --brokers kafka,sqs,pubsub,servicebus --minutes 30 --rate 5 \
        --watchers 3 --restart-every 300
    .venv/bin/python -m bench.soak --brokers kafka --minutes 3 --restart-every 60 --warmup 30   # smoke
    .venv/bin/python -m bench.soak --render bench/results/soak-<date>-<brokers>.json

What runs: the real Airflow of ``bench.triggerer_bench`` (``devkit.airflow_env``: ``airflow db
migrate``, ``airflow dag-processor``, ``airflow triggerer``; SQLite, or ``--db postgres`` for a
fresh PostgreSQL 15 of ``devkit.postgres``) with Airflow's default ``[triggerer]`` settings, and
the brokers of ``bench.triggerer_bench`` (Tansu, moto_server, the Pub/Sub emulator, the Service
Bus test broker). One Dag file holds, per broker, ``--watchers`` assets with one AssetWatcher each
on **one shared stream** of that broker (the streams side by side in the one triggerer), plus the
probe asset (below). Every watcher matches every message of its stream; their ``match`` differs
by a never-published value so that Airflow keeps one trigger row per watcher (identical trigger
kwargs would share one row, i.e. one subscriber).

* **publishers**: one thread per broker publishes ``--rate`` messages/s for ``--minutes``, each
  body carrying ``seq`` (its identity per broker) and ``published_at``. A failed send is retried
  with the next seq; the seq whose send raised counts as "uncertain" (expected only if some
  watcher got it).
* **restarts**: every ``--restart-every`` s (x uniform(0.7, 1.3), ``--seed``), alternating a
  graceful restart (SIGTERM to the triggerer's process group, SIGKILL after 30 s, then start) and
  ``kill -9`` of the group, first graceful. None in the last ``2 x --warmup`` s of the publish
  window. After each, the driver waits until every watcher is assigned to the new triggerer job.
* **samples** every ``--sample-interval`` s (default 10), from ``/proc``: ``VmRSS`` and the
  number of entries of ``/proc/<pid>/fd`` of the triggerer supervisor (the ``airflow triggerer``
  process) and of its descendants (the trigger runner; summed when there are several).
* **asyncio tasks**: the probe trigger ``bench/soak_dags/soak_probe.py`` (a plain
  ``BaseEventTrigger`` behind an AssetWatcher of its own asset; it never fires) appends
  ``len(asyncio.all_tasks())`` of the triggerer's loop, with its pid and the most common coroutine
  names, to a file every ``--sample-interval`` s. Its pid is checked against the sampled runner
  pids (``probe_in_runner`` in the JSON).
* **at the end**: publishing stops, the driver waits (``--drain-timeout``) until every watcher
  holds every message, then reads the metadata DB once more: per broker published, asset events
  persisted, lost (per watcher; any loss fails the run loudly, exit code 1) and duplicates.

**Flatness** (restarts reset both processes, so levels are compared at equal footing): the first
``--warmup`` s of every triggerer life are dropped (imports, Dag parse, stream formation, first
commits: the working set being built). On what is left, per series:

* ``first`` = median of the first 5 minutes of post-warm-up samples of the run, ``last`` = median
  of the post-warm-up samples of the last 5 minutes: **across lives** (a leak that survives a
  restart: broker, DB, files) and the issue's literal "first vs last";
* ``slope`` = least squares over all post-warm-up samples, per hour (across lives);
* ``within-life slope`` = least squares of value on age-in-life with one intercept per life
  (pooled over every life), per hour: growth inside one process, which a restart would hide; its
  effect over a life = slope x the median post-warm-up life span;
* flat = ``|last - first|`` and ``|within-life growth over a life|`` both within the tolerance:
  RSS max(10 MB, 5 %), file descriptors and tasks max(3, 10 %) of ``first``.

Exit code: 0 ok, 1 a message lost (or the run failed), 3 a series not flat. The JSON
(``bench/results/soak-<date>-<brokers>.json``) holds every sample, every probe line, the restarts,
per-life summaries and the verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from bench.common import (
    RESULTS_DIR,
    as_json,
    comma_words,
    exit_on_signal,
    fmt_num,
    machine_info,
    markdown_table,
    source_state,
)
from bench.triggerer_bench import (
    BROKER_CLASSES,
    BROKERS,
    BenchAirflowEnv,
    BenchBroker,
    BenchStream,
    EventLog,
    _versions,
    assigned_watchers,
    message_body,
)
from devkit.latency import percentile
from devkit.postgres import PostgresServer

PROBE_DIR: Final = Path(__file__).resolve().parent / "soak_dags"
DAG_ID: Final = "soak_consumer"
PROBE_ASSET: Final = "soak_probe"
PROBE_WATCHER: Final = "probe"
WINDOW_S: Final = 300.0  # "first / last 5 minutes"
SERIES: Final = ("rss_supervisor_mb", "rss_runner_mb", "fds_supervisor", "fds_runner", "tasks")


def tolerance(series: str, first: float) -> float:
    """The allowed |last - first| (and within-life growth over a life) of a series."""
    if series.startswith("rss"):
        return max(10.0, 0.05 * abs(first))
    return max(3.0, 0.10 * abs(first))


# ==================================================================================================
# /proc
# ==================================================================================================
def proc_rss_mb(pid: int) -> float | None:
    """``VmRSS`` of ``/proc/<pid>/status`` in MB; None if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def proc_children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (``/proc/<pid>/task/<tid>/children``, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                kids = [int(x) for x in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
                out += kids
                todo += kids
    return out


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""


# ==================================================================================================
# The triggerer's lives and samples
# ==================================================================================================
@dataclass
class Life:
    """One ``airflow triggerer`` process (and its runner) between two restarts."""

    index: int
    started: float  # epoch s: the driver started the process
    supervisor_pid: int | None
    ended: float | None = None
    ended_by: str | None = None  # "graceful" | "kill -9" | "end of run"
    watchers_assigned_s: float | None = None
    runner_pids: set[int] = field(default_factory=set)
    process_names: dict[int, str] = field(default_factory=dict)


@dataclass
class Sample:
    t: float  # epoch s
    life: int
    rss_supervisor_mb: float
    fds_supervisor: int
    rss_runner_mb: float | None
    fds_runner: int | None
    runner_pids: list[int]


class Sampler:
    """Samples the current triggerer life's supervisor and descendants every ``interval`` s."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[Sample] = []
        self.lives: list[Life] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def new_life(self, supervisor_pid: int | None) -> Life:
        with self._lock:
            life = Life(index=len(self.lives) + 1, started=time.time(), supervisor_pid=supervisor_pid)
            self.lives.append(life)
            return life

    def end_life(self, how: str) -> None:
        with self._lock:
            if self.lives and self.lives[-1].ended is None:
                self.lives[-1].ended = time.time()
                self.lives[-1].ended_by = how

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample(self) -> Sample | None:
        with self._lock:
            life = self.lives[-1] if self.lives else None
            if life is None or life.ended is not None or life.supervisor_pid is None:
                return None
            pid = life.supervisor_pid
            rss = proc_rss_mb(pid)
            fds = proc_fds(pid)
            if rss is None or fds is None:
                return None
            children = proc_children(pid)
            rss_kids = [proc_rss_mb(child) for child in children]
            fds_kids = [proc_fds(child) for child in children]
            alive = [c for c, r, f in zip(children, rss_kids, fds_kids, strict=True) if r is not None and f is not None]
            for child in alive:
                life.runner_pids.add(child)
                if child not in life.process_names:
                    life.process_names[child] = proc_name(child)
            if pid not in life.process_names:
                life.process_names[pid] = proc_name(pid)
            sample = Sample(
                t=time.time(),
                life=life.index,
                rss_supervisor_mb=round(rss, 2),
                fds_supervisor=fds,
                rss_runner_mb=round(sum(r for r in rss_kids if r is not None), 2) if alive else None,
                fds_runner=sum(f for f in fds_kids if f is not None) if alive else None,
                runner_pids=alive,
            )
            self.samples.append(sample)
            return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


# ==================================================================================================
# Publishers
# ==================================================================================================
class Publisher(threading.Thread):
    """Publishes ``rate`` msgs/s to one stream until ``stop``; survives failed sends."""

    def __init__(self, broker: str, stream: BenchStream, rate: float, stop: threading.Event) -> None:
        super().__init__(name=f"soak-publisher-{broker}", daemon=True)
        self.broker = broker
        self.stream = stream
        self.rate = rate
        self.stop_event = stop
        self.next_seq = 0
        self.attempted = 0  # live: seqs handed to the client so far (next_seq moves when a publish call returns)
        self.uncertain: set[int] = set()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            base = self.next_seq
            last = [base - 1]

            def body(index: int, base: int = base, last: list[int] = last) -> bytes:
                last[0] = base + index
                self.attempted = base + index + 1
                return message_body(base + index, self.broker, stamp=True)

            try:
                sent = self.stream.publish(10**9, body, rate=self.rate, stop=self.stop_event)
                self.next_seq = base + sent
            except Exception as exc:
                self.errors.append(f"{time.time():.0f} seq {last[0]}: {type(exc).__name__}: {exc}"[:500])
                if last[0] >= base:
                    self.uncertain.add(last[0])
                self.next_seq = max(base, last[0] + 1)
                self.stop_event.wait(1.0)


# ==================================================================================================
# The Dag
# ==================================================================================================
DAG_TEMPLATE: Final = '''\
"""Generated by bench.soak: per broker {watchers} asset watchers on one shared stream, plus the loop probe."""

import importlib

from airflow.sdk import DAG, Asset, AssetAny, AssetWatcher, task
from soak_probe import LoopProbeTrigger

STREAMS = {streams}

probe = LoopProbeTrigger(path={probe_path!r}, interval={interval})
assets = [Asset("{probe_asset}", watchers=[AssetWatcher(name="{probe_watcher}", trigger=probe)])]
for broker, (path, kwargs) in STREAMS.items():
    module, cls = path.rsplit(".", 1)
    trigger_class = getattr(importlib.import_module(module), cls)
    for i in range({watchers}):
        # Every watcher matches every message of its stream; the never-published second value
        # keeps the trigger kwargs distinct (one trigger row, i.e. one subscriber, per watcher).
        match = {{"body.phase": [broker, f"never-{{i}}"]}}
        assets.append(
            Asset(
                f"soak_{{broker}}_{{i}}",
                watchers=[AssetWatcher(name=f"w_{{broker}}_{{i}}", trigger=trigger_class(**kwargs, match=match))],
            )
        )

with DAG("{dag_id}", schedule=AssetAny(*assets), max_active_runs=1, catchup=False):

    @task
    def consume() -> None:
        pass

    consume()
'''


def write_dag(
    folder: Path, streams: dict[str, tuple[str, dict[str, Any]]], watchers: int, probe_path: Path, interval: float
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "soak_watchers.py"
    path.write_text(
        DAG_TEMPLATE.format(
            streams=repr(streams),
            watchers=watchers,
            probe_watcher=PROBE_WATCHER,
            probe_asset=PROBE_ASSET,
            probe_path=str(probe_path),
            interval=interval,
            dag_id=DAG_ID,
        )
    )
    return path


def watcher_names(brokers: Sequence[str], watchers: int) -> list[str]:
    return [PROBE_WATCHER, *(f"w_{b}_{i}" for b in brokers for i in range(watchers))]


# ==================================================================================================
# Analysis
# ==================================================================================================
def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx * 3600


def pooled_within_life_slope(by_life: dict[int, list[tuple[float, float]]]) -> float | None:
    """Least squares of value on age with one intercept per life; per hour."""
    sxx = sxy = 0.0
    for points in by_life.values():
        if len(points) < 3:
            continue
        mx = statistics.fmean(x for x, _ in points)
        my = statistics.fmean(y for _, y in points)
        sxx += sum((x - mx) ** 2 for x, _ in points)
        sxy += sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx * 3600 if sxx > 0 else None


def series_points(
    samples: Sequence[Sample], probe: Sequence[dict[str, Any]], lives: Sequence[Life]
) -> dict[str, list[tuple[float, int, float]]]:
    """``series -> [(epoch t, life, value)]``: the /proc samples and the probe's task counts."""
    out: dict[str, list[tuple[float, int, float]]] = {name: [] for name in SERIES}
    for s in samples:
        out["rss_supervisor_mb"].append((s.t, s.life, s.rss_supervisor_mb))
        out["fds_supervisor"].append((s.t, s.life, float(s.fds_supervisor)))
        if s.rss_runner_mb is not None and s.fds_runner is not None:
            out["rss_runner_mb"].append((s.t, s.life, s.rss_runner_mb))
            out["fds_runner"].append((s.t, s.life, float(s.fds_runner)))
    for line in probe:
        life = life_at(lives, float(line["t"]))
        if life is not None:
            out["tasks"].append((float(line["t"]), life.index, float(line["tasks"])))
    return out


def life_at(lives: Sequence[Life], t: float) -> Life | None:
    found: Life | None = None
    for life in lives:
        if life.started <= t and (life.ended is None or t <= life.ended):
            found = life
    return found


def analyse(
    points: dict[str, list[tuple[float, int, float]]], lives: Sequence[Life], warmup: float, run_end: float
) -> dict[str, Any]:
    starts = {life.index: life.started for life in lives}
    spans = [
        (life.ended if life.ended is not None else run_end) - life.started - warmup
        for life in lives
        if (life.ended if life.ended is not None else run_end) - life.started > warmup
    ]
    life_span_h = statistics.median(spans) / 3600 if spans else 0.0
    out: dict[str, Any] = {"warmup_s": warmup, "median_post_warmup_life_s": round(life_span_h * 3600, 1)}
    for name, values in points.items():
        kept = [(t, life, v) for t, life, v in values if t - starts[life] >= warmup]
        if not kept:
            out[name] = {"samples": 0}
            continue
        t0 = kept[0][0]
        first = [v for t, _, v in kept if t - t0 <= WINDOW_S]
        last = [v for t, _, v in kept if t >= run_end - WINDOW_S]
        by_life: dict[int, list[tuple[float, float]]] = {}
        for t, life, v in kept:
            by_life.setdefault(life, []).append((t - starts[life], v))
        first_median = statistics.median(first)
        last_median = statistics.median(last) if last else None
        slope = slope_per_hour([(t, v) for t, _, v in kept])
        within = pooled_within_life_slope(by_life)
        within_growth = within * life_span_h if within is not None else None
        tol = tolerance(name, first_median)
        change = last_median - first_median if last_median is not None else None
        flat = change is not None and abs(change) <= tol and (within_growth is None or abs(within_growth) <= tol)
        out[name] = {
            "samples": len(kept),
            "samples_with_warmup": len(values),
            "first_5min_median": round(first_median, 2),
            "last_5min_median": None if last_median is None else round(last_median, 2),
            "change": None if change is None else round(change, 2),
            "slope_per_hour": None if slope is None else round(slope, 2),
            "within_life_slope_per_hour": None if within is None else round(within, 2),
            "within_life_growth_per_life": None if within_growth is None else round(within_growth, 2),
            "tolerance": round(tol, 2),
            "flat": flat,
            "min": round(min(v for _, _, v in kept), 2),
            "max": round(max(v for _, _, v in kept), 2),
            "per_life": {
                str(life): {
                    "samples": len(pts),
                    "median": round(statistics.median(v for _, v in pts), 2),
                    "first": round(pts[0][1], 2),
                    "last": round(pts[-1][1], 2),
                    "slope_per_hour": None if (s := slope_per_hour(pts)) is None else round(s, 2),
                }
                for life, pts in sorted(by_life.items())
            },
        }
    return out


def broker_results(
    log: EventLog, brokers: Sequence[str], watchers: int, publishers: dict[str, Publisher]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for broker in brokers:
        pub = publishers[broker]
        assets = [f"soak_{broker}_{i}" for i in range(watchers)]
        seen_any: set[int] = set()
        for asset in assets:
            seen_any |= log.seen.get((broker, asset), set())
        expected = set(range(pub.next_seq)) - (pub.uncertain - seen_any)
        per_watcher: dict[str, Any] = {}
        deliveries = [d for d in log.deliveries if d.phase == broker]
        for asset in assets:
            seen = log.seen.get((broker, asset), set())
            count = sum(1 for d in deliveries if d.asset == asset)
            missing = sorted(expected - seen)
            per_watcher[asset] = {
                "distinct": len(seen & expected),
                "lost": len(missing),
                "lost_seqs": missing[:200],
                "duplicates": count - len(seen),
                "unexpected": len(seen - expected),
            }
        latencies = [d.persisted - d.published_at for d in deliveries if d.published_at is not None]
        out[broker] = {
            "published": pub.next_seq,
            "uncertain_sends": sorted(pub.uncertain),
            "publish_errors": pub.errors[-20:],
            "expected_per_watcher": len(expected),
            "asset_events": sum(1 for e in log.events if e[0] in assets),
            "deliveries": len(deliveries),
            "lost": sum(w["lost"] for w in per_watcher.values()),
            "duplicates": sum(w["duplicates"] for w in per_watcher.values()),
            "watchers": per_watcher,
            "latency_p50_s": percentile(latencies, 0.5),
            "latency_p95_s": percentile(latencies, 0.95),
            "latency_max_s": max(latencies) if latencies else None,
        }
    return out


def lost_near_restart(result: dict[str, Any], restarts: Sequence[dict[str, Any]], rate: float) -> list[str]:
    """Each lost seq with its approximate publish time (seq / rate) and the nearest restart."""
    lost = sorted({seq for w in result["watchers"].values() for seq in w["lost_seqs"]})
    out: list[str] = []
    for seq in lost[:100]:
        at = seq / rate
        line = f"seq {seq} published ~{at / 60:.2f} min"
        if restarts:
            near = min(restarts, key=lambda r: abs(r["at_min"] * 60 - at))
            line += f", {at - near['at_min'] * 60:+.1f} s from the {near['kind']} restart at {near['at_min']:.2f} min"
        out.append(line)
    return out


def read_probe(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# ==================================================================================================
# Tables
# ==================================================================================================
SERIES_LABELS: Final = {
    "rss_supervisor_mb": "RSS supervisor (MB)",
    "rss_runner_mb": "RSS trigger runner (MB)",
    "fds_supervisor": "open fds supervisor",
    "fds_runner": "open fds trigger runner",
    "tasks": "asyncio tasks (runner loop)",
}


def render_tables(report: dict[str, Any]) -> str:
    lines = ["Per broker\n"]
    rows = []
    for broker, r in report.get("brokers_result", {}).items():
        rows.append(
            [
                broker,
                str(r["published"]),
                str(r["asset_events"]),
                str(r["lost"]),
                str(r["duplicates"]),
                f"{fmt_num(r.get('latency_p50_s'))} / {fmt_num(r.get('latency_p95_s'))} / "
                f"{fmt_num(r.get('latency_max_s'), 1)}",
            ]
        )
    lines.append(
        markdown_table(["broker", "published", "asset events", "lost", "duplicates", "latency p50 / p95 / max s"], rows)
    )
    analysis = report.get("analysis", {})
    lines.append(
        f"\nSeries (warm-up {analysis.get('warmup_s')} s per life dropped; median post-warm-up life "
        f"{analysis.get('median_post_warmup_life_s')} s)\n"
    )
    rows = []
    for name in SERIES:
        a = analysis.get(name) or {}
        if not a.get("samples"):
            rows.append([SERIES_LABELS[name], "0", "-", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                SERIES_LABELS[name],
                str(a["samples"]),
                fmt_num(a["first_5min_median"], 1),
                fmt_num(a["last_5min_median"], 1),
                fmt_num(a["slope_per_hour"], 1),
                fmt_num(a["within_life_slope_per_hour"], 1),
                f"{fmt_num(a['min'], 1)} - {fmt_num(a['max'], 1)}",
                f"+-{fmt_num(a['tolerance'], 1)}",
                "yes" if a["flat"] else "**no**",
            ]
        )
    lines.append(
        markdown_table(
            [
                "series",
                "samples",
                "first 5 min median",
                "last 5 min median",
                "slope /h",
                "within-life slope /h",
                "range",
                "tolerance",
                "flat",
            ],
            rows,
        )
    )
    restarts = report.get("restarts", [])
    lines.append(
        f"\nRestarts: {len(restarts)} ("
        + ", ".join(
            f"{r['kind']} at {r['at_min']:.1f} min, watchers back {fmt_num(r.get('reassigned_s'), 0)} s"
            for r in restarts
        )
        + ")"
    )
    return "\n".join(lines)


# ==================================================================================================
# Driver
# ==================================================================================================
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--brokers", type=comma_words(BROKERS), default=list(BROKERS), help="kafka,sqs,pubsub,servicebus"
    )
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--minutes", type=float, default=30.0, help="publish window (default 30)")
    parser.add_argument("--rate", type=float, default=5.0, help="msgs/s per broker (default 5)")
    parser.add_argument("--watchers", type=int, default=3, help="watchers per stream (default 3)")
    parser.add_argument("--restart-every", type=float, default=300.0, help="mean s between restarts; 0 = none")
    parser.add_argument("--seed", type=int, default=15, help="restart timing RNG seed")
    parser.add_argument("--warmup", type=float, default=90.0, help="s dropped at the start of each life (90)")
    parser.add_argument("--sample-interval", type=float, default=10.0, help="s between samples (default 10)")
    parser.add_argument("--poll", type=float, default=5.0, help="s between metadata DB reads (default 5)")
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="wait for the last messages (300 s)")
    parser.add_argument("--keep-home", action="store_true", help="keep the work dir (AIRFLOW_HOME, logs)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/soak-<date>-<brokers>.json")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--render", type=Path, default=None, help="print a result file's tables again")
    return parser.parse_args(argv)


def progress_line(
    started: float, sampler: Sampler, probe: Path, log: EventLog, publishers: dict[str, Publisher]
) -> str:
    sample = sampler.samples[-1] if sampler.samples else None
    lines = read_probe(probe)
    tasks = lines[-1]["tasks"] if lines else "-"
    parts = [f"{(time.time() - started) / 60:5.1f} min", f"life {sampler.lives[-1].index if sampler.lives else '-'}"]
    if sample is not None:
        parts.append(
            f"RSS sup {sample.rss_supervisor_mb:.0f} / runner {fmt_num(sample.rss_runner_mb, 0)} MB, "
            f"fds {sample.fds_supervisor} / {sample.fds_runner}"
        )
    parts.append(f"tasks {tasks}")
    for broker, pub in publishers.items():
        covered = [len(seqs) for (phase, _), seqs in log.seen.items() if phase == broker]
        parts.append(f"{broker} {pub.attempted}/{min(covered) if covered else 0}")
    return ", ".join(parts)


def all_delivered(log: EventLog, brokers: Sequence[str], watchers: int, publishers: dict[str, Publisher]) -> bool:
    for broker in brokers:
        pub = publishers[broker]
        needed = pub.next_seq - len(pub.uncertain)
        for i in range(watchers):
            if len(log.seen.get((broker, f"soak_{broker}_{i}"), set())) < needed:
                return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        print(render_tables(json.loads(args.render.read_text())))
        return 0
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, exit_on_signal)
    import logging

    for name in ("azure", "aiokafka", "botocore", "google"):
        logging.getLogger(name).setLevel(logging.WARNING)

    started_at = datetime.now().isoformat(timespec="seconds")
    tag = uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    probe_path = work / "probe.jsonl"
    brokers: dict[str, BenchBroker] = {}
    streams: dict[str, BenchStream] = {}
    publishers: dict[str, Publisher] = {}
    stop_publishing = threading.Event()
    sampler = Sampler(args.sample_interval)
    restarts: list[dict[str, Any]] = []
    pg: PostgresServer | None = None
    env: BenchAirflowEnv | None = None
    log: EventLog | None = None
    report: dict[str, Any] = {
        "started_at": started_at,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "db": args.db,
        "status": "ok",
        "method": {
            "warmup_s": args.warmup,
            "window_s": WINDOW_S,
            "tolerance": "RSS max(10 MB, 5%), fds and tasks max(3, 10%) of the first-5-min median",
            "flat": "|last - first| <= tol and |within-life slope x median post-warm-up life| <= tol",
        },
    }
    exit_code = 0
    run_started = time.time()
    try:
        for name in args.brokers:
            broker = BROKER_CLASSES[name]()
            brokers[name] = broker
            report.setdefault("brokers", {})[name] = broker.start()
            streams[name] = broker.stream(f"soak-{tag}")
            print(f"== {report['brokers'][name]}", flush=True)
        trigger_specs = {name: stream.trigger("ours") for name, stream in streams.items()}
        report["triggers"] = trigger_specs
        write_dag(work / "dags", trigger_specs, args.watchers, probe_path, args.sample_interval)
        connections: dict[str, Any] = {}
        extra_env: dict[str, str] = {}
        for stream in streams.values():
            connections.update(stream.connections("ours"))
            extra_env.update(stream.env())
        if args.db == "postgres":
            pg = PostgresServer(settings={})
            pg.start()
        env = BenchAirflowEnv(
            work / "dags",
            connections=connections,
            env=extra_env,
            python_path=(work / "dags", PROBE_DIR),
            config={"core": {"dags_are_paused_at_creation": False}},
            home=work / "airflow-home",
            api_server=False,
            run=("dag-processor", "triggerer"),
            sql_alchemy_conn=pg.url if pg is not None else None,
            startup_timeout=300,
        )
        env.start()
        sampler.new_life(env.components["triggerer"].pid)
        sampler.start()
        names = watcher_names(args.brokers, args.watchers)
        env.wait_for_watchers(names, timeout=300)
        sampler.lives[-1].watchers_assigned_s = round(time.time() - sampler.lives[-1].started, 1)
        print(f"   {len(names)} watchers assigned ({assigned_watchers(env)} rows), publishing", flush=True)
        log = EventLog(env)
        for name, stream in streams.items():
            publishers[name] = Publisher(name, stream, args.rate, stop_publishing)
        publish_started = time.time()
        report["publish_started"] = publish_started
        for publisher in publishers.values():
            publisher.start()
        publish_end = publish_started + args.minutes * 60
        rng = random.Random(args.seed)
        kinds = ("graceful", "kill -9")

        def next_restart(after: float) -> float:
            return after + args.restart_every * rng.uniform(0.7, 1.3) if args.restart_every > 0 else float("inf")

        restart_at = next_restart(publish_started)
        last_poll = last_print = 0.0
        while time.time() < publish_end:
            env.check_alive()
            now = time.time()
            if now - last_poll >= args.poll:
                log.poll()
                last_poll = now
            if now - last_print >= 60:
                print("  " + progress_line(publish_started, sampler, probe_path, log, publishers), flush=True)
                last_print = now
            if now >= restart_at and now < publish_end - 2 * args.warmup:
                kind = kinds[len(restarts) % 2]
                sampler.end_life(kind)
                began = time.time()
                previous = env.restart_triggerer(kill=kind == "kill -9")
                life = sampler.new_life(env.components["triggerer"].pid)
                stopped_s = round(life.started - began, 1)
                env.wait_for_watchers(names, newer_than_job=previous, timeout=300)
                life.watchers_assigned_s = round(time.time() - life.started, 1)
                restarts.append(
                    {
                        "kind": kind,
                        "at": began,
                        "at_min": round((began - publish_started) / 60, 2),
                        "stop_s": stopped_s,
                        "reassigned_s": life.watchers_assigned_s,
                    }
                )
                print(
                    f"  restart {len(restarts)}: {kind} at {restarts[-1]['at_min']:.1f} min "
                    f"(stop {stopped_s} s, watchers back after {life.watchers_assigned_s} s)",
                    flush=True,
                )
                restart_at = next_restart(time.time())
            time.sleep(0.5)
        stop_publishing.set()
        for publisher in publishers.values():
            publisher.join(timeout=60)
        report["publish_s"] = round(time.time() - publish_started, 1)
        print("   publishing stopped; draining", flush=True)
        drain_started = time.time()
        while time.time() - drain_started < args.drain_timeout:
            env.check_alive()
            log.poll()
            if all_delivered(log, args.brokers, args.watchers, publishers):
                break
            time.sleep(args.poll)
        report["drain_s"] = round(time.time() - drain_started, 1)
        time.sleep(10)  # late redeliveries land within a sync or two
        log.poll()
        log.verify_complete_read()
    except Exception as exc:
        report["status"] = "error"
        report["error"] = f"{type(exc).__name__}: {exc}"[:6000]
        print(f"ERROR {report['error'][:2000]}", flush=True)
        if env is not None:
            report["log_tails"] = env.log_tails(40)[-8000:]
        exit_code = 1
    finally:
        run_end = time.time()
        stop_publishing.set()
        sampler.end_life("end of run")
        sampler.stop()
        for publisher in publishers.values():
            publisher.join(timeout=30)
        if env is not None:
            env.keep_home = args.keep_home
            env.stop()
        if pg is not None:
            pg.stop()
        for broker in brokers.values():
            with contextlib.suppress(Exception):
                broker.stop()
        probe = read_probe(probe_path)
        runner_pids = {pid for life in sampler.lives for pid in life.runner_pids}
        report.update(
            {
                "wall_s": round(run_end - run_started, 1),
                "machine": machine_info(),
                "source": source_state("airflow_shared_stream_provider", "devkit", "bench"),
                "restarts": restarts,
                "lives": [
                    {
                        "index": life.index,
                        "started": life.started,
                        "ended": life.ended,
                        "ended_by": life.ended_by,
                        "seconds": round((life.ended or run_end) - life.started, 1),
                        "watchers_assigned_s": life.watchers_assigned_s,
                        "supervisor_pid": life.supervisor_pid,
                        "runner_pids": sorted(life.runner_pids),
                        "processes": {str(k): v for k, v in life.process_names.items()},
                    }
                    for life in sampler.lives
                ],
                "probe_lines": len(probe),
                "probe_in_runner": bool(probe) and all(int(line["pid"]) in runner_pids for line in probe),
                "probe_pids": sorted({int(line["pid"]) for line in probe}),
                "samples": [as_json(s) for s in sampler.samples],
                "probe": probe,
            }
        )
        report["machine"]["versions"].update(_versions())
        if log is not None and publishers:
            report["brokers_result"] = broker_results(log, args.brokers, args.watchers, publishers)
            report["db_read_s"] = round(log.read_s, 2)
            for result in report["brokers_result"].values():
                result["lost_near"] = lost_near_restart(result, restarts, args.rate)
        points = series_points(sampler.samples, probe, sampler.lives)
        end_of_data = report.get("publish_started", run_started) + report.get("publish_s", 0) + report.get("drain_s", 0)
        report["analysis"] = analyse(points, sampler.lives, args.warmup, min(run_end, end_of_data + 10))
        lost = sum(r["lost"] for r in report.get("brokers_result", {}).values())
        not_flat = [name for name in SERIES if not (report["analysis"].get(name) or {}).get("flat")]
        report["verdict"] = {"lost": lost, "not_flat": not_flat, "probe_in_runner": report["probe_in_runner"]}
        print()
        print(render_tables(report))
        if lost:
            print(f"\n!!!!! LOST {lost} message deliveries: see brokers_result.*.watchers !!!!!", flush=True)
            for broker, result in report["brokers_result"].items():
                for line in result.get("lost_near", [])[:20]:
                    print(f"  {broker}: {line}", flush=True)
            exit_code = 1
        elif not_flat and exit_code == 0:
            print(f"\nNOT FLAT: {', '.join(not_flat)}", flush=True)
            exit_code = 3
        if not report["probe_in_runner"]:
            print("\nwarning: the probe's pid is not among the sampled runner pids", flush=True)
        if not args.no_write:
            out = args.out or RESULTS_DIR / f"soak-{datetime.now():%Y-%m-%d-%H%M}-{'-'.join(args.brokers)}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(as_json(report), indent=1, default=str) + "\n")
            print(f"\nwrote {out}")
        if not args.keep_home:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir kept: {work}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
