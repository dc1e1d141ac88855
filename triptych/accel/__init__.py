"""Compile and quantization wrappers for a loaded pipeline (``SpeedConfig``, ``apply_speed``)."""

from triptych.accel.config import QUANT_COMPONENTS, QUANT_MODES, SpeedConfig

__all__ = ["QUANT_COMPONENTS", "QUANT_MODES", "SpeedConfig", "apply_speed"]


def apply_speed(pipe, config: SpeedConfig, device: str = "cpu", compile_vae_decoder: bool = False) -> None:
    """Quantize then compile ``pipe``'s loaded components as ``config`` says (see the two modules)."""
    from triptych.accel.apply import apply_speed as apply

    apply(pipe, config, device, compile_vae_decoder)
