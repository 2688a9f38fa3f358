"""How long reading a completion's body holds the ingress's event loop, on the CPU.

    python -m benchmarks.host_request_parse [--tokens 1024,16384] [--reps 50]

The ingress parses each request's JSON body and validates its parameters on its event loop, which
every stream's chunks pass; both hold the GIL for the whole call, so a thread would not free the
loop. Timed here for a `/v1/completions` body whose prompt is a list of random V4 token ids (what
the platform benchmark sends), median and min over `--reps`:

  * parsing: `json.loads` against `request_body.parse_body` (pydantic-core's parser, `json.loads`
    only for what it refuses);
  * validating: `parse_request(CompletionRequest, body)` now, against the per-item bound check the
    prompt's field would add on top of it were every token-id prompt checked again by the field's
    union (`list[Annotated[int, Field(ge=0)]]`, timed alone).

Ratios: `parse_body_vs_json_loads_<tokens>`, `bound_check_vs_request_validation_<tokens>`. Writes
benchmarks/results/host-request-parse.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

from .lib.records import provenance, write_results

V4_VOCAB = 129_280


def _ms(work: Callable[[], object], reps: int) -> dict[str, float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def measure(token_counts: list[int], reps: int) -> dict[str, Any]:
    from pydantic import Field, TypeAdapter

    from antumbra.platform.ingress.openai_requests import CompletionRequest, parse_request
    from antumbra.platform.ingress.request_body import parse_body

    bound_checked: TypeAdapter[list[int]] = TypeAdapter(list[Annotated[int, Field(ge=0)]])
    rng = random.Random(0)
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for tokens in token_counts:
        ids = [rng.randrange(V4_VOCAB) for _ in range(tokens)]
        raw = json.dumps({"model": "m", "prompt": ids, "max_tokens": 256, "stream": True}).encode()
        body = json.loads(raw)
        assert parse_body(raw) == body and parse_request(CompletionRequest, body).prompt == ids
        row = {"body_bytes": len(raw),
               "json_loads": _ms(partial(json.loads, raw), reps),
               "parse_body": _ms(partial(parse_body, raw), reps),
               "request_validation": _ms(partial(parse_request, CompletionRequest, body), reps),
               "bound_check_alone": _ms(partial(bound_checked.validate_python, ids), reps)}
        out[str(tokens)] = row
        ratios[f"parse_body_vs_json_loads_{tokens}"] = (row["parse_body"]["median_ms"]
                                                        / row["json_loads"]["median_ms"])
        ratios[f"bound_check_vs_request_validation_{tokens}"] = (row["bound_check_alone"]["median_ms"]
                                                                 / row["request_validation"]["median_ms"])
    return {"tokens": out, "reps": reps, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,16384")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    result = {**provenance("cpu"), **measure([int(t) for t in args.tokens.split(",")], args.reps)}
    write_results("host-request-parse.json", result)


if __name__ == "__main__":
    main()
