"""A window's way from plan to completed, one stage a module.

A window travels as one object: planned (`plan`), its outputs computed (`compute`), written to
every sink's staging with its staged keys, its stage and basis (`prepare`), committed to every
sink (`commit`), then marked completed with its keys indexed (`complete`). `pipeline` runs a
sequence of windows, preparing each while the one before it commits. The job-level paths that
drive windows (run, replay, skip, restate, backfill) are in `onceflow.runs`.
"""
