"""Prefill / decode disaggregation: one request's KV exported by pages, moved, and adopted.

payload.py says what moves (and its size from the layout), rows.py reads and writes it by position,
adopt.py holds both ends inside an engine core, disaggregation.py the engine's part that drives them
(`engine.disaggregation`), transport.py the ways the payload travels between processes.
"""
