"""Sinks and their commit protocols: one module per kind of sink."""

from __future__ import annotations
