"""Denoiser step-batching engine: schedule() → execute() → update(), one denoising step per tick."""

from triptych.server.engine.config import EngineConfig
from triptych.server.engine.engine import DenoiserEngine, EngineStepOutput
from triptych.server.engine.stats import EngineStats

__all__ = ["DenoiserEngine", "EngineConfig", "EngineStepOutput", "EngineStats"]
