"""The head's per-app state, shared by every route module: ``HeadConfig``, ``Head``, ``ModelHead``,
``ClientGone``, ``DeadlineExceeded``.

``create_app`` (``head/app.py``) builds one ``Head`` over the served models (``served.py``: one
backend, with its own pools, per model) and hands it to each ``add_*_routes(app, head)``. A route
asks ``head.backend_for(request's model, job kind)`` for a ``ModelHead``: the chosen model's backend,
family, admission counter and metrics beside the shared config, limits and stores; it owns nothing
itself. ``Head.open`` creates the file and video stores and starts every backend (at once: each
waits for its own workers); ``Head.close`` closes them. Route modules import from here and from ``http_common``, never from each other or from
``http``.

NOTE: importing this module does not import torch; the backend and the video jobs (which do, through
the pipelines' edge types) are imported where they are used.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException
from starlette.requests import Request

from triptych.control.metrics import LoopMetrics, Metrics, render_labelled
from triptych.control.metrics_result_cache import ResultCacheMetrics
from triptych.core.errors import shown
from triptych.core.private import private_dir
from triptych.head.admission import AdmissionLimits
from triptych.head.files import FileStore
from triptych.head.result_cache import ResultCache
from triptych.head.result_key import ResultKeys
from triptych.head.served import ServedModel, ServedModels
from triptych.head.tenancy import MAX_DEADLINE_S, Tenants
from triptych.lora.config import LoraConfig

if TYPE_CHECKING:
    from triptych.control.backend import GenerationBackend
    from triptych.head.jobs import VideoJobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadConfig:
    """Everything the head needs besides its backend."""

    data_dir: Path
    """Root of the head's state: ``jobs.sqlite``, ``videos/`` (finished MP4s), ``files/`` (url links),
    ``loras/`` (run-time adapters, ``triptych.lora.journal``);
    owner-only (directories 0700, files 0600)."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    """Admission limits (sizes, steps, frames, n, uploads, queue)."""

    url_ttl_s: float = 3600.0
    """Lifetime of a ``response_format=url`` link, seconds. Bounds: > 0."""

    video_ttl_s: float | None = 7 * 24 * 3600.0
    """Lifetime of a completed video (record and file), seconds; None keeps them. Bounds: > 0."""

    public_base_url: str | None = None
    """Base of the ``url`` links the head hands out (e.g. ``https://gen.example.com``); None = from
    the request's Host header when it is in ``allowed_hosts``, else the address the client connected
    to (the head's own): a Host header never mints a link to a host it names."""

    allowed_hosts: tuple[str, ...] = ()
    """Host header values (``name``, or ``name:port`` for that port only) that ``url`` links may be
    built from when ``public_base_url`` is unset (a head reached by several names); another Host is
    ignored, not refused. Repeat the flag for several."""

    served_model_name: str | None = None
    """Model id in ``/v1/models`` and the ``model`` field when the head serves one model given as a bare
    backend; None = the model directory's name. (Several models are named by ``serve --model NAME=DIR``.)"""

    model_aliases: tuple[str, ...] = ()
    """Other names a request's ``model`` may use for a served model, each ``ALIAS=MODEL`` (e.g.
    ``gpt-image-1=default``, for clients written for another server); repeat the flag for several.
    ``/v1/models`` lists the served ids; answers name the served model."""

    video_fps: int = 16
    """Frame rate of MP4 outputs; ``seconds`` × fps gives the frame count. Bounds: 1..120."""

    sweep_interval_s: float = 60.0
    """How often expired files and videos are deleted, seconds. Bounds: > 0."""

    max_json_bytes: int = 64 * 1024 * 1024
    """Largest JSON request body in bytes (chat images travel inside it as base64); past it a 413
    before the body is read or held. Multipart uploads have their own limit (max_upload_bytes).
    Bounds: >= 1024."""

    body_read_timeout_s: float = 30.0
    """A client that sends no byte of its body for this long gets 408 (slow or half-open clients).
    Covers reading the body only, never the wait for the answer (``request_timeout_s``). Bounds: > 0."""

    request_timeout_s: float = 7200.0
    """Longest a request may wait for its answer once its body was read: images and edits until
    their images, a stream until its first event, a chat until its answer (a video job is
    answered at once). Past it the request is cancelled and answered 504 naming this limit. The
    default covers the default model's largest image at its step limit on one CPU thread with room
    to spare (``benchmarks/RELIABILITY.md``). Bounds: > 0."""

    media_threads: int = 2
    """Threads that parse large JSON bodies and decode, check and re-encode uploaded images off the
    event loop (one pool per head process), so heartbeats and other requests are still served while
    a 60 MiB body is read. Bounds: >= 1."""

    header_timeout_s: float = 20.0
    """A connection that has not sent a complete request line and headers this long after it opened
    (or after its previous response) is closed (``http_server``): clients that never finish their
    headers do not hold sockets forever. Bounds: > 0."""

    api_keys: tuple[str, ...] = ()
    """Bearer tokens the API accepts (``Authorization: Bearer KEY``, what the OpenAI SDK sends);
    empty = no authentication. ``/health``, ``/metrics`` and ``/v1/files/…`` links (unguessable
    ids, handed out like pre-signed URLs) stay open."""

    tenant_policies: tuple[str, ...] = ()
    """Scheduling policy per API key, each ``NAME:priority=P,min=A,max=B,weight=W`` (parts optional;
    NAME: an API key, its tenant id ``key-...`` as logs and metrics show it, or ``*`` for every key
    without its own): the priority of a request that names none (default 0), the range a request may
    ask for (default -100..100; lower runs sooner) and the key's weight in the fair queue against
    other keys of the same priority (default 1). Repeat the flag for several."""

    slo: tuple[str, ...] = ()
    """Default ``deadline_s`` of a served model's image, edit and video requests, each
    ``MODEL=SECONDS`` (or ``SECONDS``: every model without its own); a request's own ``deadline_s``
    replaces it. A request the head estimates cannot finish in time is refused at once (429 +
    Retry-After), one whose deadline passes before its denoising starts is dropped (504). Empty: no
    deadline but ``request_timeout_s``. Repeat the flag for several models."""

    teacache_profiles_root: Path | None = None
    """TeaCache profiles looked up before each model's own ``teacache/``: ``<root>/<model identity>/``
    (``teacache_profile.profiles_dir_in``) — what ``teacache_threshold: "auto"`` is checked against at
    the door. ``serve`` sets it to the user directory ``triptych calibrate`` writes
    (``$XDG_DATA_HOME/triptych/teacache``); None = the models' own profiles only."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """The adapters requests may name (``serve --lora NAME=DIR``), checked at the head."""

    result_cache_mb: float = 0.0
    """Memory (MiB) of the head's result cache: the output bytes of seeded image and video requests,
    kept so that an exact repeat (same model, adapters, prompt, seed, parameters, tenant, input image)
    is answered from it without any worker running (``triptych.head.result_cache``); least recently
    used results are evicted first. 0 = off. Bounds: >= 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.max_json_bytes < 1024:
            raise ValueError(f"HeadConfig.max_json_bytes={self.max_json_bytes!r}: must be >= 1024")
        for name in ("url_ttl_s", "sweep_interval_s", "body_read_timeout_s", "header_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HeadConfig.{name}={getattr(self, name)!r}: must be > 0")
        if self.video_ttl_s is not None and not self.video_ttl_s > 0:
            raise ValueError(f"HeadConfig.video_ttl_s={self.video_ttl_s!r}: must be > 0 or None (keep forever)")
        if not 0 <= self.result_cache_mb < float("inf"):
            raise ValueError(f"HeadConfig.result_cache_mb={self.result_cache_mb!r}: must be >= 0 (0 = off)")
        if not isinstance(self.media_threads, int) or self.media_threads < 1:
            raise ValueError(f"HeadConfig.media_threads={self.media_threads!r}: must be an integer >= 1")
        if not 1 <= self.video_fps <= 120:
            raise ValueError(f"HeadConfig.video_fps={self.video_fps!r}: must be between 1 and 120")
        if self.public_base_url is not None and not self.public_base_url.startswith(("http://", "https://")):
            raise ValueError(f"HeadConfig.public_base_url={self.public_base_url!r}: must start with http(s)://")
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
        self.aliases()  # raises on a malformed or repeated alias
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
        if any(not h or re.search(r"[\s/@?#]", h) for h in self.allowed_hosts):
            raise ValueError(f"HeadConfig.allowed_hosts={self.allowed_hosts!r}: each must be a host name or host:port")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if any(len(k) < 8 or k != k.strip() for k in self.api_keys):
            raise ValueError("HeadConfig.api_keys: every key must be at least 8 characters, without surrounding spaces")
        object.__setattr__(self, "slo", tuple(self.slo))
        self.slos()  # raises on a malformed one
        object.__setattr__(self, "tenant_policies", tuple(self.tenant_policies))
        self.tenants()  # raises on a malformed policy

    def slos(self) -> dict[str | None, float]:
        """``slo`` as model id (None: every other model) → seconds."""
        out: dict[str | None, float] = {}
        for spec in self.slo:
            model, sep, seconds = spec.rpartition("=")
            name = model.strip() if sep else None
            try:
                value = float(seconds)
            except ValueError:
                value = math.nan
            if (sep and not name) or name in out or not (math.isfinite(value) and 0 < value <= MAX_DEADLINE_S):
                raise ValueError(
                    f"HeadConfig.slo: {spec!r} must be [MODEL=]SECONDS, seconds in (0, {MAX_DEADLINE_S:g}], each model once"
                )
            out[name] = value
        return out

    def tenants(self) -> Tenants:
        """``tenant_policies`` by tenant id."""
        keys = self.api_keys
        return Tenants(self.tenant_policies, keys, {k: tenant_of_key(k.encode()) for k in keys})

    def aliases(self) -> dict[str, str]:
        """``model_aliases`` as alias → served model id."""
        out: dict[str, str] = {}
        for spec in self.model_aliases:
            alias, sep, target = (part.strip() for part in spec.partition("="))
            if not sep or not alias or not target or alias in out:
                raise ValueError(f"HeadConfig.model_aliases: {spec!r} must be ALIAS=MODEL, each alias once")
            out[alias] = target
        return out


class ClientGone(Exception):
    """The client disconnected while its request was running; its jobs were cancelled."""


class DeadlineExceeded(Exception):
    """The request was not answered within ``HeadConfig.request_timeout_s``; its jobs were cancelled."""

    def __init__(self, limit_s: float):
        super().__init__(f"request not answered within {limit_s:g}s")
        self.limit_s = limit_s


#: How often the head measures its event loop's lag (``Head.watch_loop_forever``), seconds.
LOOP_WATCH_S = 0.1

#: Response header carrying a note on the result (e.g. a size the model was not trained at); the same
#: text is in the body's ``warnings`` list.
WARNING_HEADER = "X-Triptych-Warning"


def header_value(notes: list[str]) -> str:
    """Several notes in one ``X-Triptych-Warning`` header (`` | `` between them), ASCII only."""
    return " | ".join(notes).encode("ascii", "replace").decode("ascii")


#: The served model the request being handled was routed to (``Head.backend_for``); read by the error
#: handlers to count the outcome under that model. None before routing.
ROUTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("triptych_routed_model", default=None)

#: The tenant of the request being handled: set by the API-key check, read where the request's
#: parameters are built (it scopes the encoders' mm-hash cache); "" when the server has no keys.
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("triptych_tenant", default="")


def tenant_of_key(key: bytes) -> str:
    """A stable tenant id for an API key: a hash, never the key itself (ids reach logs and workers)."""
    return "key-" + hashlib.sha256(b"triptych tenant\0" + key).hexdigest()[:16]


class Head:
    """Per-app state shared by the routes: the served models, config, file and job stores.

    A route asks ``backend_for(model, job_kind)`` for the model a request goes to (a ``ModelHead``).
    The stores exist between ``open`` and ``close`` (the app's lifespan); routes run only then.
    """

    def __init__(self, backends: Mapping[str, GenerationBackend], config: HeadConfig):
        self.config = config
        self.limits = config.limits
        self.tenants = config.tenants()
        self.models = ServedModels(backends, config.limits, config.aliases(), config.lora, config.data_dir)
        self.slos = config.slos()
        unknown = sorted(m for m in self.slos if m is not None and m not in self.models.by_name)
        if unknown:
            raise ValueError(f"HeadConfig.slo names {unknown}, not served here (served: {sorted(self.models.by_name)})")
        self.unrouted_metrics = Metrics()
        """Outcomes of requests refused before a model was chosen (the ``model=""`` series)."""
        self.loop_metrics = LoopMetrics()
        """The event loop's lag (``watch_loop_forever``)."""
        self.results = ResultCache(int(config.result_cache_mb * (1 << 20)))
        """Outputs of seeded requests, for exact repeats (``HeadConfig.result_cache_mb``)."""
        self.result_keys = ResultKeys()
        self.result_metrics = ResultCacheMetrics(self.results.stats)
        self.files: FileStore | None = None
        self.videos: VideoJobs | None = None

    @property
    def metrics(self) -> Metrics:
        """The collectors of the model the current request was routed to (``backend_for``), else the
        head's own."""
        routed = ROUTED.get()
        return self.models.by_name[routed].backend.metrics if routed else self.unrouted_metrics

    def backend_for(self, model: str | None, job_kind: str) -> ModelHead:
        """The served model a request goes to (``ServedModels.pick``: 404 for an unknown name)."""
        served = self.models.pick(model, job_kind)
        ROUTED.set(served.name)
        return ModelHead(self, served)

    def in_flight(self) -> int:
        return sum(m.admission.in_flight for m in self.models)

    def render_metrics(self) -> bytes:
        """Every model's collectors, each series labelled ``model`` (``""``: refused before routing)."""
        for m in self.models:
            m.backend.metrics.update_from_describe(m.backend.describe(), head_in_flight=m.admission.in_flight)
        by_model = render_labelled({m.name: m.backend.metrics for m in self.models}, unrouted=self.unrouted_metrics)
        return by_model + self.loop_metrics.render() + self.result_metrics.render()

    def base_url(self, request: Request) -> str:
        """Where ``url`` links point (``HeadConfig.public_base_url`` and ``allowed_hosts``)."""
        if self.config.public_base_url:
            return self.config.public_base_url.rstrip("/")
        scheme, root = request.url.scheme, request.scope.get("root_path", "")
        host = request.headers.get("host", "").strip().lower()
        if host and (host in self.config.allowed_hosts or host.rsplit(":", 1)[0] in self.config.allowed_hosts):
            return f"{scheme}://{host}{root}".rstrip("/")
        server = request.scope.get("server")
        if not server or server[1] is None:  # no socket (an in-process ASGI client): its own base
            return str(request.base_url).rstrip("/")
        address = f"[{server[0]}]" if ":" in server[0] else server[0]
        return f"{scheme}://{address}:{server[1]}{root}".rstrip("/")

    async def open(self) -> None:
        from triptych.head.jobs import VideoJobs

        private_dir(self.config.data_dir)
        self.files = FileStore(self.config.data_dir, self.config.url_ttl_s)
        self.videos = VideoJobs(self.config.data_dir, self.config.video_ttl_s)
        models = list(self.models)
        results = await asyncio.gather(*(m.backend.start() for m in models), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # a backend whose start raised has closed what it started
            await asyncio.gather(*(m.backend.close() for m, r in zip(models, results) if r is None))
            raise failed[0]

    async def close(self) -> None:
        if self.videos is not None:
            await self.videos.close()
        for m in self.models:
            await m.backend.close()

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            removed = self.files.sweep() + self.videos.sweep()
            if removed:
                logger.info("removed %d expired files/videos", removed)

    async def watch_loop_forever(self, every_s: float = LOOP_WATCH_S) -> None:
        """Measure the event loop's lag: how much later than asked a sleep of ``every_s`` wakes."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + every_s
            await asyncio.sleep(every_s)
            self.loop_metrics.record_loop_lag(max(0.0, loop.time() - asked))


class ModelHead:
    """The head as a route sees it once the request's model is chosen: that model's backend, family,
    admission counter and metrics beside the head's shared config, limits and stores. Made per
    request by ``Head.backend_for``; holds nothing of its own."""

    def __init__(self, head: Head, served: ServedModel):
        self.head = head
        self.served = served
        self.backend = served.backend
        self.family = served.family
        self.model_id = served.name
        self.admission = served.admission
        self.metrics = served.backend.metrics
        self.config = head.config
        self.limits = head.limits
        self.tenants = head.tenants
        self.slo_s = head.slos.get(self.model_id, head.slos.get(None))
        """This model's default ``deadline_s`` (``HeadConfig.slo``); None: none."""

    @property
    def files(self) -> FileStore:
        return self.head.files

    @property
    def videos(self) -> VideoJobs:
        return self.head.videos

    def base_url(self, request: Request) -> str:
        return self.head.base_url(request)

    @property
    def results(self) -> ResultCache:
        return self.head.results

    @property
    def result_keys(self) -> ResultKeys:
        return self.head.result_keys

    def check_model(self, model: str | None) -> None:
        if model is not None and self.head.models.served_name(model) != self.model_id:
            raise HTTPException(
                404, f"model {shown(model)} is not served here (this request went to {self.model_id!r})"
            )

    def size_warning(self, width: int, height: int) -> str | None:
        """A note when ``width`` x ``height`` is not a size the model was trained at."""
        return self.served.size_warning(width, height)

    def warnings(self, params, edit: bool = False) -> list[str]:
        """The notes on a resolved request: an untrained size, words the model does not know. Each is
        also logged (``triptych.head``), so the server's log says what its answers warned of."""
        notes = [self.size_warning(params.width, params.height), self.served.prompt_warning(params.prompt, edit)]
        notes = [n for n in notes if n]
        for note in notes:
            logger.warning("request to %s: %s", self.model_id, note)
        return notes
