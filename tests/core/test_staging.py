"""A window's stage is reused only when it matches the offsets and the row counts it recorded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from onceflow._staging import WindowStage
from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.ledger import Window
from onceflow.registry import get_job
from onceflow.settings import Settings


def test_a_stage_that_lost_a_file_is_recomputed_not_reused(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=600, files=2, duplicate_rate=0.1, invalid_rate=0.1, seed=2)
    # A job that does not say its transform is deterministic has its outputs staged.
    job = replace(get_job("payments"), deterministic=False)
    engine = Engine(job, settings, spark, pg_dsn)
    engine.prepare()
    units = job.source.discover(settings, None)
    window = Window(job.name, 1, job.source.offsets(settings, units), epoch=1)

    stats = engine.outputs(window).stats
    stage = WindowStage(lake, job.name, 1, window.offsets)
    assert stats["outputs"]["payments"] > 0
    assert stage.intact(stats, ["payments", "quarantine", "balances"])

    # Same offsets: reused as it is.
    marker = Path(stage.root / "_COMPLETE.json")
    stamp = marker.stat().st_mtime_ns
    engine.outputs(window)
    assert marker.stat().st_mtime_ns == stamp

    # A data file of an output lost: the counts no longer match, so the window is computed again.
    next(Path(stage.path("payments")).glob("*.parquet")).unlink()
    assert not stage.intact(stats, ["payments"])
    out = engine.outputs(window)
    again = out.stats
    assert again == stats
    assert out.frames["payments"].count() == stats["outputs"]["payments"]
    assert stage.intact(again, ["payments", "quarantine", "balances"])

    # Other offsets for the same window id (a plan rebuilt over other input): another stage.
    other = Window(job.name, 1, job.source.offsets(settings, units[:1]), epoch=2)
    assert WindowStage(lake, job.name, 1, other.offsets).root != stage.root
    fewer = engine.outputs(other).stats
    assert fewer["rows_in"] < stats["rows_in"]


def test_a_computation_that_raised_leaves_no_stage(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    from pyspark.sql import functions as F

    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=300, files=1, duplicate_rate=0.1, invalid_rate=0.1, seed=3)
    good = replace(get_job("payments"), deterministic=False)

    def raising(valid, ctx):  # `payments`, staged after `balances`, fails on the executors
        out = good.transform(valid, ctx)
        payments = out["payments"]
        text = next(name for name, kind in payments.dtypes if kind == "string")
        boom = F.raise_error(F.lit("a bug in the job")).cast("string")
        return {"balances": out["balances"], "payments": payments.withColumn(text, boom)}

    engine = Engine(replace(good, transform=raising), settings, spark, pg_dsn)
    engine.prepare()
    units = good.source.discover(settings, None)
    window = Window(good.name, 1, good.source.offsets(settings, units), epoch=1)
    stage = WindowStage(lake, good.name, 1, window.offsets)
    try:
        engine.outputs(window)
    except Exception:
        pass
    else:
        raise AssertionError("the raising transform was staged")
    assert stage.complete() is None
    assert not stage.root.path.exists(), "a partial stage was left"

    # The code fixed: computed afresh, staged whole.
    stats = Engine(good, settings, spark, pg_dsn).outputs(window).stats
    assert stage.intact(stats, ["payments", "quarantine", "balances"])
