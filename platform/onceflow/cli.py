"""The `onceflow` command line: it presents the operations of `onceflow.ops` (run, backfill,
restate, recover, skip, reconcile, validate, status) and the tools (jobs, generate, demo, servers).

`--json` prints one JSON object on stdout (logs and progress stay on stderr); the exit codes are
`onceflow.ops`' (EXIT_*), documented in the README."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onceflow import ConfigurationError, OnceflowError, ops
from onceflow.ops import (
    EXIT_CHECKS_FAILED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    Progress,
    format_report,
    format_windows,
    parse_windows,
    redact,
)

_log = logging.getLogger("onceflow")

# Where this process's Spark writes its log, once a session is started (for messages).
_spark_log: Path | None = None


def _engine(
    job_name: str, guarantee: str | None = None, *, spark: bool = True, check_input: bool = False
) -> Any:
    global _spark_log
    engine = ops.open_from_env(job_name, spark=spark, check_input=check_input, guarantee=guarantee)
    if spark:
        _spark_log = ops.spark_log(engine.settings)
    return engine


def _window_line(result: Any) -> str:
    stats = result.stats or {}
    if result.noop:
        return f"window {result.window_id}: already committed in every sink; nothing changed"
    sinks = ", ".join(
        f"{name}={'held' if s.already_committed else s.rows}" for name, s in result.sinks.items()
    )
    return (
        f"window {result.window_id}: {_units(result.offsets)}, "
        f"{stats.get('rows_in', 0)} records, {stats.get('kept', 0)} kept, "
        f"{stats.get('duplicates', 0)} duplicates, {stats.get('quarantined', 0)} quarantined; "
        f"{sinks} ({result.latency_s:.2f}s)"
    )


def _windows_ahead(engine: Any, max_units: int | None) -> int | None:
    """Windows a run will process (pending plus new), for the progress display; None if the
    source cannot say cheaply."""
    try:
        work = ops.pending_work(engine)
    except Exception:  # the run itself reports what is wrong
        return None
    size = max_units or ops.DEFAULT_MAX_UNITS_PER_WINDOW
    return len(work.pending_windows) + -(-work.unplanned // size)


def _units(offsets: dict[str, Any]) -> str:
    if "files" in offsets:
        return f"{len(offsets['files'])} file(s)"
    if "start" in offsets and "end" in offsets:
        return f"versions {offsets['start']}-{offsets['end']}"
    return "input"


def _emit(result: Any) -> None:
    """The result as one JSON object on stdout."""
    print(json.dumps(result.as_json(), indent=2, default=str))


def _echo_to(args: argparse.Namespace) -> Any:
    """Where a command's lines go: stdout, or stderr when stdout carries the JSON result."""
    return sys.stderr if getattr(args, "json", False) else None


