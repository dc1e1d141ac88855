"""What one role worker process is told (``WorkerConfig``), and how its command line spells it.

``triptych worker`` builds its flags from ``WorkerConfig`` (``WORKER_FLAGS``; the degrees'
``core.parallel_config.FLAG_NAMES``) and a head that spawns workers (``deploy.supervisor``,
``deploy.ray_backend``) turns a ``WorkerConfig`` back into those flags with ``worker_argv``: one
spelling of each flag and one default, both here.
It lives in ``control`` (the head <-> worker contract) so the head's deploy layer and the worker
both reach it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from triptych.accel.config import SpeedConfig
from triptych.chat.config import ChatEngineConfig
from triptych.control.auth import ControlKey
from triptych.core.config_flags import argv_of
from triptych.core.devices import DeviceConfig
from triptych.core.kinds import Role, TransferKind
from triptych.core.parallel_config import FLAG_NAMES as PARALLEL_FLAG_NAMES
from triptych.core.parallel_config import ParallelConfig
from triptych.engine.config import EngineConfig
from triptych.lora.config import LoraConfig
from triptych.mmcache.config import MMCacheConfig
from triptych.transfer.base import TransferConfig

#: ``ConfigFlags`` options of ``WorkerConfig`` on ``triptych worker``: the flags not spelt
#: ``--field-name``; ``explicit`` ones the command adds itself (``--token``'s default is the
#: environment's, ``--model``'s the built-in model) or fills in (None).
WORKER_FLAGS = {
    "rename": {
        "torch_threads": "threads",
        "parent_pid": "exit-with-parent",
        "collective_timeout_s": "collective-timeout",
        "chat_vllm_url": "vllm-url",
    },
    "explicit": {
        "token": "--token",
        "model_dir": "--model",
        "transfer_max_bytes": "--transfer-max-bytes",  # the TransferConfig group's flag (serve has it too)
        "teacache_profiles_dir": None,
    },
}


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process."""

    role: Role
    """Which pool this instance serves; it loads only that role's components."""
    head: str
    """Head control address, ``tcp://HOST:PORT``."""
    token: str
    """The deployment's control-plane token (``serve`` hands its local workers one; remote workers
    get it with ``--token`` or ``$TRIPTYCH_TOKEN``): every control frame is signed with it."""
    model_dir: Path
    """Diffusers model directory (same configs as the head's, checked by revision)."""
    instance_id: str = ""
    """Unique id; empty = ``<role>-<random>``."""
    capacity: int = EngineConfig.max_batch_requests
    """Requests this instance may hold at once (the head never routes more). A request holds a slot of
    its denoiser from its encode to the end of its denoise and one of its decoder from the start of its
    denoise, so a denoiser's step batch is at most the smaller of the two: the default is the engine's
    default batch (``EngineConfig.max_batch_requests``, 8); with 4 (the default before), 8 concurrent
    requests stepped at most 4 at a time (benchmarks/RESULTS.md, served at 8 concurrent requests)."""
    transfer: TransferKind = TransferKind.AUTO
    """Transfer backend."""
    host: str = TransferConfig.host
    """Address the transfer endpoint binds and advertises."""
    transfer_max_bytes: int = TransferConfig.max_bytes
    """Receiver bytes of the transfer slot pool (``TransferConfig.max_bytes``)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Where and in what dtype this instance's components run (``--device --dtype --attention ...``)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Denoiser step batching (ignored by other roles)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Denoiser: the instance's CFG × Ulysses × ring degrees; more than one rank spawns the others
    (this process is rank 0, the instance's only endpoint)."""
    collective_timeout_s: float = 60.0
    """Multi-rank denoiser: a collective waiting longer than this (a dead or hung rank) takes the
    whole instance out of service."""
    mm_cache: MMCacheConfig = field(default_factory=MMCacheConfig)
    """The encoder's mm-hash cache budget (ignored by other roles)."""
    chat: ChatEngineConfig = field(default_factory=ChatEngineConfig)
    """The encoder's chat engine: running chats per instance, prefix KV budget (ignored by other roles)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Denoiser: the adapters it serves and its memory for them (ignored by other roles)."""
    chat_vllm_url: str = ""
    """Encoder: the vLLM server that answers this encoder's chats (``triptych serve --chat-engine
    vllm`` passes it); empty = the built-in decoder."""
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    """Compile and quantization of the components this instance loads; a compiling denoiser warms up
    (compiles its graphs) before it registers."""
    register_timeout_s: float = 120.0
    """How long to wait for the head's ``RegisterAck``."""
    torch_threads: int = 0
    """``torch.set_num_threads`` (0 = leave torch's default)."""
    teacache_profiles_dir: Path | None = None
    """Denoiser: TeaCache profiles looked up before the model's own ``teacache/`` (what ``auto``
    resolves to). ``triptych worker`` sets it to the user directory of the model
    (``cli_profiles.user_profiles_dir``), the one the head checks requests against."""
    parent_pid: int = 0
    """Exit when this process (the head that spawned us) is gone: a head killed with SIGKILL leaves no
    orphan workers holding memory and devices (the kernel's parent-death signal on Linux, a watch of
    the parent pid everywhere). 0 = independent (remote workers)."""
    parent_grace_s: float = 10.0
    """After the parent is gone, how long the loop may take to stop (a forward may be running)
    before the process exits hard."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a plain string as its member; ValueError if none
        object.__setattr__(self, "transfer", TransferKind(self.transfer))
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")
        if not self.head.startswith("tcp://"):
            raise ValueError(f"head={self.head!r} must look like tcp://HOST:PORT")
        ControlKey(self.token)  # raises on a token too short to be one
        if self.register_timeout_s <= 0:
            raise ValueError(f"register_timeout_s={self.register_timeout_s} must be > 0")


def worker_argv(config: WorkerConfig) -> list[str]:
    """The ``triptych worker`` flags that rebuild ``config`` (the token excepted: it travels in the
    environment, ``$TRIPTYCH_TOKEN``). Only the fields a head sets per worker are written: role, head,
    model, the ``WORKER_FLAGS`` fields that differ from their defaults, the device and the denoiser's
    degrees; the engine, cache, chat, LoRA and speed flags travel as ``TopologyConfig.extra_args``."""
    out = [*argv_of(WorkerConfig, config, **WORKER_FLAGS), "--model", str(config.model_dir)]
    if config.transfer_max_bytes != TransferConfig.max_bytes:
        out += ["--transfer-max-bytes", str(config.transfer_max_bytes)]
    return [*out, *config.device.to_args(), *argv_of(ParallelConfig, config.parallel, rename=PARALLEL_FLAG_NAMES)]
