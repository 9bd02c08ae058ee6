"""Scale-out: pbkv's routers in front of several engine replicas (Ray Serve).

`adapter` (no Ray) turns a request and the replicas' reported stats into router input;
`ray_router` (needs `pbkv[scale]`) is the Ray Serve `RequestRouter` built on it.
"""
