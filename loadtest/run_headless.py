"""Run the multi-tenant Locust load headless for a fixed time, then write CSVs and a summary.

    python -m loadtest.run_headless --url http://127.0.0.1:8000 --api-keys KEY_A,KEY_B \
        --rates 2,0.5 --users 6 --duration 30 --out loadtest/results/run1

or `--tenants "alpha:KEY_A:2:3,beta:KEY_B:0.5:1"` (name:key[:rps[:weight]], JSON, or @file).
It runs `locust -f loadtest/locustfile.py --headless` in a subprocess (Locust patches the
standard library with gevent, so it gets a fresh interpreter), with `--csv OUT/locust`, and
afterwards writes `OUT/summary.json` and `OUT/summary.md` (from the final statistics the
locustfile reports in `OUT/report.json`, else from the CSV): per entry (requests, TTFT and ITL
events, per tenant) the count, failures, mean / p50 / p90 / p99 in ms and rate, plus per
tenant the cached share of prompt tokens. Exits non-zero when Locust did, when any request
failed, or when no request completed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
REQUEST_TYPES_CUSTOM = ("TTFT", "ITL")


def tenants_spec(args: argparse.Namespace) -> str:
    """The `ANTUMBRA_LOADTEST_TENANTS` value from `--tenants`, or from `--api-keys` / `--rates` /
    `--weights`."""
    if args.tenants:
        return args.tenants
    if not args.api_keys:
        raise SystemExit("give --api-keys or --tenants")
    keys = [k.strip() for k in args.api_keys.split(",") if k.strip()]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [1.0]
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1.0]
    parts = []
    for i, key in enumerate(keys):
        rate = rates[i] if i < len(rates) else rates[-1]
        weight = weights[i] if i < len(weights) else weights[-1]
        parts.append(f"tenant-{i + 1}:{key}:{rate}:{weight}")
    return ",".join(parts)


def locust_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "--host", args.url,
        "--users", str(args.users),
        "--spawn-rate", str(args.spawn_rate),
        "--run-time", f"{args.duration}s",
        "--stop-timeout", str(args.stop_timeout),
        "--csv", str(out / "locust"),
        "--exit-code-on-error", "1",
        "--only-summary",
        "--loglevel", "WARNING",
    ]  # fmt: skip


def _num(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def read_stats(path: Path) -> list[dict[str, Any]]:
    """The rows of Locust's `*_stats.csv` as numbers (the "Aggregated" row included)."""
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            rows.append(
                {
                    "type": row.get("Type") or "",
                    "name": row.get("Name") or "",
                    "count": int(_num(row.get("Request Count", "0")) or 0),
                    "failures": int(_num(row.get("Failure Count", "0")) or 0),
                    "mean_ms": _num(row.get("Average Response Time", "")),
                    "p50_ms": _num(row.get("50%", "")),
                    "p90_ms": _num(row.get("90%", "")),
                    "p99_ms": _num(row.get("99%", "")),
                    "max_ms": _num(row.get("Max Response Time", "")),
                    "rps": _num(row.get("Requests/s", "")),
                }
            )
    return rows


def read_failures(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [
            {
                "method": r.get("Method"),
                "name": r.get("Name"),
                "error": r.get("Error"),
                "count": r.get("Occurrences"),
            }
            for r in csv.DictReader(f)
        ]


def summarize(
    rows: list[dict[str, Any]], tokens: dict[str, Any], failures: list[dict[str, Any]]
) -> dict[str, Any]:
    """Requests (real HTTP entries) vs custom latency events, totals, and per-tenant cache ratios."""
    requests = [r for r in rows if r["name"] != "Aggregated" and r["type"] not in REQUEST_TYPES_CUSTOM]
    custom = [r for r in rows if r["type"] in REQUEST_TYPES_CUSTOM]
    total = sum(r["count"] for r in requests)
    failed = sum(r["failures"] for r in requests)
    per_tenant = {}
    for name, t in sorted(tokens.items()):
        prompt = t.get("prompt_tokens", 0)
        per_tenant[name] = {**t, "cached_ratio": (t.get("cached_tokens", 0) / prompt) if prompt else 0.0}
    return {
        "requests": total,
        "failures": failed,
        "rps": sum(r["rps"] or 0.0 for r in requests),
        "entries": requests,
        "latency_events": custom,
        "tenants": per_tenant,
        "failure_kinds": failures,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Load test: {summary['url']}",
        "",
        f"{summary['duration_s']} s, {summary['users']} users; {summary['requests']} requests, "
        f"{summary['failures']} failed, {summary['rps']:.2f} req/s; "
        f"locust exit code {summary['locust_exit_code']}.",
        "",
        "| type | name | count | failures | mean ms | p50 ms | p90 ms | p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["entries"] + summary["latency_events"]:
        lines.append(
            f"| {r['type']} | {r['name']} | {r['count']} | {r['failures']} | {_ms(r['mean_ms'])} | "
            f"{_ms(r['p50_ms'])} | {_ms(r['p90_ms'])} | {_ms(r['p99_ms'])} |"
        )
    if summary["tenants"]:
        lines += [
            "",
            "| tenant | requests | prompt tokens | cached tokens | cached share |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, t in summary["tenants"].items():
            lines.append(
                f"| {name} | {t['requests']} | {t['prompt_tokens']} | {t['cached_tokens']} "
                f"| {t['cached_ratio']:.1%} |"
            )
    if summary["failure_kinds"]:
        lines += ["", "Failures:", ""] + [
            f"- {f['name']}: {f['error']} ({f['count']}x)" for f in summary["failure_kinds"]
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="base URL of the API, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--api-keys", help="comma-separated tenant API keys (tenants named tenant-1, tenant-2, ...)"
    )
    p.add_argument("--rates", help="comma-separated requests/s per user for each key (last one repeats)")
    p.add_argument("--weights", help="comma-separated share of users for each key (last one repeats)")
    p.add_argument("--tenants", help="name:key[:rps[:weight]],... or JSON or @file (instead of --api-keys)")
    p.add_argument("--duration", type=int, default=30, help="seconds of load")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--spawn-rate", type=float, default=4.0)
    p.add_argument(
        "--stop-timeout", type=int, default=30, help="seconds users get to finish a request at the end"
    )
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--out", default="loadtest/results/latest", help="directory for the CSVs and the summary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["ANTUMBRA_LOADTEST_TENANTS"] = tenants_spec(args)
    env["ANTUMBRA_LOADTEST_REPORT"] = str(out / "report.json")
    if args.model:
        env["ANTUMBRA_LOADTEST_MODEL"] = args.model
    if args.max_tokens:
        env["ANTUMBRA_LOADTEST_MAX_TOKENS"] = str(args.max_tokens)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(locust_command(args, out), env=env, cwd=HERE.parent)
    stats_path = out / "locust_stats.csv"
    if not stats_path.exists():
        print(f"locust wrote no statistics (exit code {proc.returncode})", file=sys.stderr)
        return proc.returncode or 1
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    rows = report.get("stats") or read_stats(stats_path)  # the final numbers; the CSV is periodic
    summary = {
        "url": args.url,
        "duration_s": args.duration,
        "users": args.users,
        "locust_exit_code": proc.returncode,
        **summarize(rows, report.get("tenants") or {}, read_failures(out / "locust_failures.csv")),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    ok = proc.returncode == 0 and summary["failures"] == 0 and summary["requests"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
