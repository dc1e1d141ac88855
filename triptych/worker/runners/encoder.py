"""The encoder's stage: encode, hold the conditioning, push it to the denoiser the head names; and
answer chats on the encoder's own VLM (the text encoder of Qwen-Image families is a Qwen2.5-VL)."""

from __future__ import annotations

import time

import torch

from triptych.chat.budget import StepCosts
from triptych.chat.config import ChatEngineConfig
from triptych.control import protocol as P
from triptych.control import wire
from triptych.control.mm_hints import MMImage
from triptych.core.errors import TriptychError
from triptych.mmcache.cache import tenant_scope
from triptych.mmcache.layer import encoder_layer
from triptych.transfer.refs import TensorSpec
from triptych.transfer.staging import to_host
from triptych.worker.runners.base import Job, StageRunner, owned, specs_of


class EncoderRunner(StageRunner):
    """Encodes run in arrival order. Chats run in the chat engine (``chat.engine``): one
    engine step (every running chat advances one token, in one forward) per ``execute()``, taking
    turns with encodes while both have work, so an image request never waits for a long answer and
    a burst of encodes holds the chats back by one encode per token at most.

    Every ``execute()`` first lets the encoder layer (``mmcache.layer``) encode the images of the
    requests taken so far, within its per-step budget, as one batched vision forward; an encode
    runs, and a chat joins the engine, once its images are in. While chats decode, that budget is
    also the engine's step time budget (``ChatEngine.step_budget_s``): the layer's images fit it by
    their estimated time (``layer_costs``) and the engine's chunks get what the layer left. While no chat decodes, an
    ``execute()`` builds one waiting chat's prompt and returns (the loop takes the tasks that
    arrived meanwhile), so chats that arrive together prefill together in the first forward. A job holds its layer entries from
    ``take`` until it finishes, fails or is aborted (``_release``).

    With a remote LLM engine (``chat_engine``, vLLM) the chats go to ``RemoteChats`` instead: their
    images join the same layer (the same batched forward), every chat whose images are in is sent at
    the same step, and the engine decodes."""

    stage = "encode"
    tasks = (P.EncodeTask, P.ChatTask)

    def __init__(self, family, port, chat_config: ChatEngineConfig = ChatEngineConfig(), chat_engine=None):
        """``chat_engine``: a remote LLM engine (``triptych.vllm_chat.engine.VllmChatEngine``) that
        answers the chats; None: the built-in batched engine (``chat_config``)."""
        super().__init__(family, port)
        self.layer = encoder_layer(family)
        self.remote = None
        if chat_engine is not None:  # imported here: a worker without vLLM does not load httpx
            from triptych.worker.runners.remote_chat import RemoteChats

            self.remote = RemoteChats(family, port, chat_engine, self.layer)
        self.chat_config = chat_config
        self.engine = None  # the ChatEngine, built at the first chat
        self.chats: dict[tuple[str, int], Job] = {}  # engine chat id -> job, for the chats held
        self.waiting: dict[tuple[str, int], tuple[Job, object]] = {}  # chats whose images are not in yet
        self._chat_turn = False  # the next execute() is the chats' when encodes wait too
        self.layer_costs = StepCosts()  # the encoder layer's tower seconds per vision token

    def take(self, task) -> None:
        if not isinstance(task, P.ChatTask):
            job = self.new_job(task, wire.params_from_wire(task.params))
            self.enqueue(job)
            return self._hold_images(job, job.params)
        job = self.new_job(task, None)
        if self.remote is not None:
            return self.remote.take(job)
        if self._chat_engine() is None:
            return self.port.fail(
                job, TriptychError(f"{self.port.instance_id} has no VLM to chat with"), retryable=False
            )
        try:
            params = wire.chat_from_wire(task)
        except (ValueError, OSError) as e:  # an image that does not decode (the head checked it)
            return self.port.fail(job, TriptychError(f"the chat's images do not decode: {e}"), retryable=False)
        self.waiting[(job.request_id, job.generation)] = (job, params)
        self._hold_images(job, params)

    def has_work(self) -> bool:
        engine = self.engine is not None and self.engine.has_work()
        return bool(self.ready) or bool(self.waiting) or engine or (self.remote is not None and self.remote.has_work())

    def execute(self) -> None:
        spent = 0.0
        if self.layer is not None:
            budget = None if self.engine is None else self.engine.step_budget_s()
            start = time.perf_counter()
            self.layer.step(budget, self.layer_costs, self.chat_config.vision_call_stretch)
            spent = time.perf_counter() - start
        if self.remote is not None and self.remote.has_work():
            self.remote.step()  # hands on the engine's answers, sends the chats whose images are in
        self._admit_chats()
        chats = self.engine is not None and self.engine.has_work()
        job = next((j for j in self.ready if self._vision_ready(j)), None)
        if job is not None and not (chats and self._chat_turn):
            self._chat_turn = True
            self.ready.remove(job)
            return self.run(job)
        self._chat_turn = False
        if chats:
            self._chat_step(spent)

    def run(self, job: Job) -> None:
        try:
            super().run(job)
        finally:  # the encode is over: its embeddings are no longer needed by it
            self._release(job)

    def compute(self, job: Job) -> None:
        with torch.no_grad(), tenant_scope(job.params.tenant):
            cond = self.family.encode(job.params)
        self.count_flops(cond)
        job.outgoing = to_host(owned(cond.flat()))
        specs = specs_of(job.outgoing)
        self.port.send(
            P.EncodeDone(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=self.port.instance_id,
                specs=specs,
                images=self._held_images(job),
            )
        )

    def abort(self, job: Job) -> None:
        super().abort(job)
        self._release(job)
        if self.remote is not None and self.remote.abort(job):
            return
        key = (job.request_id, job.generation)
        self.waiting.pop(key, None)
        if self.chats.pop(key, None) is not None:
            self.engine.cancel(key)  # it leaves the batch at the next step, its KV freed

    def close(self) -> None:
        """A shutdown fails the running answers as retryable (another encoder answers them)."""
        if self.remote is not None:
            self.remote.close()
        chats, self.chats = self.chats, {}
        waiting, self.waiting = self.waiting, {}
        for key in chats:
            self.engine.cancel(key)
        for job in [*chats.values(), *(job for job, _ in waiting.values())]:
            self._release(job)
            self.port.fail(job, TriptychError(f"{self.port.instance_id} is shutting down"), retryable=True)

    def cache_stats(self):
        cache = getattr(self.family, "mm_cache", None)
        return None if cache is None else cache.snapshot()

    def chat_stats(self):
        return None if self.engine is None else self.engine.snapshot()

    # ---- the encoder layer ------------------------------------------------------------------------
    def _hold_images(self, job: Job, params) -> None:
        if self.layer is not None:
            self.layer.add(holder(job), params.tenant, self.family.vision_images(params))
            remote = self.layer.cache.remote
            if remote is not None and job.task.mm_hints:
                remote.hint(holder(job), params.tenant, job.task.mm_hints)

    def _held_images(self, job: Job) -> tuple[MMImage, ...]:
        """The embeddings the job's images have here, for the head's affinity (cross-encoder hits)."""
        if self.layer is None:
            return ()
        return tuple(MMImage(mm_hash=key, spec=TensorSpec.of(t)) for key, t in self.layer.held(holder(job)))

    def _vision_ready(self, job: Job) -> bool:
        return self.layer is None or self.layer.ready(holder(job))

    def _release(self, job: Job) -> None:
        if self.layer is not None:
            self.layer.release(holder(job))
            if self.layer.cache.remote is not None:
                self.layer.cache.remote.forget(holder(job))

    # ---- chat -----------------------------------------------------------------------------------
    def _chat_engine(self):
        if self.engine is None:
            model = self.family.chat_model()
            if model is None:
                return None
            from triptych.chat.engine import ChatEngine

            self.engine = ChatEngine(model, self.chat_config)
        return self.engine

    def _admit_chats(self) -> None:
        """Chats whose images the layer holds join the engine (in arrival order)."""
        for key, (job, params) in list(self.waiting.items()):
            if self._vision_ready(job):
                del self.waiting[key]
                self.chats[key] = job
                vision_s = 0.0 if self.layer is None else self.layer.seconds(holder(job))
                self.engine.submit(key, params, job.task.stream, job.received, vision_s)

    def _chat_step(self, spent_s: float = 0.0) -> None:
        """``spent_s``: the encoder layer's vision time in this ``execute()`` (off the step's budget)."""
        port = self.port
        if port.stopping():
            for key in self.chats:
                self.engine.cancel(key)
        elif not self.engine.running and self.engine.build_next():
            return  # none decodes: the chats taken before the next execute() join the first forward
        for chat in self.engine.step(spent_s):
            job = self.chats.get(chat.id)
            if job is None:  # aborted: nothing more goes to the head
                continue
            for text in chat.pieces:
                port.send(
                    P.ChatDelta(
                        request_id=job.request_id, generation=job.generation, instance_id=port.instance_id, text=text
                    )
                )
            chat.pieces.clear()
            if chat.done:
                del self.chats[chat.id]
                images = self._held_images(job)
                self._release(job)
                self._chat_end(job, chat, images)

    def _chat_end(self, job: Job, chat, images: tuple[MMImage, ...] = ()) -> None:
        port = self.port
        if chat.error is not None:
            return port.fail(job, chat.error, retryable=False)
        result = chat.result
        if result.finish_reason == "cancelled":  # stopped by a shutdown (a head's cancel aborts the job)
            return port.fail(job, TriptychError(f"{port.instance_id} is shutting down"), retryable=True)
        port.finish(job)
        port.send(
            P.ChatDone(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=port.instance_id,
                text=result.text,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                finish_reason=result.finish_reason,
                images=images,
                timing=result.timing,
            )
        )


def holder(job: Job) -> str:
    """The id a job holds encoder-layer entries under (a newer generation is another holder)."""
    return f"{job.request_id}#{job.generation}"
