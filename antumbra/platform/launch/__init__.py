"""Assembling and starting the platform, in the driver process.

`app` builds the Serve application from a `PlatformConfig` (also as `app_builder`, the entry point
of a Serve config file, which runs wherever Serve builds the app). `serve_cli` is `antumbra serve`:
local Ray, the embedded `redis_server` and, with no model given, the `tiny_model`.
"""
