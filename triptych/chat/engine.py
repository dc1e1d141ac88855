"""The built-in chat engine: continuous batching of chat decoding on one model.

Every running chat advances in one model forward per token, and a step runs one forward whoever
joins: ``step()`` admits waiting chats into free slots, then runs the next chunks of the admitted
chats' prompts (vision encode and prefill within the step's time budget, ``chat.chunks``, so a long
multimodal prompt spreads over several steps; a prefix-cache hit makes a row start after its reused
tokens) and the next token of every running chat (``KVBatch``: their caches left-padded into one batch, an
attention mask over the padding, explicit per-row rope positions) in one forward (``prefill`` with
``Decode`` rows: mixed prefill and decode), and picks each chat's next token with its own
``Sampler``. A step with only prefill work or only decode work runs that alone. Chats join and leave between tokens: at most
``max_running_chats`` run, the rest wait in arrival order; a finished or cancelled chat's rows are
dropped from the batch (its KV freed) before the next forward.

A greedy answer is the one ``ChatModel.run`` (transformers' ``generate``, one chat at a time) gives:
the padded rows are masked out and positions never depend on the batch, so a row's logits differ
from its alone-run only by float rounding of the batched matmuls (tests hold the tokens equal).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from triptych.chat.budget import StepCosts
from triptych.chat.chunks import item_chunks, timed_chunks, tower_batch
from triptych.chat.config import ChatEngineConfig
from triptych.chat.kvbatch import KV, KVBatch, layers_of
from triptych.chat.params import ChatParams, ChatResult
from triptych.chat.prefill import Decode, Row, prefill
from triptych.chat.prefix import Entry, PrefixCache
from triptych.chat.prompt import Prompt, build_prompt, chunk_embeddings
from triptych.chat.sampler import Sampler, pick
from triptych.chat.stats import ChatEngineStats
from triptych.chat.timing import ChatTiming
from triptych.chat.tower import Towers, VisionThread, batch_towers, collect_towers, start_towers
from triptych.chat.vlm import ChatModel, _Pieces
from triptych.mmcache.cache import tenant_scope

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Chat:
    """One request in the engine. The caller drains ``pieces`` (streamed text) after each step;
    ``result`` or ``error`` is set when it ends (``done``)."""

    id: Hashable
    params: ChatParams
    stream: bool
    pieces: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    result: ChatResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    prompt: Prompt | None = None
    sampler: Sampler | None = None
    next_position: int = 0
    prefilled: int = 0  # prompt tokens whose KV ``kv`` holds (while prefilling)
    kv: KV | None = None  # the prompt KV so far, while prefilling (then it moves to the batch)
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # images' tower outputs, while prefilling
    prefix: Entry | None = None  # the prefix-cache entry this chat holds
    eos: tuple[int, ...] = ()  # tokens that end the answer (none with ignore_eos)
    pending: Future | None = None  # its prompt, being built on the engine's prompt thread
    towers: Towers | None = None  # its images' tower call on the vision thread, while in flight
    received: float = field(default_factory=time.perf_counter)  # when it was taken (``ChatTiming``'s zero)
    layer_vision_s: float = 0.0  # vision time spent on its images before it joined (the encoder layer's)
    vision_s: float = 0.0  # its chunks' embeddings (the vision tower on images no earlier step encoded)
    prefill_s: float = 0.0  # the prefill forwards its chunks ran in
    prefill_start: float | None = None  # when its first chunk began
    first_token_at: float | None = None
    _streamer: _Pieces | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class ChatEngine:
    """Owns its chats' KV; the caller calls ``step()`` and ``build_next()`` on one thread (the model
    is not shared with another thread during a step).

    A chat's prompt (the processor and its rope positions) submitted while chats decode is built on
    the engine's prompt thread, so a joiner with 8 images does not hold their next token for its
    processor. One submitted while none decodes is built on the caller's thread (``build_next``, or
    at admission): nobody waits for it there, and a second thread would only contend with the
    caller for the GIL (on a busy 2-core machine that cost more than the builds).

    With ``step_time_budget`` > 0 a step beside decoding chats admits vision and prefill by their
    estimated seconds (``costs``, learnt from this engine's own forwards), within
    ``step_budget_s()``; until a decode forward has been measured, such a step decodes alone
    (once) to measure it. The first prefilling chat progresses every step (``chat.chunks``).

    With ``vision_thread`` a chat's images run through the tower on the engine's vision thread
    (``chat.tower``, one call per chat) from its admission on, while the steps go on; its chunks
    take an image once its embeddings are in, and a step with no chat decoding waits for them."""

    def __init__(self, chat: ChatModel, config: ChatEngineConfig = ChatEngineConfig(), costs: StepCosts | None = None):
        """``costs``: the cost model to estimate and learn with (a test passes a fixed one)."""
        self.chat = chat
        self.model = chat.model
        self.config = config
        self.costs = StepCosts() if costs is None else costs
        self.stats = ChatEngineStats()
        self.prefix = PrefixCache(config.prefix_cache_bytes, self.stats) if config.prefix_cache_bytes > 0 else None
        self.waiting: deque[Chat] = deque()
        self.prefilling: list[Chat] = []  # admitted, their prompt KV being computed chunk by chunk
        self.running: list[Chat] = []  # row i of the batch is running[i]
        self.batch = KVBatch(self.model.config)
        self._preparer: ThreadPoolExecutor | None = None
        self._vision = VisionThread(self.model) if config.vision_thread else None
        #: model forwards run (a mixed one counts once here, but in both prefill_forwards and
        #: decode_forwards of ``stats``)
        self.forwards = 0

    def submit(
        self,
        chat_id: Hashable,
        params: ChatParams,
        stream: bool = False,
        received: float | None = None,
        layer_vision_s: float = 0.0,
    ) -> Chat:
        """``received``: when the caller took it (``time.perf_counter``; None: now), the zero of its
        ``ChatTiming``; ``layer_vision_s``: the vision time its images took since then outside the engine."""
        chat = Chat(chat_id, params, stream, layer_vision_s=layer_vision_s)
        if received is not None:
            chat.received = received
        if self.running:
            if self._preparer is None:
                self._preparer = ThreadPoolExecutor(1, thread_name_prefix="chat-prompt")
            chat.pending = self._preparer.submit(self._build, chat)
        self.waiting.append(chat)
        return chat

    def build_next(self) -> bool:
        """Build the prompt of the first waiting chat that the next step would admit and that has
        none yet (False: there is none). A caller that takes new chats between calls (the encoder's
        loop) builds this way while no chat decodes, so the chats that arrive while the first
        prompts build prefill with them, in the same first forward."""
        free = self.config.max_running_chats - len(self.running) - len(self.prefilling)
        admitted = (c for _, c in zip(range(free), self.waiting))  # those the next step admits
        chat = next((c for c in admitted if c.prompt is None and c.error is None and c.pending is None), None)
        if chat is None:
            return False
        self._build(chat)
        return True

    def _build(self, chat: Chat) -> None:
        """The processor (chat template, image preprocessing) and rope positions; a failure is the
        chat's error (InvalidParam is a ValueError: the user's)."""
        try:
            chat.prompt = build_prompt(self.model, self.chat.inputs(chat.params), chat.params.tenant)
        except (ValueError, RuntimeError) as e:
            chat.error = e

    def cancel(self, chat_id: Hashable) -> None:
        """The chat leaves at the next step (``finish_reason`` cancelled), its KV freed."""
        for chat in (*self.waiting, *self.prefilling, *self.running):
            if chat.id == chat_id:
                chat.cancelled = True

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.prefilling) or bool(self.running)

    def snapshot(self) -> ChatEngineStats:
        if self.prefix is not None:
            self.prefix.snapshot()
        return ChatEngineStats(**{f: getattr(self.stats, f) for f in self.stats.__struct_fields__})

    def step_budget_s(self) -> float | None:
        """Seconds a step may spend on vision and prefill beside the running chats' decode (the
        config's multiple of the decode estimate); None when nothing bounds it by time (no chat
        decodes, or admission by item counts) and infinite while the decode is unmeasured."""
        if not self.running or self.config.step_time_budget == 0:
            return None
        return self.config.step_time_budget * self.costs.estimate("decode")

    @torch.no_grad()
    def step(self, spent_s: float = 0.0) -> list[Chat]:
        """Admit waiting chats while slots are free, then run one forward over the prefilling
        chats' next chunks (within the step's budget) and the next token of all running chats.
        ``spent_s``: vision time the caller already spent for this step (the encoder layer's),
        taken off its time budget. Returns the chats that produced text or ended in this step
        (ended ones are gone); a chat that finishes its prefill here decodes from the next step."""
        touched, built = self._drop_cancelled(), 0
        while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_running_chats:
            first = self.waiting[0]
            if first.pending is not None and not first.pending.done():
                if self.running:
                    break  # its prompt is still being built: the running chats go on
                first.pending.result()  # none decodes: wait for it
            unbuilt = first.prompt is None and first.error is None
            if unbuilt and self.running and built:
                break  # one prompt build per step on this thread while chats decode
            built += unbuilt
            chat = self.waiting.popleft()
            if self._prepare(chat):
                self.prefilling.append(chat)
                start_towers(self._vision, chat)
            else:
                touched.append(chat)
        for chat, error in collect_towers(self.prefilling, self.costs, wait=not self.running):
            self._fail_prefill(chat, error)  # its images' call failed: it fails alone
            touched.append(chat)
        if self.running and self.prefilling and not self._measuring():
            touched += self._mixed_step(spent_s)
        elif self.running:
            touched += self._decode()  # with prefilling chats: the step that measures the decode
        elif self.prefilling:
            touched += self._prefill_step()
        return touched

    def _measuring(self) -> bool:
        """Whether the time budget waits for its first decode measurement (one decode-only step)."""
        return self.config.step_time_budget > 0 and not self.costs.known("decode")

    # ---- scheduling -----------------------------------------------------------------------------
    def _drop_cancelled(self) -> list[Chat]:
        gone = [c for c in (*self.waiting, *self.prefilling) if c.cancelled]
        for chat in gone:
            (self.waiting if chat in self.waiting else self.prefilling).remove(chat)
            chat.kv, chat.features, chat.towers = None, {}, None  # a tower call in flight is dropped
            self._end(chat, "cancelled")
        left = [c for c in self.running if c.cancelled]
        for chat in left:
            self._end(chat, "cancelled")
        if left:
            self._keep_unfinished()
        return gone + left

    def _keep_unfinished(self) -> None:
        rows = [i for i, c in enumerate(self.running) if not c.done]
        self.batch.keep(rows)
        self.running = [self.running[i] for i in rows]

    def _prepare(self, chat: Chat) -> bool:
        """The chat's prompt (the processor) and its prefix-cache hit; False when it failed."""
        chat.kv, chat.features, chat.prefilled = None, {}, 0
        if chat.prompt is None and chat.error is None:
            self._build(chat)
        if chat.error is not None:
            return False
        prompt = chat.prompt
        if self.prefix is not None:
            entry, reuse = self.prefix.longest(prompt.key)
            reuse = min(reuse, len(prompt) - 1)  # the last prompt token runs: its logits pick the first
            if entry is not None and reuse > 0:
                self.prefix.acquire(entry)
                chat.prefix = entry
                chat.kv = [(k[:, :, :reuse], v[:, :, :reuse]) for k, v in entry.kv]  # views; never written
                chat.prefilled = reuse
                self.stats.prefill_reused += reuse
        return True

    def _chunks(self, spent_s: float) -> list[tuple[Chat, int]]:
        """The prefilling chats of this step and the end of each one's chunk, in admission order
        (``chat.chunks``; the first one always gets a chunk). With no chat decoding nobody waits
        for the prefill: the admitted prompts prefill whole, in one forward."""
        config = self.config
        budget = self.step_budget_s()
        if not self.running:
            return [(chat, len(chat.prompt)) for chat in self.prefilling]
        if budget is None:
            return item_chunks(self.prefilling, config.prefill_tokens_per_step, config.prefill_images_per_step)
        return timed_chunks(self.prefilling, budget - spent_s, self.costs, config.prefill_tokens_per_step)

    def _prefill_rows(self, spent_s: float = 0.0) -> tuple[list[tuple[Chat, int]], list[Row], list[Chat]]:
        """This step's chunks and their rows; a chat whose images fail here fails alone (touched)."""
        chunks, rows, touched = [], [], []
        planned = self._chunks(spent_s)
        budget = self.step_budget_s()
        if budget is not None and self._vision is None:
            batch_towers(
                self.model,
                self.costs,
                tower_batch(self.prefilling, planned, self.costs, budget - spent_s, self.config.vision_call_stretch),
            )
        for chat, end in planned:
            start = time.perf_counter()
            if chat.prefill_start is None:
                chat.prefill_start = start
            run = [
                t1 - t0
                for j, (t0, t1, _, _) in enumerate(chat.prompt.images)
                if t1 > chat.prefilled and t0 < end and j not in chat.features
            ]  # the images chunk_embeddings runs the tower on, one call each
            try:
                with tenant_scope(chat.params.tenant):  # the vision tower's mm-hash cache is scoped by who asks
                    embeds = chunk_embeddings(self.model, chat.prompt, chat.prefilled, end, chat.features)
                seconds = time.perf_counter() - start
                chat.vision_s += seconds
                self.costs.observe("vision", sum(run), seconds, calls=len(run))
            except (ValueError, RuntimeError) as e:  # this chat's images: it fails alone
                self._fail_prefill(chat, e)
                touched.append(chat)
                continue
            chunks.append((chat, end))
            rows.append(Row(embeds, chat.prompt.positions[:, chat.prefilled : end], chat.kv))
        return chunks, rows, touched

    def _prefill_step(self) -> list[Chat]:
        chunks, rows, touched = self._prefill_rows()
        return touched + (self._prefill_forward(chunks, rows) if rows else [])

    def _prefill_forward(self, chunks: list[tuple[Chat, int]], rows: list[Row]) -> list[Chat]:
        start = time.perf_counter()
        try:
            kvs, logits, _ = prefill(self.model, rows)
        except (ValueError, RuntimeError) as e:
            logger.exception("a batched prefill of %d chats failed; they fail", len(rows))
            for chat, _ in chunks:
                self._fail_prefill(chat, e)
            return [c for c, _ in chunks]
        self.forwards += 1
        seconds = time.perf_counter() - start
        self.costs.observe("prefill", sum(end - chat.prefilled for chat, end in chunks), seconds)
        return self._prefilled(chunks, kvs, logits, seconds)

    def _prefilled(
        self, chunks: list[tuple[Chat, int]], kvs: list[KV], logits: torch.Tensor, seconds: float
    ) -> list[Chat]:
        """``seconds``: the forward's wall time, each chunk's chat's prefill time."""
        self.stats.prefill_forwards += 1
        self.stats.prefill_rows += len(chunks)
        touched = []
        for i, (chat, end) in enumerate(chunks):
            chat.prefill_s += seconds
            self.stats.prefill_computed += end - chat.prefilled
            chat.kv, chat.prefilled = kvs[i], end
            if end == len(chat.prompt):
                self.prefilling.remove(chat)
                self._start(chat, logits[i])
                touched.append(chat)
        return touched

    def _mixed_step(self, spent_s: float) -> list[Chat]:
        """The prefill chunks and the running chats' next tokens in one forward (``prefill`` with
        ``Decode`` rows): one forward per step whoever joins. If that forward fails, the two parts
        run apart so that each fails (or not) on its own. The forward's time less the decode
        estimate is the chunks' prefill time (``costs``)."""
        chunks, rows, touched = self._prefill_rows(spent_s)
        if not rows:
            return touched + self._decode()
        running, device = self.running, self.model.device
        ids = torch.tensor([c.tokens[-1] for c in running], device=device)
        decode = Decode(
            layers_of(self.batch.cache),
            self.batch.mask,
            self.model.get_input_embeddings()(ids),
            torch.tensor([c.next_position for c in running]).view(1, -1).expand(3, -1),
        )
        start = time.perf_counter()
        try:
            kvs, logits, stepped = prefill(self.model, rows, decode)
        except (ValueError, RuntimeError):
            logger.exception("a mixed forward (%d prefill rows, %d decode rows) failed", len(rows), len(running))
            touched += self._prefill_forward(chunks, rows)
            return touched + (self._decode() if self.running else [])
        self.forwards += 1
        self.batch.stepped(stepped)
        seconds = time.perf_counter() - start
        decode_s = self.costs.estimate("decode") if self.costs.known("decode") else 0.0
        tokens = sum(end - chat.prefilled for chat, end in chunks)
        self.costs.observe("prefill", tokens, seconds - decode_s)
        touched += self._decoded(logits[: len(running)])  # before the joiners take their rows
        return touched + self._prefilled(chunks, kvs, logits[len(running) :], seconds)

    def _fail_prefill(self, chat: Chat, error: BaseException) -> None:
        self.prefilling.remove(chat)
        chat.error, chat.kv, chat.features = error, None, {}
        self._release(chat)

    def _start(self, chat: Chat, logits: torch.Tensor) -> None:
        """The prompt is prefilled: store its KV, pick the first token, join the decode batch."""
        kv, chat.kv, chat.features = chat.kv, None, {}
        if self.prefix is not None:
            self.prefix.put(chat.prompt.key, kv)
        params = chat.params
        config = self.chat.generation_config(params)
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        chat.eos = () if params.ignore_eos else tuple(eos)
        chat.sampler = Sampler(params, eos, self.model.device)
        if chat.stream:
            chat._streamer = _Pieces(self.chat.tokenizer, chat.pieces.append, skip_prompt=False)
        chat.next_position = chat.prompt.next_position
        self._emit(chat, chat.sampler(logits))
        if not chat.done:
            self.running.append(chat)
            self.batch.join(kv)
            self.stats.max_batch = max(self.stats.max_batch, len(self.running))

    def _prefill(self, chat: Chat):
        """A whole prompt's prefill alone (tests compare its logits): its KV and last logits."""
        if not self._prepare(chat):
            raise chat.error
        with tenant_scope(chat.params.tenant):
            embeds = chunk_embeddings(self.model, chat.prompt, chat.prefilled, len(chat.prompt), chat.features)
        kvs, logits, _ = prefill(self.model, [Row(embeds, chat.prompt.positions[:, chat.prefilled :], chat.kv)])
        self.stats.prefill_forwards += 1
        self.stats.prefill_rows += 1
        self.stats.prefill_computed += len(chat.prompt) - chat.prefilled
        return kvs[0], logits[0]

    def _decode(self) -> list[Chat]:
        running = self.running
        device = self.model.device
        ids = torch.tensor([[c.tokens[-1]] for c in running], device=device)
        positions = torch.tensor([c.next_position for c in running], device=device).view(1, -1, 1).expand(3, -1, 1)
        start = time.perf_counter()
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self.batch.step_mask().to(device),
                position_ids=positions,
                cache=self.batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except (ValueError, RuntimeError) as e:
            logger.exception("a batched chat decode step failed; its %d chats fail", len(running))
            for chat in running:
                chat.error = e
                self._release(chat)
            self._keep_unfinished()
            return running
        self.forwards += 1
        self.costs.observe("decode", 1, time.perf_counter() - start)
        self.batch.appended()
        return self._decoded(out.logits[:, -1])

    def _decoded(self, logits: torch.Tensor) -> list[Chat]:
        """Each running chat's next token from its row of ``logits``; the finished ones leave."""
        running = self.running
        self.stats.decode_forwards += 1
        self.stats.decode_tokens += len(running)
        for chat, token in zip(running, pick([c.sampler for c in running], logits)):
            chat.next_position += 1
            self._emit(chat, token)
        self._keep_unfinished()
        return list(running)

    # ---- tokens out -----------------------------------------------------------------------------
    def _emit(self, chat: Chat, token: int) -> None:
        chat.tokens.append(token)
        if chat.first_token_at is None:
            chat.first_token_at = time.perf_counter()
        if chat._streamer is not None:
            chat._streamer.put(torch.tensor([token]))
        if token in chat.eos:
            self._end(chat, "stop")
        elif len(chat.tokens) >= chat.params.max_tokens:
            self._end(chat, "length")

    def _end(self, chat: Chat, reason: str) -> None:
        if chat._streamer is not None:
            chat._streamer.end()
        text = self.chat.tokenizer.decode(chat.tokens, skip_special_tokens=True)
        prompt = 0 if chat.prompt is None else len(chat.prompt)
        chat.result = ChatResult(text, prompt, len(chat.tokens), reason, _timing(chat))
        self._release(chat)

    def _release(self, chat: Chat) -> None:
        if chat.prefix is not None and self.prefix is not None:
            self.prefix.release(chat.prefix)
            chat.prefix = None


def _timing(chat: Chat) -> ChatTiming | None:
    """Its stage times, once it has a first token (None before: it never got that far)."""
    if chat.first_token_at is None or chat.prefill_start is None:
        return None
    return ChatTiming(
        queue_s=max(0.0, chat.prefill_start - chat.received - chat.layer_vision_s),
        vision_s=chat.layer_vision_s + chat.vision_s,
        prefill_s=chat.prefill_s,
        first_token_s=chat.first_token_at - chat.received,
        total_s=time.perf_counter() - chat.received,
    )
