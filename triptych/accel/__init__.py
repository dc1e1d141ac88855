"""Compile, quantization and step graphs for a loaded pipeline (``SpeedConfig``, ``apply_speed``,
``step_graphs_for``)."""

from triptych.accel.config import QUANT_COMPONENTS, QUANT_MODES, SpeedConfig

__all__ = ["QUANT_COMPONENTS", "QUANT_MODES", "SpeedConfig", "apply_speed", "step_graphs_for"]


def apply_speed(pipe, config: SpeedConfig, device: str = "cpu", compile_vae_decoder: bool = False):
    """Quantize then compile ``pipe``'s loaded components as ``config`` says (see the two modules);
    the compiled one-frame VAE decoder, or None (``accel.compile.compile_decoder``)."""
    from triptych.accel.apply import apply_speed as apply

    return apply(pipe, config, device, compile_vae_decoder)


def step_graphs_for(config: SpeedConfig):
    """``--step-graphs``' runner (``accel.step_graphs.StepGraphs``) capturing with CUDA graphs, bounded
    as ``config`` says."""
    from triptych.accel.cuda_capture import CudaCapture
    from triptych.accel.step_graphs import StepGraphs

    pool = None if config.graph_pool_mib is None else config.graph_pool_mib * 2**20
    return StepGraphs(CudaCapture(), config.graph_buckets, config.graph_max, pool, config.graph_policy)
