"""`antumbra serve` as a user runs it: a real process whose printed examples, and the README's, must work.

The command runs in a temporary directory, so the tiny checkpoint it generates under `.cache/`
lands there, and without a Redis URL or admin key in its environment, so it starts its own Redis
and generates a key.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from antumbra import env
from antumbra.platform.launch.redis_server import HOST, free_port, ping
from antumbra.platform.launch.serve_cli import (
    API_KEY_VAR,
    DEFAULT_MODEL_NAME,
    STOP_HINT,
    add_serve,
    usage_examples,
)
from antumbra.platform.launch.tiny_model import TINY_MODEL_SUBDIR
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]
ANTUMBRA = Path(sys.executable).parent / "antumbra"  # the entry point installed beside this interpreter
README_PYTHON = ".venv/bin/python"  # the README runs from the repository root, where `make` puts the venv
START_TIMEOUT_S = 300  # Ray, Redis, a generated checkpoint and a replica, on 2 shared CPUs
STOP_TIMEOUT_S = 120
EXAMPLE_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------- processes


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process on the machine."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # The command name (field 2) may hold spaces and parentheses; the fields after it do not.
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        table[int(entry.name)] = (int(ppid), state)
    return table


def descendants(pid: int) -> set[int]:
    table = process_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie has exited; only its parent's wait is missing)."""
    table = process_table()
    return {p for p in pids if p in table and table[p][1] != "Z"}


