"""Workflow traces: the `Call` record, trace format v1 reading/writing (docs/trace-format.md), statistics."""

from pbkv.trace.call import DEFAULT_AGENT, Call, Trace, TraceMeta, arrival_times
from pbkv.trace.io import TraceError, read_trace, validate, write_trace

__all__ = ["DEFAULT_AGENT", "Call", "arrival_times", "Trace", "TraceMeta", "TraceError", "read_trace", "validate", "write_trace"]
