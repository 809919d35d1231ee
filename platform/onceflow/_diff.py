"""A multiset diff of two DataFrames on Spark: by key, or by whole row for keyless sinks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any

from onceflow._staging import spill
from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# Columns of a diff frame besides the match columns.
N_EXPECTED = "__ne"  # copies (keyless) or rows (keyed) the sink should hold
N_ACTUAL = "__na"  # copies or rows it holds
EXPECTED_VALUES = "__ev"  # keyed: struct of the expected non-key values


# How many differing keys (or windows, for a keyless sink) of each kind a report names.
SAMPLES_PER_KIND = 5


@dataclass(frozen=True)
class DiffSample:
    """One difference, by key only: never the values of other columns (rows may be sensitive).

    Attributes:
        kind: `missing` (expected, not held), `extra` (held, not expected) or `changed` (held
            with other values).
        key: The key's columns and values; empty for a keyless sink.
        rows: Rows (copies) this difference stands for: 1 for a key, the rows of a window for
            a keyless sink.
        expected_window: The window the expected row comes from, when the rows carry one.
        actual_window: The window the held row says it comes from, when the rows carry one.
    """

    kind: str
    key: tuple[tuple[str, Any], ...]
    rows: int = 1
    expected_window: int | None = None
    actual_window: int | None = None

    def describe(self) -> str:
        """`order_id=o2 (expected from window 1, held from window 3)`, `3 row(s) of window 2`."""
        if self.key:
            text = ", ".join(f"{c}={v}" for c, v in self.key)
            if self.rows > 1:
                text += f" ({self.rows} copies)"
        else:
            window = self.expected_window or self.actual_window
            where = f" of window {window}" if window is not None else ""
            return f"{self.rows} row(s){where}"
        windows = []
        if self.expected_window is not None:
            windows.append(f"expected from window {self.expected_window}")
        if self.actual_window is not None:
            windows.append(f"held from window {self.actual_window}")
        return text + (f" ({', '.join(windows)})" if windows else "")

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": {c: v if isinstance(v, (int, float, bool)) or v is None else str(v)
                    for c, v in self.key},
            "rows": self.rows,
            "expected_window": self.expected_window,
            "actual_window": self.actual_window,
        }  # fmt: skip


@dataclass(frozen=True)
class Diff:
    """A materialised diff: one row per match value whose expected and actual sides differ.

    Repair from it: delete every actual row matching a row with `__na > 0`, insert the
    expected values of every row with `__ne > 0` (`__ne` copies).
    """

    frame: DataFrame
    match: list[str]
    values: list[str]
    missing: int
    extra: int
    changed: int

    @property
    def empty(self) -> bool:
        return self.missing == self.extra == self.changed == 0

    def samples(
        self,
        window_column: str | None = None,
        limit: int = SAMPLES_PER_KIND,
        *,
        keyed: bool = True,
    ) -> list[DiffSample]:
        """The first differences of each kind (at most `limit` each), by key: a keyed diff names
        each differing key; a keyless one (whose match columns are whole rows, values and all)
        names only the window of the rows it counts, by `window_column`, or nothing."""
        from pyspark.sql import functions as F

        if self.empty:
            return []
        ne, na = F.col(N_EXPECTED), F.col(N_ACTUAL)
        if keyed:
            kind = (
                F.when(F.col("__changed"), F.lit("changed"))
                .when((ne > 0) & (na == 0), F.lit("missing"))
                .when(na > ne, F.lit("extra"))
            )
            count = F.when(ne == 0, na).when(na > ne, na - ne).otherwise(F.lit(1))
            windows = [F.lit(None).cast("bigint"), F.lit(None).cast("bigint")]
            if window_column is not None and window_column in self.values:
                windows = [
                    F.col(EXPECTED_VALUES)[window_column].cast("bigint"),
                    F.col("__av")[window_column].cast("bigint"),
                ]
            rows = self.frame.select(
                kind.alias("kind"),
                count.alias("n"),
                *[F.col(c) for c in self.match],
                windows[0].alias("we"),
                windows[1].alias("wa"),
            ).where(F.col("kind").isNotNull())
            picked = rows.withColumn(
                "__i",
                F.row_number().over(_by_kind().orderBy(*[F.col(c) for c in self.match])),
            ).where(F.col("__i") <= limit)
            return [
                DiffSample(
                    r["kind"],
                    tuple((c, r[c]) for c in self.match),
                    int(r["n"]),
                    None if r["we"] is None or r["kind"] == "extra" else int(r["we"]),
                    None if r["wa"] is None or r["kind"] == "missing" else int(r["wa"]),
                )
                for r in picked.orderBy("kind", "__i").collect()
            ]
        window = (
            F.col(window_column).cast("bigint")
            if window_column is not None and window_column in self.match
            else F.lit(None).cast("bigint")
        )
        per_window = (
            self.frame.select(
                window.alias("w"),
                F.greatest(ne - na, F.lit(0)).alias("missing"),
                F.greatest(na - ne, F.lit(0)).alias("extra"),
            )
            .groupBy("w")
            .agg(F.sum("missing").alias("missing"), F.sum("extra").alias("extra"))
        )
        found = per_window.selectExpr(
            "w", "stack(2, 'missing', missing, 'extra', extra) AS (kind, n)"
        ).where(F.col("n") > 0)
        picked = found.withColumn(
            "__i", F.row_number().over(_by_kind().orderBy(F.col("w").asc_nulls_last()))
        ).where(F.col("__i") <= limit)
        return [
            DiffSample(
                r["kind"],
                (),
                int(r["n"]),
                int(r["w"]) if r["w"] is not None and r["kind"] == "missing" else None,
                int(r["w"]) if r["w"] is not None and r["kind"] == "extra" else None,
            )
            for r in picked.orderBy("kind", "__i").collect()
        ]

    def deletes(self) -> DataFrame:
        """The match columns of every group whose actual rows must go."""
        from pyspark.sql import functions as F

        return self.frame.where(F.col(N_ACTUAL) > 0).select(*self.match)

    def inserts(self) -> DataFrame:
        """The expected rows to insert, one per copy, with columns match + values."""
        from pyspark.sql import functions as F

        rows = self.frame.where(F.col(N_EXPECTED) > 0).withColumn(
            "__copy", F.explode(F.sequence(F.lit(1), F.col(N_EXPECTED).cast("int")))
        )
        values = [F.col(EXPECTED_VALUES)[c].alias(c) for c in self.values]
        return rows.select(*self.match, *values)


def _by_kind() -> Any:
    from pyspark.sql import Window

    return Window.partitionBy("kind")


def multiset_diff(
    expected: DataFrame,
    actual: DataFrame,
    columns: Sequence[str],
    key: Sequence[str],
    path: Location,
) -> Diff:
    """Compare `expected` with `actual` over `columns` and write the difference to `path`.

    Both sides must have `columns` with the same types. With a `key`, rows are matched by key
    and compared by value (nulls equal): a key only expected is missing, a key only actual is
    extra (every copy), a key on both sides with other values is changed, and surplus copies
    of a key are extra. Without a key, whole rows are counted as a multiset.

    Args:
        expected: The expected rows.
        actual: The rows the sink holds.
        columns: The columns to compare.
        key: The key columns, or empty for a whole-row comparison.
        path: Where to write the diff (Parquet).

    Returns:
        The diff with its counts; only the counts reach the driver.
    """
    from pyspark.sql import functions as F

    match = list(key) if key else list(columns)
    values = [c for c in columns if c not in match]

    def side(df: DataFrame, is_expected: bool) -> DataFrame:
        cols: list[Column | str] = list(match)
        if values:
            cols.append(F.struct(*values).alias("__v"))
        return df.select(
            *cols,
            F.lit(1 if is_expected else 0).alias("__e"),
            F.lit(0 if is_expected else 1).alias("__a"),
        )

    both = side(expected, True).unionByName(side(actual, False))
    aggs = [
        F.sum("__e").cast("bigint").alias(N_EXPECTED),
        F.sum("__a").cast("bigint").alias(N_ACTUAL),
    ]
    if values:
        aggs += [
            F.first(F.when(F.col("__e") == 1, F.col("__v")), ignorenulls=True).alias(
                EXPECTED_VALUES
            ),
            F.first(F.when(F.col("__a") == 1, F.col("__v")), ignorenulls=True).alias("__av"),
        ]
    grouped = both.groupBy(*match).agg(*aggs)
    ne, na = F.col(N_EXPECTED), F.col(N_ACTUAL)
    if values:
        same_values = reduce(
            lambda a, b: a & b,
            [F.col(EXPECTED_VALUES)[c].eqNullSafe(F.col("__av")[c]) for c in values],
        )
        differs = (ne > 0) & (na > 0) & ~same_values
        bad = (ne != 1) | (na != 1) | ~same_values
    else:
        differs = F.lit(False)
        bad = ne != na
    frame = grouped.where(bad).withColumn("__changed", differs)
    frame = spill(frame, path)
    ne, na = F.col(N_EXPECTED), F.col(N_ACTUAL)
    if key:
        missing = F.when((ne > 0) & (na == 0), ne).otherwise(0)
        extra = F.when(ne == 0, na).otherwise(F.greatest(na - ne, F.lit(0)))
    else:
        missing = F.greatest(ne - na, F.lit(0))
        extra = F.greatest(na - ne, F.lit(0))
    row = frame.agg(
        F.coalesce(F.sum(missing), F.lit(0)).alias("missing"),
        F.coalesce(F.sum(extra), F.lit(0)).alias("extra"),
        F.coalesce(F.sum(F.col("__changed").cast("bigint")), F.lit(0)).alias("changed"),
    ).first()
    assert row is not None
    return Diff(frame, match, values, int(row["missing"]), int(row["extra"]), int(row["changed"]))
