"""Which replica serves a request, decided in the process that holds the model deployment's handle.

`router` is the Ray Serve `RequestRouter`; it asks the prefix directory in Redis (`directory`)
which replicas hold the request's leading blocks and ranks them with `policy` (pure Python).
The replicas' publishers write the directory (`antumbra.platform.replica.publisher`).
"""