def cmd_run(args: argparse.Namespace) -> int:
    engine = _engine(args.job, args.guarantee, check_input=True)
    stop = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        print("onceflow: stopping after the current window", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    if args.follow:
        signal.signal(signal.SIGINT, on_term)
    progress = Progress(f"run {args.job}")
    if progress.enabled and not args.follow:  # the estimate costs a listing: only to draw it
        progress.total = _windows_ahead(engine, args.max_files_per_window)
    with progress:

        def on_window(window: Any) -> None:
            progress.advance(1, int((window.stats or {}).get("rows_in", 0)))
            progress.echo(_window_line(window), _echo_to(args))

        result = ops.run(
            engine,
            run_id=args.run_id,
            max_units_per_window=args.max_files_per_window,
            follow=args.follow,
            poll_interval_s=args.poll_interval,
            stop=stop,
            on_window=on_window,
        )
    if args.json:
        _emit(result)
    else:
        print(f"run {result.run_id} (epoch {result.epoch}): {len(result.windows)} window(s)")
    return EXIT_OK


def cmd_backfill(args: argparse.Namespace) -> int:
    engine = _engine(args.job)
    result = ops.backfill(engine, parse_windows(args.windows), run_id=args.run_id)
    if args.json:
        _emit(result)
        return EXIT_OK
    for wid in result.noop_windows:
        print(f"window {wid}: already committed in every sink; nothing changed")
    for note in result.notes:
        print(note)
    for window in result.committed:
        sinks = ", ".join(f"{s.sink}={s.rows}" for s in window.sinks if s.committed)
        print(f"window {window.window_id}: backfilled ({sinks})")
    return EXIT_OK


def cmd_recover(args: argparse.Namespace) -> int:
    engine = _engine(args.job)
    with Progress(f"recover {args.job}", unit="steps") as progress:
        result = ops.recover(
            engine,
            run_id=args.run_id,
            verify_last=args.verify_last,
            reconcile=args.reconcile,
            dry_run=args.dry_run,
            on_step=progress.phase,
        )
    code = EXIT_OK if result.ok else EXIT_CHECKS_FAILED
    if args.json:
        _emit(result)
        return code
    for sink, ids in result.restored.items():
        print(f"{sink} had lost committed windows {format_windows(ids)}; replayed")
    replayed = [w.window_id for w in result.replayed if not w.noop]
    print(
        f"recover {result.run_id}: {len(replayed)} window(s) replayed "
        f"({format_windows(replayed) or 'none'}); {len(result.verified)} verified, "
        f"{len(result.incomplete)} incomplete"
    )
    for wid, sinks in result.incomplete.items():
        print(f"window {wid}: not held by {', '.join(sinks)}")
    if result.reconcile is not None:
        print(format_report(result.reconcile))
    return code


def cmd_status(args: argparse.Namespace) -> int:
    engine = _engine(args.job, spark=False)
    result = ops.status(engine)
    if args.json:
        _emit(result)
    else:
        print(ops.format_status(result.status))
    return EXIT_OK


def cmd_reconcile(args: argparse.Namespace) -> int:
    engine = _engine(args.job)
    with Progress(f"reconcile {args.job}", total=len(engine.job.sinks), unit="sinks") as progress:

        def on_step(text: str) -> None:
            if text.startswith("comparing") and progress.current.startswith("comparing"):
                progress.advance()
            progress.phase(text)

        report = ops.reconcile(
            engine,
            dry_run=args.dry_run,
            mode="incremental" if args.incremental else "full",
            on_step=on_step,
        )
    if args.json:
        print(json.dumps(report.as_json(), indent=2, default=str))
    else:
        print(format_report(report))
    return 0


def cmd_restate(args: argparse.Namespace) -> int:
    if args.cancel is not None:
        return _cancel_restatement(args)
    if args.windows is None and not args.source_replaced:
        raise ConfigurationError("name the windows to restate (--windows 3-7).")
    ids = parse_windows(args.windows) if args.windows is not None else []
    engine = _engine(args.job)
    done = ops.restate(
        engine,
        ids,
        run_id=args.run_id,
        request_id=args.request_id,
        source_replaced=args.source_replaced,
    )
    if args.json:
        _emit(done)
        return EXIT_OK
    if args.source_replaced and not done.windows:
        print("no window's input was replaced; nothing was restated")
    for result in done.windows:
        if result.noop:
            print(f"window {result.window_id}: this request already restated it; nothing changed")
            continue
        sinks = ", ".join(f"{s.sink}={s.rows}" for s in result.sinks)
        print(f"window {result.window_id}: restated in every sink ({sinks})")
    return EXIT_OK


def _cancel_restatement(args: argparse.Namespace) -> int:
    engine = _engine(args.job, spark=False)
    done = ops.cancel_restatement(engine, args.cancel, args.reason or "", run_id=args.run_id)
    if args.json:
        _emit(done)
        return EXIT_OK
    for item in done.cancelled:
        print(
            f"window {item.window_id}: restatement cancelled (seq {item.seq}, request "
            f"{done.request}): {item.cancelled}"
        )
    for item in done.finished:
        print(f"window {item.window_id}: already restated in every sink; it stays so")
    print(
        f"The cancelled windows keep the rows they have; `onceflow run {args.job}` goes on "
        "without them, and `onceflow status` lists them."
    )
    return 0


def cmd_windows_skip(args: argparse.Namespace) -> int:
    engine = _engine(args.job, spark=False)
    skipped = ops.skip(engine, parse_windows(args.windows), args.reason, run_id=args.run_id)
    if args.json:
        _emit(skipped)
        return EXIT_OK
    print(
        f"windows {format_windows(list(skipped.windows))} of {args.job} skipped: "
        f"{skipped.reason}. They stay listed in `onceflow status` and reconcile reports; "
        "their input stays taken."
    )
    return 0


def cmd_windows_recompute(args: argparse.Namespace) -> int:
    engine = _engine(args.job, spark=False)
    done = ops.recompute(engine, parse_windows(args.windows), run_id=args.run_id)
    if args.json:
        _emit(done)
        return EXIT_OK
    if done.deterministic:
        print(
            f"job {args.job} is deterministic: it keeps no stage, and its pending windows "
            f"{args.windows} are computed with its current code by `onceflow run {args.job}`."
        )
        return 0
    print(
        f"windows {format_windows(list(done.windows))} of {args.job}: the outputs staged by an earlier "
        f"run dropped; `onceflow run {args.job}` computes them again with the job's current "
        "code, from the same input."
    )
    if done.later:
        print(
            f"windows {format_windows(list(done.later))} are computed again with them (their dedupe "
            "looked up the keys of those windows)."
        )
    return 0


def cmd_windows_abandon(args: argparse.Namespace) -> int:
    engine = _engine(args.job, spark=False)
    done = ops.abandon(engine, parse_windows(args.windows), args.reason, run_id=args.run_id)
    if args.json:
        _emit(done)
        return EXIT_OK
    if not done.windows:
        print(f"windows {args.windows} of {args.job} were abandoned before; nothing changed.")
    for wid, sinks in done.windows.items():
        print(
            f"window {wid} of {args.job} abandoned for {', '.join(sinks)}: {args.reason.strip()}."
            " A known gap: `onceflow status`, reconcile, validate and the asset metadata name it."
        )
    for sink, ids in done.lacking.items():
        print(
            f"{sink} still lacks windows {format_windows(list(ids))}: run `onceflow reconcile "
            f"{args.job}` to replay them."
        )
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    found = ops.jobs()
    if args.json:
        _emit(found)
        return EXIT_OK
    print(f"jobs from {found.origin}:")
    for job in found.jobs:
        sinks = ", ".join(f"{name} ({text})" for name, text in job.sinks)
        print(f"  {job.name}: {job.source} → {sinks} [{job.guarantee}]")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    engine = _engine(args.job)
    with Progress(f"validate {args.job}", unit="sinks") as progress:
        progress.phase(f"checking {', '.join(s.name for s in engine.job.sinks)}")
        done = ops.validate(engine)
    report = done.report
    if args.json:
        _emit(done)
        return EXIT_OK if report.passed else EXIT_CHECKS_FAILED
    for result in report.results:
        mark = "ok  " if result.passed else "FAIL"
        print(f"{mark} {result.sink}: {result.check} {result.observed}")
    if report.data_docs:
        print(f"data docs: {report.data_docs}")
    return 0 if report.passed else EXIT_CHECKS_FAILED


def cmd_generate(args: argparse.Namespace) -> int:
    out = ops.generate(
        args.job,
        records=args.records,
        files=args.files,
        duplicate_rate=args.duplicate_rate,
        invalid_rate=args.invalid_rate,
        seed=args.seed,
    )
    if args.json:
        _emit(out)
        return EXIT_OK
    print(
        f"wrote {out.files} file(s) to {out.folder}: {out.payments} "
        f"payments, {out.duplicates} duplicates, {out.invalid} invalid lines"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return ops.demo(records=args.records, files=args.files)


def cmd_spark_server(args: argparse.Namespace) -> int:
    master = args.master or os.environ.get("ONCEFLOW_SPARK_MASTER") or "local[2]"
    ops.serve_spark_connect(args.host, args.port, master, args.conf)
    return 0  # serve() replaces the process


def cmd_spark_cluster(args: argparse.Namespace) -> int:
    cluster = ops.spark_cluster(
        Path(args.work_dir).absolute(),
        host=args.host,
        port=args.port,
        ui_port=args.ui_port,
        workers=args.workers,
        cores=args.cores,
        memory=args.memory,
    )
    config = cluster.config
    ended = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: ended.set())
    with cluster:
        print(
            f"onceflow spark-cluster: master {config.url} with {config.workers} worker(s) of "
            f"{config.cores} core(s) and {config.memory}; runs use it with "
            f"ONCEFLOW_SPARK_MASTER={config.url}",
            file=sys.stderr,
            flush=True,
        )
        ended.wait()
    return 0


def cmd_s3_server(args: argparse.Namespace) -> int:
    ended = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: ended.set())
    with ops.s3_server(args.host, args.port) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        # Every setting a run needs but the secret key, which is never printed (it is the
        # local server's fixed key: LOCAL_SECRET_KEY, shown in docs/scale.md).
        settings = " ".join(
            f"{k}={v}" for k, v in server.env().items() if k != "AWS_SECRET_ACCESS_KEY"
        )
        print(
            f"onceflow s3-server: a local S3-compatible store on {server.endpoint} (in memory, "
            f"gone when it stops), bucket(s) {', '.join(args.bucket) or 'none'}; runs use it "
            f"with {settings}, AWS_SECRET_ACCESS_KEY set to the local server's key "
            "(docs/scale.md) and ONCEFLOW_LAKE=s3://<bucket>/lake",
            file=sys.stderr,
            flush=True,
        )
        ended.wait()
    return 0


