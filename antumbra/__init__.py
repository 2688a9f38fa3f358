"""Antumbra: a multi-tenant serving platform for DeepSeek-V4-style hybrid-attention models."""

from antumbra.replicas.engine import Engine
from antumbra.replicas.request import RequestOutput
from antumbra.replicas.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
