"""One request across many devices: CFG parallel and Ulysses/ring sequence parallel for one
multi-rank denoiser instance (one instance: rank 0 decides each tick). Model-agnostic: a transformer's own
``_cp_plan`` says how its inputs split; rows are opaque to the CFG split."""

from triptych.core.parallel_config import ParallelConfig
from triptych.parallel.apply import Parallelism, apply_parallel
from triptych.parallel.broadcast import broadcast_bytes, broadcast_message, broadcast_tensors
from triptych.parallel.groups import ParallelGroups, destroy, free_port, init_rank
from triptych.parallel.launch import RankFailed, run_ranks
from triptych.parallel.sequence import SequenceParallel, cpu_device_count_shim

__all__ = [
    "ParallelConfig",
    "ParallelGroups",
    "Parallelism",
    "RankFailed",
    "SequenceParallel",
    "apply_parallel",
    "broadcast_bytes",
    "broadcast_message",
    "broadcast_tensors",
    "cpu_device_count_shim",
    "destroy",
    "free_port",
    "init_rank",
    "run_ranks",
]
