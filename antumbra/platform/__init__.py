"""The Ray Serve application, one subpackage per process that runs it.

  ingress/    each ingress replica (FastAPI under `@serve.ingress`): the OpenAI REST API, API keys
              and tenants, body and parameter checks, rate and concurrency limits, tokenization and
              block hashes, calling the model deployment, SSE streaming, OpenAI-shaped errors, admin.
  routing/    the request router, which Ray Serve runs in the process holding the model deployment's
              handle (so again the ingress replica): the `RequestRouter`, its pure policy and the
              prefix-directory client.
  replica/    each model replica: `ModelServer` around one engine (in the replica's process, or in
              an engine process of its own that the replica starts: `engine_process.py`), the
              publisher of its cache events into the prefix directory, and placement groups for
              replicas that span several devices.
  control/    the Serve controller: autoscaling policies over the replicas' stats.
  launch/     the driver: the process that assembles the Serve application (`PlatformConfig`,
              `build_app`; `antumbra serve`, or whatever builds the app from a Serve config file) and,
              for `antumbra serve`, the embedded redis-server and tiny model it starts with.

Beside them, the modules that several processes share:

  messages.py      what crosses a handle call: `GenerateRequest` and the replica's stream items
  redis_client.py  the fail-fast asyncio Redis client of the ingress, the router and the publishers
  metrics.py       Ray metrics by tenant and model, recorded by the ingress and the router

Imports (`tests/test_import_graph.py` checks them):

  * `messages`, `redis_client` and `metrics` import no other platform module.
  * `ingress`, `routing` and `replica` import the shared modules and their own subpackage, nothing
    else of the platform, with one exception: `replica` imports `routing.directory`, the directory
    client its publisher writes with (and the router reads with). `ingress` reaches the router and
    the replicas only through a handle call and its `GenerateRequest`; neither imports `ingress`.
  * `control` imports nothing of the platform: the controller loads its policies by name.
  * `launch` may import any of them, and nothing else imports `launch`.
  * Nothing in the platform imports `antumbra.cli`; the layers below it (`replicas`, `cachestore`,
    `kernels`) never import the platform.
"""
