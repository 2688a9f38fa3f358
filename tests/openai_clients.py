"""The official `openai` client pointed at a platform a test started."""

from __future__ import annotations

import openai

from antumbra.platform.launch.serve_cli import RunningPlatform


def platform_client(platform: RunningPlatform, timeout_s: float = 120) -> openai.OpenAI:
    """A client of the platform's default tenant; no retries, so a test sees every failure."""
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=platform.api_key, max_retries=0,
                         timeout=timeout_s)
