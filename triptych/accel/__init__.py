"""Compile and quantization wrappers for a loaded pipeline (``SpeedConfig``, ``apply_speed``)."""

from triptych.accel.config import QUANT_COMPONENTS, QUANT_MODES, SpeedConfig

__all__ = ["QUANT_COMPONENTS", "QUANT_MODES", "SpeedConfig", "apply_speed"]


def apply_speed(pipe, config: SpeedConfig, device: str = "cpu", compile_vae_decoder: bool = False):
    """Quantize then compile ``pipe``'s loaded components as ``config`` says (see the two modules);
    the compiled one-frame VAE decoder, or None (``accel.compile.compile_decoder``)."""
    from triptych.accel.apply import apply_speed as apply

    return apply(pipe, config, device, compile_vae_decoder)
