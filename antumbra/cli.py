"""`antumbra` command line: `make-tiny-model`, `generate`, `serve`, `render-deploy`, `usage`.

Each subcommand is one `_add_*` function that registers its parser and binds
its handler; `main` only dispatches. Heavy imports (torch, transformers, the
engine) happen inside the handlers so `antumbra --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from antumbra import env
from antumbra.config import CSA, HCA, LAYER_TYPES, SLIDING
from antumbra.platform.launch.tiny_model import TINY_MODEL_SUBDIR, default_tiny_model_dir

_LAYER_ALIASES = {"swa": SLIDING, "sliding": SLIDING, "csa": CSA, "c4": CSA, "hca": HCA, "c128": HCA}


def _layer_type(name: str) -> str:
    kind = _LAYER_ALIASES.get(name.lower(), name)
    if kind not in LAYER_TYPES:
        choices = ", ".join([*LAYER_TYPES, *_LAYER_ALIASES])
        raise argparse.ArgumentTypeError(f"unknown layer type {name!r} (choose from {choices})")
    return kind


# ---------------------------------------------------------------- make-tiny-model


def _make_tiny_model(out_dir: Path, seed: int, layers: Sequence[str] | None) -> Path:
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    spec = TinyModelSpec(seed=seed)
    if layers:
        spec = spec.with_layers(tuple(layers))
    return make_tiny_checkpoint(out_dir, spec)


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    path = _make_tiny_model(Path(args.dir), args.seed, args.layers)
    print(path)
    return 0


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a small random DeepSeek-V4 checkpoint (all layer types, both MoE kinds)",
    )
    p.add_argument("dir", metavar="DIR", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--layers",
        nargs="+",
        type=_layer_type,
        metavar="TYPE",
        help="layer schedule, e.g. swa csa hca csa (default: that one)",
    )
    p.set_defaults(handler=_run_make_tiny_model)


# ---------------------------------------------------------------- generate


def _run_generate(args: argparse.Namespace) -> int:
    from antumbra import Engine, SamplingParams

    model_dir = Path(args.model) if args.model else default_tiny_model_dir()
    engine = Engine.from_pretrained(str(model_dir), device="cpu", dtype="float32")
    prompts = list(args.prompt)
    if args.chat:
        if engine.tokenizer is None:
            raise SystemExit(f"{model_dir} has no tokenizer, so --chat cannot apply a chat template")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in engine.generate(prompts, params):
        print(out.text)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts with the engine (offline, one batch)")
    p.add_argument(
        "--model",
        help=f"checkpoint directory (default: a tiny random model generated once into "
        f"{TINY_MODEL_SUBDIR}/ under ${env.CACHE_DIR}, which defaults to ./.cache)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as one user turn of the chat template"
    )
    p.add_argument("prompt", nargs="+", help="one or more prompts; each is completed separately")
    p.set_defaults(handler=_run_generate)


# ---------------------------------------------------------------- serve


def _add_serve(sub: argparse._SubParsersAction) -> None:
    # The parser lives beside the platform code; importing it pulls in nothing heavy.
    from antumbra.platform.launch.serve_cli import add_serve

    add_serve(sub)


# ---------------------------------------------------------------- render-deploy


def _run_render_deploy(args: argparse.Namespace) -> int:
    from antumbra.platform.launch.render_deploy import run_render

    return run_render(args)


def _add_render_deploy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "render-deploy", help="render the Ray Serve config and the KubeRay RayService of a deployment spec"
    )
    p.add_argument("--spec", required=True, metavar="FILE", help="deployment spec YAML (see infra/deploy/)")
    p.add_argument("--out", required=True, metavar="DIR", help="where serve.yaml and rayservice.yaml go")
    p.set_defaults(handler=_run_render_deploy)


def _add_usage(sub: argparse._SubParsersAction) -> None:
    from antumbra.platform.launch.usage_cli import add_usage

    add_usage(sub)


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_make_tiny_model,
    _add_generate,
    _add_serve,
    _add_render_deploy,
    _add_usage,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="antumbra", description="DeepSeek-V4 serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
