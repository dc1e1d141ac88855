"""Tokenizers trained in-process, so tiny models need no files from a hub.

Each builder trains on a small fixed corpus (deterministic) and returns a transformers tokenizer of
the class the real checkpoint uses, so ``save_pretrained`` → ``from_pretrained`` round-trips offline.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

BASE_CORPUS: tuple[str, ...] = (
    "a photo of a cat sitting on a red chair",
    "a small blue circle on a white background",
    "a large green square at the left on a black background",
    "a yellow triangle at the top on a purple background",
    "an orange star in the centre on a cyan background",
    "a painting of a mountain lake at sunset, highly detailed",
    "a dog running through the snow in a forest",
    "make the circle green, change the background to yellow",
    "low quality, blurry, distorted, watermark, text",
    "the quick brown fox jumps over the lazy dog 0123456789",
)


def _corpus(extra: Iterable[str]) -> list[str]:
    return list(BASE_CORPUS) + list(extra)


def train_clip_tokenizer(vocab_size: int = 1000, extra_corpus: Iterable[str] = (), model_max_length: int = 77):
    """Byte-level BPE with CLIP's ``</w>`` suffix, wrapped in ``transformers.CLIPTokenizer``."""
    from transformers import CLIPTokenizer

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|startoftext|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(extra_corpus), trainer=trainer)
    model = tok.model
    vocab = dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1]))
    # CLIP's vocabulary also holds every byte symbol with the end-of-word suffix.
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = _bpe_merges(model)
    for special in specials:  # special tokens last, as in CLIP's own vocabulary
        vocab.setdefault(special, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def _bpe_merges(model) -> list[tuple[str, str]]:
    import json

    state = json.loads(model.__getstate__())
    merges = state["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def train_t5_tokenizer(vocab_size: int = 1000, extra_corpus: Iterable[str] = (), model_max_length: int = 512):
    """SentencePiece-style Unigram model wrapped in ``transformers.T5Tokenizer`` (also used for UMT5)."""
    from transformers import T5Tokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(extra_corpus), trainer=trainer)
    import json

    pieces = json.loads(tok.model.__getstate__())["vocab"]
    vocab = [(piece, float(score)) for piece, score in pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
