"""One request across many devices: CFG parallel and Ulysses/ring sequence parallel for one
multi-rank denoiser instance (ARCHITECTURE.md contract 8). Model-agnostic: a transformer's own
``_cp_plan`` says how its inputs split; rows are opaque to the CFG split."""

from triptych.parallel.config import ParallelConfig
from triptych.parallel.groups import ParallelGroups, destroy, free_port, init_rank
from triptych.parallel.launch import RankFailed, run_ranks
from triptych.parallel.sequence import SequenceParallel, cpu_device_count_shim

__all__ = [
    "ParallelConfig",
    "ParallelGroups",
    "RankFailed",
    "SequenceParallel",
    "cpu_device_count_shim",
    "destroy",
    "free_port",
    "init_rank",
    "run_ranks",
]
