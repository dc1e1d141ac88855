"""Weight quantization of a pipeline component with torchao (``pip install 'triptych[quant]'``).

``quantize_component`` swaps the weight of every ``nn.Linear`` of the component for a torchao
quantized tensor (the modules stay ``nn.Linear``; their ``weight`` becomes an ``Int8Tensor`` /
``Float8Tensor``): int8 weight-only dequantizes in the matmul, int8 dynamic also quantizes the
activations per token, fp8 (CUDA, compute capability >= 8.9) quantizes both to float8_e4m3.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _config(mode: str):
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    configs = {
        "int8-weight-only": Int8WeightOnlyConfig,
        "int8-dynamic": Int8DynamicActivationInt8WeightConfig,
        "fp8": Float8DynamicActivationFloat8WeightConfig,
    }
    return configs[mode]()


def quantize_component(module: torch.nn.Module, mode: str) -> int:
    """Quantize every ``nn.Linear`` weight of ``module`` in place; returns how many were replaced."""
    from torchao.quantization import quantize_

    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    quantize_(module, _config(mode))
    replaced = sum(1 for m in linears if is_quantized(m.weight))
    logger.info("quantized %d of %d Linear weights of %s (%s)", replaced, len(linears), type(module).__name__, mode)
    return replaced


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether a weight is a torchao quantized tensor (not a plain float parameter)."""
    from torchao.utils import TorchAOBaseTensor

    data = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    return isinstance(data, TorchAOBaseTensor)
