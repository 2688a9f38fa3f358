"""Shared fixtures: tiny checkpoints written once per session, and a thread cap for a 2-core CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; this must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist each worker takes one of the cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `gpu`-marked test is skipped only where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint: every layer type, both MoE kinds, window 128, rates 4 and 128."""
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec())


@pytest.fixture(scope="session")
def distilled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target (window 8, rates 4 and 8) whose MTP block was distilled on its greedy text, so
    drafts are accepted often enough to exercise both branches. Made once and shared by the test
    workers (the distillation takes about a minute on one core)."""
    from filelock import FileLock

    from antumbra.replicas.model.tiny import make_tiny_checkpoint
    from antumbra.rl.mtp_distill import DISTILL_SPEC, DistillConfig, distill

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by pytest-xdist's workers
    path = root / "distilled-mtp"
    with FileLock(str(root / "distilled-mtp.lock")):
        if not (path / "done").exists():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            make_tiny_checkpoint(path, DISTILL_SPEC, with_tokenizer=False)
            distill(path, DistillConfig())
            torch.set_num_threads(threads)
            (path / "done").write_text("")
    return path
