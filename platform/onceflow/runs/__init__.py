"""The job-level paths that drive windows through their stages (`onceflow.window`): a run, a
replay of what sinks lack, skipped windows, applied restatements and a backfill; each a
module with one entry point that `onceflow.engine.Engine` presents."""
