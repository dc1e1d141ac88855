"""Qwen2-style byte-level BPE tokenizer trained in-process, for tiny Qwen-Image checkpoints.

The pipelines drop a fixed number of leading tokens (``prompt_template_encode_start_idx``: 34 for
text-to-image, 64 for edit) from the encoder's hidden states: the system prompt of their chat
template. A tokenizer only matches that if every template word is one token, so the templates are
part of the training corpus and ``train_qwen_tokenizer`` checks the prefix lengths before returning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from triptych.families.tiny.tokenizers import BASE_CORPUS

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Appended after the learned vocabulary in Qwen2's order (<|endoftext|> = first special id).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The prompt templates of QwenImagePipeline / QwenImageEditPipeline (diffusers 0.42.1) and the
# number of tokens each pipeline drops: the prefix up to the user turn.
T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# template → (prefix whose token count must equal drop_idx, drop_idx)
DROP_PREFIXES = {
    T2I_TEMPLATE: (T2I_TEMPLATE.split("{}")[0], 34),
    EDIT_TEMPLATE: (EDIT_TEMPLATE.split("<|vision_start|>")[0], 64),
}


def _pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _training_corpus(extra: Iterable[str]) -> list[str]:
    prompts = list(BASE_CORPUS) + list(extra)
    texts = [t.format(p) for t in DROP_PREFIXES for p in prompts] + prompts
    for special in QWEN_SPECIAL_TOKENS:  # specials are appended whole, never learned from pieces
        texts = [t.replace(special, "\n") for t in texts]
    return texts


def train_qwen_tokenizer(vocab_size: int = 2000, extra_corpus: Iterable[str] = (), model_max_length: int = 32768):
    """A ``transformers.Qwen2Tokenizer`` whose template prefixes tokenize to the pipelines' ``drop_idx``.

    Deterministic for a given corpus. ``extra_corpus`` adds prompts (e.g. a procedural world's
    vocabulary) so they tokenize into whole words.
    """
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(extra_corpus), trainer=trainer)
    vocab = dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1]))
    for special in QWEN_SPECIAL_TOKENS:
        vocab.setdefault(special, len(vocab))
    raw_merges = json.loads(tok.model.__getstate__())["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in raw_merges]
    qwen = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    qwen.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS], special_tokens=True)
    check_drop_prefixes(qwen)
    return qwen


def check_drop_prefixes(tokenizer) -> None:
    """Raise if a template prefix does not tokenize to the number of tokens its pipeline drops."""
    for prefix, drop_idx in DROP_PREFIXES.values():
        n = len(tokenizer(prefix)["input_ids"])
        if n != drop_idx:
            raise ValueError(f"template prefix tokenizes to {n} tokens, the pipeline drops {drop_idx}: {prefix!r}")
