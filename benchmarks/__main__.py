"""`python -m benchmarks run SUITE [--smoke] [--only NAME,...] [--set NAME=VALUE ...]`, `list`, `tree-hash`,
`merge SOURCE SECTION [--into FILE] [--as NAME] [--suffix S] [--headline] [--note TEXT]`.

See benchmarks/README.md: what each suite measures, how to run it on a CPU and on a GPU, and where
its results go.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a suite, write benchmarks/results/<suite>.json")
    run.add_argument("suite")
    run.add_argument("--smoke", action="store_true",
                     help="smallest shapes, on a CPU with the kernels interpreted: checks the code runs; "
                          "results go to benchmarks/results/smoke/")
    run.add_argument("--only", default="", help="comma list of the suite's benchmarks")
    run.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="an option of the suite's benchmarks (their docstrings list them)")
    run.add_argument("--results-dir", type=Path, default=None)
    commands.add_parser("list", help="the suites and their benchmarks")
    commands.add_parser("tree-hash", help="the hash a results file records for this tree")
    merge = commands.add_parser("merge", help="copy a section of a results file from another run into "
                                              "benchmarks/results/<its suite>.json, with its provenance")
    merge.add_argument("source", type=Path)
    merge.add_argument("section")
    merge.add_argument("--into", type=Path, default=None, help="default: the source suite's results file")
    merge.add_argument("--as", dest="name", default=None, help="the section's name there (default: the same)")
    merge.add_argument("--suffix", default="", help="appended to the section's ratio names")
    merge.add_argument("--headline", action="store_true", help="its ratios become the file's current ones")
    merge.add_argument("--note", default="", help="a sentence appended to the file's note")
    args = parser.parse_args(argv)
    if args.command == "merge":
        return _merge(args)
    from .suites import SUITES

    if args.command == "list":
        for suite in SUITES.values():
            names = ", ".join(b.rsplit(".", 1)[-1] for b in suite.benchmarks)
            print(f"{suite.name:12s} {suite.what}\n{'':12s} {names}")
        return 0
    if args.command == "tree-hash":
        from .lib.tree_hash import folder_hashes, git_state, tree_hash

        print(json.dumps({"tree": tree_hash(), "folders": folder_hashes(), "git": git_state()}, indent=1))
        return 0
    if args.suite not in SUITES:
        parser.error(f"unknown suite {args.suite!r}; one of {', '.join(SUITES)}")
    import torch

    from .suites import run_suite

    suite = SUITES[args.suite]
    device = "cpu" if suite.cpu_only else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(item.split("=", 1) for item in args.set)
    only = [n for n in args.only.split(",") if n]
    results = run_suite(suite, device, args.smoke, only, options, args.results_dir)
    errors = [name for name, section in results.data["sections"].items() if "error" in section]
    print(json.dumps({"ratios": results.data["ratios"], "errors": errors}, indent=1, default=str))
    print("->", results.path)
    return 1 if errors else 0


def _merge(args: argparse.Namespace) -> int:
    from .lib.merge import merge_section, read, write
    from .lib.records import RESULTS_DIR

    source = read(args.source)
    into = args.into or RESULTS_DIR / f"{source['suite']}.json"
    target = read(into)
    merged = merge_section(target, source, args.section, args.name, args.suffix, args.headline)
    if args.note:
        target["note"] = f"{target.get('note', '')} {args.note}".strip()
    write(into, target)
    print(json.dumps({"section": args.name or args.section, "tree": merged["measured"].get("tree"),
                      "ratios": merged.get("ratios", {})}, indent=1, default=str))
    print("->", into)
    return 0


if __name__ == "__main__":
    sys.exit(main())
