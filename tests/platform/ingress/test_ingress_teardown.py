"""An ingress replica whose construction failed early is torn down without a second error."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from antumbra.platform.ingress.deployment import Ingress, IngressSettings


def test_teardown_after_a_failed_init_raises_nothing() -> None:
    async def build_then_tear_down() -> None:
        ingress = Ingress.__new__(Ingress)
        settings = IngressSettings(redis_url="nosuchscheme://nowhere", model_paths={})
        with pytest.raises(ValueError, match="scheme"):  # fails before the usage meter exists
            await Ingress.__init__(ingress, settings, {})  # type: ignore[misc]
        assert not hasattr(ingress, "meter")
        done = ingress.__del__()
        if inspect.isawaitable(done):
            await done

    asyncio.run(build_then_tear_down())