def _add_run_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-id",
        default=None,
        help="name this request: run again with the same id, it is the same request (a retry "
        "commits or restates nothing twice)",
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout"
    )


def cmd_maintain(args: argparse.Namespace) -> int:
    result = ops.maintain(
        _engine(args.job, spark=False),
        dry_run=args.dry_run,
        orphan_age_s=args.orphan_age_s,
        run_id=args.run_id,
    )
    if args.json:
        _emit(result)
    else:
        print("\n".join(result.lines()))
    return EXIT_OK


def _add_maintain(sub: Any) -> None:
    mnt = sub.add_parser(
        "maintain",
        help="compact, checkpoint, vacuum the job's Delta sinks past what readers still need",
    )
    mnt.add_argument("job")
    mnt.add_argument("--dry-run", action="store_true", help="report; change nothing")
    mnt.add_argument(
        "--orphan-age-s",
        type=float,
        default=None,
        help="remove files no commit names once older than this (default 3600), under a fence",
    )
    _add_run_id(mnt)
    _add_json(mnt)
    mnt.set_defaults(func=cmd_maintain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onceflow", description="Exactly-once Spark jobs into Delta Lake and PostgreSQL."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="process everything visible, commit it to every sink")
    run.add_argument("job")
    run.add_argument(
        "--max-files-per-window",
        type=int,
        default=None,
        help="most files (or, for a Delta table source, table versions) a new window takes",
    )
    run.add_argument(
        "--follow", action="store_true", help="keep committing new files until SIGTERM"
    )
    run.add_argument("--poll-interval", type=float, default=1.0)
    run.add_argument("--guarantee", choices=["exactly_once", "at_least_once", "none"], default=None)
    _add_run_id(run)
    _add_json(run)
    run.set_defaults(func=cmd_run)

    bf = sub.add_parser("backfill", help="bring chosen past windows into every sink")
    bf.add_argument("job")
    bf.add_argument("--windows", required=True, help="window ids, e.g. 3-7 or 3,5,9-10")
    _add_run_id(bf)
    _add_json(bf)
    bf.set_defaults(func=cmd_backfill)

    rcv = sub.add_parser(
        "recover",
        help="put back lost windows, replay pending ones, verify every sink, reconcile",
    )
    rcv.add_argument("job")
    rcv.add_argument(
        "--verify-last",
        type=int,
        default=ops.VERIFY_LAST,
        help=f"verify the last N windows (0: every window; default {ops.VERIFY_LAST})",
    )
    rcv.add_argument("--reconcile", choices=["incremental", "full", "off"], default="incremental")
    rcv.add_argument("--dry-run", action="store_true", help="reconcile reports, repairs nothing")
    _add_run_id(rcv)
    _add_json(rcv)
    rcv.set_defaults(func=cmd_recover)

    status = sub.add_parser("status", help="windows, offsets, per-sink commit state, lag")
    status.add_argument("job")
    _add_json(status)
    status.set_defaults(func=cmd_status)
    _add_maintain(sub)

    rec = sub.add_parser("reconcile", help="diff every sink against the expected state, repair")
    rec.add_argument("job")
    rec.add_argument("--dry-run", action="store_true")
    rec.add_argument("--incremental", action="store_true")
    _add_json(rec)
    rec.set_defaults(func=cmd_reconcile)

    res = sub.add_parser("restate", help="replace chosen windows' effect in every sink")
    res.add_argument("job")
    res.add_argument("--windows", default=None, help="window ids, e.g. 3-7 or 3,5,9-10")
    res.add_argument(
        "--source-replaced",
        action="store_true",
        help="the source's input was replaced (an upstream Delta table recreated or restored): "
        "restate every window (of --windows, default all) whose input changed, from the input "
        "as it is now",
    )
    res.add_argument(
        "--cancel",
        metavar="REQUEST",
        default=None,
        help="give up the unfinished restatements of REQUEST (as `onceflow status` lists it)",
    )
    res.add_argument(
        "--request-id",
        default=None,
        help="name the request so that running it again restates each window once",
    )
    res.add_argument("--reason", default=None, help="with --cancel: why; shown in status")
    _add_run_id(res)
    _add_json(res)
    res.set_defaults(func=cmd_restate)

    win = sub.add_parser("windows", help="operator actions on a job's windows")
    win_sub = win.add_subparsers(dest="action", required=True)
    skip = win_sub.add_parser(
        "skip",
        help="give up pending windows whose input is gone or changed (recorded with a reason)",
    )
    skip.add_argument("job")
    skip.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    skip.add_argument("--reason", required=True, help="why; shown in status and reconcile")
    _add_run_id(skip)
    _add_json(skip)
    skip.set_defaults(func=cmd_windows_skip)
    recompute = win_sub.add_parser(
        "recompute",
        help="compute pending windows no sink holds again with the job's current code",
    )
    recompute.add_argument("job")
    recompute.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    _add_run_id(recompute)
    _add_json(recompute)
    recompute.set_defaults(func=cmd_windows_recompute)
    abandon = win_sub.add_parser(
        "abandon",
        help="give up completed windows a sink lacks and whose input is gone (a recorded gap)",
    )
    abandon.add_argument("job")
    abandon.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    abandon.add_argument(
        "--reason", required=True, help="why; shown in status, reconcile and validate"
    )
    _add_run_id(abandon)
    _add_json(abandon)
    abandon.set_defaults(func=cmd_windows_abandon)

    jobs = sub.add_parser("jobs", help="list the jobs onceflow finds")
    _add_json(jobs)
    jobs.set_defaults(func=cmd_jobs)

    val = sub.add_parser("validate", help="run the Great Expectations suites")
    val.add_argument("job")
    _add_json(val)
    val.set_defaults(func=cmd_validate)

    gen = sub.add_parser("generate", help="write synthetic input into the landing folder")
    gen.add_argument("job")
    gen.add_argument("--records", type=int, required=True)
    gen.add_argument("--files", type=int, required=True)
    gen.add_argument("--duplicate-rate", type=float, default=0.0)
    gen.add_argument("--invalid-rate", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    _add_json(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser(
        "spark-server",
        help="run a long-lived Spark Connect server that runs attach to (ONCEFLOW_SPARK_REMOTE)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=15002, help="gRPC port (default 15002)")
    srv.add_argument(
        "--master", default=None, help="spark.master (default ONCEFLOW_SPARK_MASTER or local[2])"
    )
    srv.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting"
    )
    srv.set_defaults(func=cmd_spark_server)

    clu = sub.add_parser(
        "spark-cluster",
        help="run a Spark standalone master and workers that runs use (ONCEFLOW_SPARK_MASTER)",
    )
    clu.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    clu.add_argument("--port", type=int, default=7077, help="master port (default 7077)")
    clu.add_argument("--ui-port", type=int, default=8080, help="master web UI (default 8080)")
    clu.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    clu.add_argument("--cores", type=int, default=1, help="cores per worker (default 1)")
    clu.add_argument("--memory", default="1g", help="memory per worker (default 1g)")
    clu.add_argument(
        "--work-dir", default="spark-cluster", help="workers' folders and logs (./spark-cluster)"
    )
    clu.set_defaults(func=cmd_spark_cluster)

    s3s = sub.add_parser(
        "s3-server", help="run a local S3-compatible store for a lake on object storage (tests)"
    )
    s3s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s3s.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    s3s.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    s3s.set_defaults(func=cmd_s3_server)

    demo = sub.add_parser("demo", help="generate, crash mid-commit, recover, validate")
    demo.add_argument("--records", type=int, default=20000)
    demo.add_argument("--files", type=int, default=8)
    demo.set_defaults(func=cmd_demo)
    return parser


def _exit_on(signum: int, frame: Any) -> None:
    # Leave through the normal exit path, which stops the embedded server this process started.
    raise SystemExit(128 + signum)


def _stdout_closed() -> bool:
    """Whether nothing reads our stdout any more (`onceflow status payments | head`)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _summary(exc: BaseException) -> str:
    """One line saying what failed. A job's Python code failing on an executor (Spark's
    `PythonException`, whose first line says only that) is told by the error's type and the
    job's frame it was raised in; its text, which may quote values, is left to Spark's log."""
    import re

    text = str(exc).strip()
    if type(exc).__name__ != "PythonException":
        return text.splitlines()[0] if text else ""
    kinds = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))\b", text, re.M)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    where = f" at {Path(frames[-1][0]).name}, line {frames[-1][1]}, in {frames[-1][2]}"
    return f"the job's code raised {kinds[-1] if kinds else 'an error'} on an executor" + (
        where if frames else ""
    )


def _traceback(exc: BaseException) -> str:
    """The whole traceback, with the errors behind `exc` even where a message left them out
    (`raise … from None`); credentials removed, and PostgreSQL's messages (which may quote a
    row's values) reduced to their SQLSTATE and identifiers."""
    import traceback

    import psycopg

    from onceflow.ops import refusal_details

    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            frames = "".join(traceback.format_tb(current.__traceback__))
            parts.append(
                f"Traceback (most recent call last):\n{frames}{type(current).__module__}."
                f"{type(current).__qualname__}: SQLSTATE {current.sqlstate} "
                f"({refusal_details(current) or 'no identifiers'}; its text is left out: it "
                "may quote a row's values)\n"
            )
        else:
            parts.append("".join(traceback.format_exception(current, chain=False)))
        current = current.__cause__ or current.__context__
    between = "\nDuring handling of the above exception, another exception occurred:\n\n"
    return redact(between.join(reversed(parts)))


def _emit_failure(args: argparse.Namespace, exc: BaseException, code: int, message: str) -> None:
    """With --json, the failure as the one JSON object on stdout (its message also on stderr)."""
    if not getattr(args, "json", False):
        return
    failure = {
        "operation": args.command,
        "ok": False,
        "error": type(exc).__name__,
        "message": message,
        "retryable": code == ops.EXIT_RETRYABLE,
        "needs_recovery": code == ops.EXIT_NEEDS_RECOVERY,
        "exit_code": code,
    }
    try:
        print(json.dumps(failure, indent=2))
        sys.stdout.flush()
    except OSError:  # nobody reads stdout any more; stderr has said it
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `onceflow` console script."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("py4j", "pyspark", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)
    debug = ops.debug_enabled()
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except OnceflowError as exc:
        if debug:
            print(_traceback(exc), file=sys.stderr)
        code = ops.exit_code(exc)
        if code == ops.EXIT_FENCED:
            print(f"onceflow: {redact(exc.message)}", file=sys.stderr)
        else:
            log = (
                f" Spark's log: {_spark_log}."
                if _spark_log is not None and not isinstance(exc, ConfigurationError)
                else ""
            )
            print(f"onceflow: {args.command} failed: {redact(exc.message)}{log}", file=sys.stderr)
        _emit_failure(args, exc, code, redact(exc.message))
        return code
    except KeyboardInterrupt:
        print("onceflow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            # Whoever read our output has stopped (`| head`): end quietly, as a shell tool
            # does; what is still buffered goes nowhere rather than fail at the exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE_CLOSED
        if debug:
            print(_traceback(exc), file=sys.stderr)
        log = f" Spark's log: {_spark_log}." if _spark_log is not None else ""
        summary = redact(_summary(exc))[:500]
        print(
            f"onceflow: {args.command} failed with an unexpected {type(exc).__name__}: "
            f"{summary}. Nothing is lost: committed windows stay committed "
            f"and the next run replays the rest.{log}"
            + ("" if debug else " Set ONCEFLOW_DEBUG=1 for the whole traceback."),
            file=sys.stderr,
        )
        _emit_failure(args, exc, EXIT_FAILED, summary)
        return EXIT_FAILED
    finally:
        ops.release_embedded()


if __name__ == "__main__":
    sys.exit(main())
