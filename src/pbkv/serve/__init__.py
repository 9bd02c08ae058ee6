"""`pbkv serve`: an OpenAI-compatible HTTP server on the real engine, with workflow hints.

    app.py       routes, error shapes, request counting     generate.py  one request: job, stream
    schemas.py   request/response bodies                     auth.py      API key, body limit, hints
    worker.py    the engine thread: commands, HFEngine steps jobs.py      Job (one generation), Done
    workflows.py Hints -> workflow runs, idle timeouts       tokenizer.py byte / HF tokenizers, stops
    metrics.py   prometheus_client registry                  gauges.py    engine snapshot for /metrics
    recorder.py  --record: trace files (docs/trace-format.md)             learning.py  policy, predictor, online learning
    server.py    ServeConfig, run(), ServerThread

Needs the `serve` extra (fastapi, uvicorn): `pip install 'pbkv[serve]'`.
"""

from pbkv.serve.server import ServeConfig, ServerThread, build_state, run

__all__ = ["ServeConfig", "ServerThread", "build_state", "run"]
