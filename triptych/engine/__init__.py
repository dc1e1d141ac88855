"""Denoiser step-batching engine: schedule() → execute() → update(), one denoising step per tick."""

from triptych.engine.config import EngineConfig
from triptych.engine.engine import DenoiserEngine, EngineStepOutput
from triptych.engine.stats import EngineStats

__all__ = ["DenoiserEngine", "EngineConfig", "EngineStepOutput", "EngineStats"]
