"""Workflow traces: the `Call` record, trace format v1 reading/writing (docs/trace-format.md), statistics."""

from pbkv.trace.call import Call, Trace, TraceMeta
from pbkv.trace.io import TraceError, read_trace, validate, write_trace

__all__ = ["Call", "Trace", "TraceMeta", "TraceError", "read_trace", "validate", "write_trace"]
