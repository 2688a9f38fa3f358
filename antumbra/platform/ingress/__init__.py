"""The OpenAI-compatible REST edge, run by every ingress replica (FastAPI under Ray Serve).

`deployment` holds the routes and, in its docstring, the order of the checks a generation request
passes: `auth` and `tenants`, `request_body`, `served_model`, `openai_requests`, `prepare`,
`admission` and `ratelimit`, then the model deployment (`replica_stream`, `streaming`,
`generation`, which builds `openai_responses`); `errors` gives every failure OpenAI's shape
(`openai_errors`), `admin` and `openapi` serve the rest.
"""
