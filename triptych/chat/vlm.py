"""Chat about images with a Qwen2.5-VL model (the understanding path).

``ChatModel`` wraps the encoder's own ``Qwen2_5_VLForConditionalGeneration`` and its processor: the
same weights that encode prompts and edit images for Qwen-Image answer questions about images. Its
vision tower carries the encoder's mm-hash cache (``triptych.mmcache.cache``), so an image first seen by
an edit request and then asked about (or the other way round) runs the tower once, when both paths
hand the processor the same pixels.

Everything goes through transformers: the processor's chat template and image preprocessing,
``generate`` with a ``GenerationConfig``, a ``TextStreamer`` subclass for incremental text and a
``StoppingCriteria`` for cancellation. Sampling is seeded (``torch.random.fork_rng``), so a request
with a seed gets the same answer every time; temperature 0 is greedy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from triptych.chat.params import GREEDY_BELOW, ChatParams, ChatResult, ChatTurn
from triptych.core.errors import InvalidParam
from triptych.mmcache.cache import tenant_scope


class _Pieces(TextStreamer):
    """transformers' TextStreamer, handing each finalised piece of text to a callback instead of print."""

    def __init__(self, tokenizer, on_text: Callable[[str], None], skip_prompt: bool = True):
        super().__init__(tokenizer, skip_prompt=skip_prompt, skip_special_tokens=True)
        self._on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self._on_text(text)


class _Until(StoppingCriteria):
    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop
        self.stopped = False

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        self.stopped = self.stopped or bool(self.should_stop())
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool)


class ChatModel:
    """Answers ``ChatParams`` with a Qwen2.5-VL model and its processor (one request at a time)."""

    def __init__(self, model, processor, chat_template: str | None = None, image_first: bool = False):
        """``image_first``: put a user message's images before its text, keeping each kind's order
        (the shipped default captioner was trained on image-then-question only; see ``ordered``)."""
        self.model = model
        self.image_first = image_first
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.chat_template = chat_template or processor.chat_template or self.tokenizer.chat_template
        if self.chat_template is None:
            raise ValueError("the processor and tokenizer carry no chat template")
        text_config = getattr(model.config, "text_config", model.config)
        self.context = int(text_config.max_position_embeddings)

    def ordered(self, params: ChatParams) -> tuple[ChatTurn, ...]:
        """The turns as the model gets them: unchanged, or with ``image_first`` each user message's
        image parts moved before its text parts (a stable sort: images and texts keep their order)."""
        if not self.image_first:
            return params.turns
        return tuple(
            ChatTurn(t.role, tuple(sorted(t.parts, key=lambda p: not isinstance(p, int)))) if t.role == "user" else t
            for t in params.turns
        )

    def prompt(self, params: ChatParams) -> str:
        messages = [
            {
                "role": t.role,
                "content": [{"type": "image"} if isinstance(p, int) else {"type": "text", "text": p} for p in t.parts],
            }
            for t in self.ordered(params)
        ]
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def inputs(self, params: ChatParams) -> dict[str, torch.Tensor]:
        # The template's image placeholders come in message order; the processor expands them in order.
        order = [p for t in self.ordered(params) for p in t.parts if isinstance(p, int)]
        images = [params.images[i] for i in order] or None
        inputs = self.processor(text=[self.prompt(params)], images=images, return_tensors="pt")
        n = int(inputs["input_ids"].shape[1])
        if n + params.max_tokens > self.context:
            raise InvalidParam(
                "max_tokens",
                params.max_tokens,
                f"the prompt is {n} tokens and prompt + max_tokens must fit "
                f"the model's context of {self.context} tokens",
            )
        return inputs

    def generation_config(self, params: ChatParams):
        config = copy.deepcopy(self.model.generation_config)
        # NOTE: below GREEDY_BELOW the answer is greedy (as vLLM does): logits / 5e-324 overflow to inf
        # and sampling would raise (found by the schema fuzzer); the distribution is one-hot anyway.
        sample = params.temperature >= GREEDY_BELOW
        config.update(
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens if params.ignore_eos else None,
            do_sample=sample,
            num_beams=1,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=None,
            repetition_penalty=None,
        )
        if config.eos_token_id is None:
            config.eos_token_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id or config.eos_token_id
        return config

    @torch.no_grad()
    def run(
        self,
        params: ChatParams,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> ChatResult:
        """Answer the last user message. ``on_text`` gets each piece of the answer as it is decoded;
        ``should_stop`` is polled after every token (a cancelled request stops at the next one)."""
        with tenant_scope(params.tenant):  # the vision tower's mm-hash cache is scoped by who asks
            return self._run(params, on_text, should_stop)

    def _run(self, params: ChatParams, on_text, should_stop) -> ChatResult:
        inputs = self.inputs(params).to(self.model.device)
        config = self.generation_config(params)
        until = _Until(should_stop or (lambda: False))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            streamer = None if on_text is None else _Pieces(self.tokenizer, on_text)
            out = self.model.generate(
                **inputs, generation_config=config, streamer=streamer, stopping_criteria=StoppingCriteriaList([until])
            )
        prompt_tokens = int(inputs["input_ids"].shape[1])
        new = out[0, prompt_tokens:]
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        if until.stopped:
            reason = "cancelled"
        elif len(new) and int(new[-1]) in eos:
            reason = "stop"
        else:
            reason = "length"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return ChatResult(text, prompt_tokens, int(len(new)), reason)
