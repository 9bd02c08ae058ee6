"""Scale-out: pbkv's routers in front of several engine replicas (Ray Serve).

`adapter` (no Ray) turns a request and the replicas' reported stats into router input;
`ray_router` (needs `pbkv[scale]`) is the Ray Serve `RequestRouter` built on it; `cluster` and
`links` are the N-instance simulator. `pbkv serve --replicas N`: `serve_app` (Ray, the engine
deployment, the ingress), `replica` (one engine replica), `remote` (the ingress's worker:
routing hints, retries), `failover` and `metrics_merge` (pure: the retry rule, /metrics summed
and per replica); `bench_serve` measures it per router; `probe` is a model-free replica.
"""
