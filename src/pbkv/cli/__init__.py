"""The `pbkv` command. One module per command group; the options they share live in `common.py`.

    trace.py    gen, trace stats|split|flatten     predict.py  train, predict-eval
    bench.py    bench, ablate                      serve.py    serve
    check.py    calibrate, simcheck                perf.py     perf sim|policy|evict

`pbkv --help` lists the commands in the order a newcomer uses them (`ORDER`). Every command
imports what it runs lazily, so `pbkv --help` starts fast.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from pbkv.cli import bench, check, perf, predict, serve, trace

ORDER = ("gen", "trace", "bench", "ablate", "train", "predict-eval", "serve", "calibrate", "simcheck", "perf")


class NewcomerOrder(TyperGroup):
    """Commands and command groups listed in `ORDER` (typer would list groups last)."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


app = typer.Typer(cls=NewcomerOrder, add_completion=False, no_args_is_help=True,
                  help="Prediction-based KV-cache management for LLM agent workflows.")
app.command("gen")(trace.gen)
app.add_typer(trace.trace_app, name="trace")
app.command("bench")(bench.bench)
app.command("ablate")(bench.ablate)
app.command("train")(predict.train)
app.command("predict-eval")(predict.predict_eval)
app.command("serve")(serve.serve)
app.command("calibrate")(check.calibrate)
app.command("simcheck")(check.simcheck)
app.add_typer(perf.perf_app, name="perf")

__all__ = ["app"]
