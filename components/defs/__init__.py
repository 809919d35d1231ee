"""One folder per onceflow job (its `defs.yaml`), and the resources they share."""