def command_line(pid: int) -> str:
    try:
        return (
            (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


@dataclass
class Served:
    """A running `antumbra serve`, the lines it printed so far and every process it started."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)

    def start_reading(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None

        def read() -> None:
            for line in stdout:
                self.lines.append(line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def processes(self) -> set[int]:
        """Its descendants now, also remembered in `seen_pids` (they must all be gone after it exits)."""
        now = descendants(self.proc.pid)
        self.seen_pids |= now
        return now

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        def check() -> bool:
            self.processes()
            if self.proc.poll() is not None:
                raise AssertionError(f"antumbra serve exited {self.proc.returncode}:\n{self.stderr_tail()}")
            return predicate()

        wait_until(check, timeout_s, what, poll_s=0.2)

    def stop(self, sig: signal.Signals) -> int:
        self.processes()
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    stderr_path = tmp_path / "serve.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [str(ANTUMBRA), "serve", "--port", str(free_port())],
            cwd=tmp_path,
            env=serve_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            preexec_fn=_as_from_a_terminal,
        )
    running = Served(proc, stderr_path)
    running.start_reading()
    try:
        yield running
    finally:
        if proc.poll() is None:  # a failed test must not leave the platform running
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _as_from_a_terminal() -> None:
    """The child takes Ctrl-C as a command typed at a terminal does, even when the suite itself
    runs in the background, where the shell starts it (and so its children) ignoring SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def serve_env() -> dict[str, str]:
    """This environment minus what would point the command at someone else's Redis, keys or cache."""
    drop = {env.REDIS_URL, env.ADMIN_KEY, env.CACHE_DIR, API_KEY_VAR, "RAY_ADDRESS"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class Banner:
    base_url: str
    api_key: str
    admin_key: str
    redis_port: int
    examples: list[str]


def parse_banner(lines: list[str]) -> Banner:
    text = "\n".join(lines)
    banner = text[text.index("Antumbra is serving") : text.index(STOP_HINT)]

    def field_of(pattern: str) -> str:
        match = re.search(pattern, banner, re.MULTILINE)
        assert match, f"no {pattern!r} in:\n{banner}"
        return match.group(1)

    blocks = [b.strip("\n") for b in banner.split("\n\n")]
    return Banner(
        base_url=field_of(r"^Antumbra is serving \S+ at (\S+)/v1$"),
        api_key=field_of(r"^  API key +(\S+)"),
        admin_key=field_of(r"^  admin key +(\S+)"),
        redis_port=int(field_of(r"^  Redis +redis://[^:]+:(\d+)/")),
        examples=[b for b in blocks[2:] if b],  # after the title and the keys
    )


def readme_examples() -> tuple[list[str], list[str]]:
    """The README's `sh` block of examples: its `export` lines and the examples after them."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.DOTALL)
    (block,) = [b for b in blocks if f"${API_KEY_VAR}" in b]
    chunks = [c.strip("\n") for c in block.split("\n\n")]
    exports = [c for c in chunks if c.startswith("export ")]
    return exports, [c for c in chunks if not c.startswith("export ")]


def serve_defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    return parser.parse_args(["serve"])


def run_example(example: str, cwd: Path, extra_env: dict[str, str] | None = None) -> str:
    """Run an example as a user pastes it into bash; its stdout."""
    done = subprocess.run(
        ["bash", "-c", example],
        cwd=cwd,
        env={**serve_env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{example}\nexited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def check_chat_curl(stdout: str) -> None:
    body = json.loads(stdout)
    assert body["object"] == "chat.completion", body
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 16


def check_chat_openai(stdout: str) -> None:
    # The snippet prints the reply's text, then its usage object.
    assert re.search(r"CompletionUsage\(completion_tokens=([1-9]|1[0-6]),", stdout), stdout


def check_created_tenant(stdout: str) -> str:
    body = json.loads(stdout)
    assert body["id"] == "team-a" and body["api_key"], body
    return body["api_key"]


# ---------------------------------------------------------------------------------------- tests


def test_readme_shows_the_examples_serve_prints() -> None:
    """The README's examples are the banner's, as printed when the key is not known (`$ANTUMBRA_API_KEY`)."""
    defaults = serve_defaults()
    exports, examples = readme_examples()
    assert examples == usage_examples(
        f"http://{defaults.host}:{defaults.port}",
        DEFAULT_MODEL_NAME,
        api_key=None,
        admin_key=f"${env.ADMIN_KEY}",
        python=README_PYTHON,
    )
    assert [e.split("=")[0] for e in exports[0].splitlines()] == [
        f"export {API_KEY_VAR}",
        f"export {env.ADMIN_KEY}",
    ]


def test_serve_answers_its_examples_and_the_readmes_then_stops_on_ctrl_c(
    served: Served, tmp_path: Path
) -> None:
    served.wait_for(lambda: STOP_HINT in served.lines, START_TIMEOUT_S, "the banner of antumbra serve")
    banner = parse_banner(served.lines)
    assert (tmp_path / ".cache" / TINY_MODEL_SUBDIR / "config.json").is_file()  # generated under the cwd

    chat_curl, chat_openai, create_tenant = banner.examples
    check_chat_curl(run_example(chat_curl, tmp_path))
    check_chat_openai(run_example(chat_openai, tmp_path))
    check_created_tenant(run_example(create_tenant, tmp_path))

    # The README's examples, on this port, with the keys exported as it says.
    admin = {"Authorization": f"Bearer {banner.admin_key}"}
    assert httpx.delete(f"{banner.base_url}/admin/tenants/team-a", headers=admin).status_code == 200
    defaults = serve_defaults()
    keys = {API_KEY_VAR: banner.api_key, env.ADMIN_KEY: banner.admin_key}
    _, examples = readme_examples()
    readme_curl, readme_openai, readme_tenant = (
        e.replace(f"http://{defaults.host}:{defaults.port}", banner.base_url) for e in examples
    )
    check_chat_curl(run_example(readme_curl, REPO, keys))
    check_chat_openai(run_example(readme_openai, REPO, keys))
    new_key = check_created_tenant(run_example(readme_tenant, REPO, keys))
    check_chat_curl(run_example(readme_curl, REPO, {**keys, API_KEY_VAR: new_key}))

    redis_pids = {p for p in served.processes() if "redis-server" in command_line(p)}
    assert len(redis_pids) == 1 and ping(HOST, banner.redis_port)
    assert served.stop(signal.SIGINT) == 0, served.stderr_tail()
    wait_until(lambda: "Shutting down..." in served.lines, 10, "the shutdown message")
    assert not ping(HOST, banner.redis_port)
    wait_until(
        lambda: not alive(served.seen_pids), 30, f"every process it started to exit: {served.seen_pids}"
    )


def test_sigterm_while_starting_stops_what_had_started(served: Served) -> None:
    """A `kill` once Redis, Ray and the Serve controller run, before the app is up, stops them all."""
    served.wait_for(
        lambda: any("ServeController" in command_line(p) for p in served.processes()),
        START_TIMEOUT_S,
        "the Serve controller",
    )
    redis_pids = {p for p in served.processes() if "redis-server" in command_line(p)}
    assert len(redis_pids) == 1
    assert STOP_HINT not in served.lines  # still starting
    assert served.stop(signal.SIGTERM) == 130, served.stderr_tail()
    assert "Interrupted" in served.stderr_tail()
    wait_until(
        lambda: not alive(served.seen_pids), 30, f"every process it started to exit: {served.seen_pids}"
    )
