"""The tools around the operations: jobs, generate, demo and the local servers (spark-server,
spark-cluster, s3-server)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from onceflow import ops
from onceflow.cli._present import add_json, emit
from onceflow.ops import EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    found = ops.jobs()
    if args.json:
        emit(found)
        return EXIT_OK
    print(f"jobs from {found.origin}:")
    for job in found.jobs:
        sinks = ", ".join(f"{name} ({text})" for name, text in job.sinks)
        print(f"  {job.name}: {job.source} → {sinks} [{job.guarantee}]")
    return 0


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
        emit(out)
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


def add_jobs(sub: Any) -> None:
    jobs = sub.add_parser("jobs", help="list the jobs onceflow finds")
    add_json(jobs)
    jobs.set_defaults(func=cmd_jobs)


def add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="write synthetic input into the landing folder")
    gen.add_argument("job")
    gen.add_argument("--records", type=int, required=True)
    gen.add_argument("--files", type=int, required=True)
    gen.add_argument("--duplicate-rate", type=float, default=0.0)
    gen.add_argument("--invalid-rate", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    add_json(gen)
    gen.set_defaults(func=cmd_generate)


def add_spark_server(sub: Any) -> None:
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


def add_spark_cluster(sub: Any) -> None:
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


def add_s3_server(sub: Any) -> None:
    s3s = sub.add_parser(
        "s3-server", help="run a local S3-compatible store for a lake on object storage (tests)"
    )
    s3s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s3s.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    s3s.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    s3s.set_defaults(func=cmd_s3_server)


def add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="generate, crash mid-commit, recover, validate")
    demo.add_argument("--records", type=int, default=20000)
    demo.add_argument("--files", type=int, default=8)
    demo.set_defaults(func=cmd_demo)
