"""One model replica, a Ray Serve replica actor: `model_server` runs one engine and streams its
outputs, `publisher` keeps the prefix directory true to its cache, `placement` gives a replica that
spans several devices its placement group and rank workers.
"""
