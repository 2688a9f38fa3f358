"""The hash of the source tree a benchmark ran from, computed where it ran.

The GPU machine gets a copy of the working tree without `.git`, so a commit id read from git (or
handed over in an environment variable) can be missing or wrong there. Instead the tree is hashed
in-process the way git hashes trees (blob and tree objects, SHA-1), over the folders that decide a
figure. Each folder's hash equals `git rev-parse COMMIT:FOLDER` for a checkout of COMMIT with no
changes in it, so a results file names the code it measured whoever copied it where.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What decides a figure: the product, the benchmarks, the tests the GPU run records. `benchmarks/results`
# is left out of the benchmarks folder's hash (results are written after it is taken).
HASHED = ("antumbra", "benchmarks", "tests", "pyproject.toml")
LEFT_OUT = ("benchmarks/results",)
# The repository's .gitignore patterns that can occur in these folders.
IGNORED = ("__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", "*.egg-info", ".hypothesis")


def _object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _ignored(path: Path, root: Path) -> bool:
    rel = path.relative_to(root).as_posix()
    return rel in LEFT_OUT or any(fnmatch.fnmatch(path.name, pattern) for pattern in IGNORED)


def _tree(folder: Path, root: Path) -> bytes | None:
    """Git's tree object id of `folder` (None when it holds no file: git keeps no empty tree)."""
    entries = []
    for path in folder.iterdir():
        if _ignored(path, root):
            continue
        if path.is_symlink():
            entries.append((path.name, b"120000", _object("blob", os.readlink(path).encode())))
        elif path.is_dir():
            sub = _tree(path, root)
            if sub is not None:
                entries.append((path.name + "/", b"40000", sub))
        elif path.is_file():
            mode = b"100755" if os.access(path, os.X_OK) else b"100644"
            entries.append((path.name, mode, _object("blob", path.read_bytes())))
    if not entries:
        return None
    # Git sorts a tree's entries by name, a folder's name as if it ended in "/".
    body = b"".join(mode + b" " + name.rstrip("/").encode() + b"\0" + oid
                    for name, mode, oid in sorted(entries))
    return _object("tree", body)


def folder_hashes(root: Path = ROOT, names: tuple[str, ...] = HASHED) -> dict[str, str]:
    """{folder or file: git object id} for each of `names` present under `root`."""
    out = {}
    for name in names:
        path = root / name
        if path.is_dir():
            oid = _tree(path, root)
        else:
            oid = _object("blob", path.read_bytes()) if path.is_file() else None
        if oid is not None:
            out[name] = oid.hex()
    return out


def tree_hash(root: Path = ROOT) -> str:
    """One id for all of HASHED: the git tree id of a folder holding just them."""
    parts = folder_hashes(root)
    entries = sorted(
        ((name if (root / name).is_file() else name + "/"), oid) for name, oid in parts.items()
    )
    body = b"".join(
        (b"100644 " if not name.endswith("/") else b"40000 ") + name.rstrip("/").encode() + b"\0"
        + bytes.fromhex(oid) for name, oid in entries
    )
    return _object("tree", body).hex()


def git_state(root: Path = ROOT) -> dict[str, str | bool | None]:
    """HEAD and whether the hashed folders match it, where git and `.git` are there; else Nones.

    Clean means every hashed folder's id equals HEAD's: then the figures are HEAD's."""
    head = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    if not head:
        return {"head": None, "clean": None}
    ours = folder_hashes(root)
    theirs = {}
    for name in ours:
        with contextlib.suppress(subprocess.CalledProcessError):
            theirs[name] = subprocess.run(["git", "rev-parse", f"HEAD:{name}"], cwd=root, capture_output=True,
                                          text=True, check=True).stdout.strip()
    # HEAD's benchmarks folder holds results; ours leaves them out, so it is compared without them.
    if "benchmarks" in theirs:
        theirs["benchmarks"] = _head_benchmarks_without_results(root, head) or theirs["benchmarks"]
    return {"head": head, "clean": ours == theirs}


def _head_benchmarks_without_results(root: Path, head: str) -> str | None:
    """HEAD's `benchmarks` tree id with its `results` entry removed (git mktree does the hashing)."""
    try:
        listing = subprocess.run(["git", "ls-tree", f"{head}:benchmarks"], cwd=root, capture_output=True,
                                 text=True, check=True).stdout
        kept = "".join(line + "\n" for line in listing.splitlines() if not line.endswith("\tresults"))
        return subprocess.run(["git", "mktree", "--missing"], cwd=root, input=kept, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
