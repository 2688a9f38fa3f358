"""`antumbra usage`: a tenant's token usage per model and hour, from a running platform's admin API.

    antumbra usage --tenant team-a --from 2026-01-31T00:00:00Z --to 2026-02-01 [--url URL] [--json]

It asks `GET /admin/usage` (the admin key from `--admin-key` or `$ANTUMBRA_ADMIN_KEY`) and prints
a table, one row per model and hour, then each tenant's totals; `--json` prints the answer as is.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from antumbra import env

COLUMNS = ("tenant", "model", "hour", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
           "reasoning_tokens", "total_tokens")
TIMEOUT_S = 30.0


def fetch_usage(url: str, admin_key: str, tenant: str | None, from_: str | None, to: str | None) -> Any:
    """The admin API's answer; raises `UsageCommandError` with the API's message when it refuses."""
    params = {k: v for k, v in (("tenant", tenant), ("from", from_), ("to", to)) if v}
    request = urllib.request.Request(f"{url.rstrip('/')}/admin/usage?{urllib.parse.urlencode(params)}",
                                     headers={"Authorization": f"Bearer {admin_key}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise UsageCommandError(f"{exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UsageCommandError(f"cannot reach {url}: {exc}") from None


class UsageCommandError(RuntimeError):
    """The platform could not be asked, or refused (the message says which)."""


def table(answer: dict[str, Any]) -> str:
    """The rows as aligned columns, then one totals line per tenant."""
    rows = [[str(row[c]) for c in COLUMNS] for row in answer["data"]]
    rows += [[tenant, "(all)", "(total)", *(str(sums[c]) for c in COLUMNS[3:])]
             for tenant, sums in sorted(answer["totals"].items())]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if not answer["data"]:
        lines.append(f"(no usage from {answer['from']} to {answer['to']})")
    return "\n".join(lines)


def run_usage(args: argparse.Namespace) -> int:
    admin_key = args.admin_key or env.admin_key()
    if not admin_key:
        print(f"antumbra usage: give --admin-key or set ${env.ADMIN_KEY}", file=sys.stderr)
        return 2
    try:
        answer = fetch_usage(args.url, admin_key, args.tenant, args.from_, args.to)
    except UsageCommandError as exc:
        print(f"antumbra usage: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else table(answer))
    return 0


def add_usage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("usage", help="token usage per tenant, model and hour (from the admin API)")
    p.add_argument("--tenant", help="one tenant (default: every tenant with usage)")
    p.add_argument("--from", dest="from_", metavar="TIME",
                   help="ISO 8601 time or Unix seconds (default: all)")
    p.add_argument("--to", metavar="TIME", help="ISO 8601 time or Unix seconds (default: now)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the platform (default http://127.0.0.1:8000)")
    p.add_argument("--admin-key", help=f"the admin key (default ${env.ADMIN_KEY})")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    p.set_defaults(handler=run_usage)
