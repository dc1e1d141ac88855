"""Stage 2: the Qwen2.5-VL trained as a captioner of world images; afterwards it is frozen and serves
as the text/image encoder of the Qwen-Image pipelines.

Three next-token tasks, loss on the answer only:

- caption: chat template, user turn = image + "What is in this image?", answer = the long caption;
- edit: QwenImageEditPipeline's own prompt template (source image + instruction), answer = the
  long caption of the *edited* scene, fed exactly as the pipeline feeds it (no ``mm_token_type_ids``);
- prompt: QwenImagePipeline's template (text only), answer = the canonical caption.

The last two make the hidden states the pipelines read (the template's user turn) describe the
scene to draw, which is what the transformer is then trained to condition on.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from training import data
from training.common import (
    CAPTION_QUESTION,
    VLM_EDIT_AREA,
    Timer,
    cosine_lr,
    resume_from,
    rng_state,
    save_checkpoint,
    seed_all,
)

logger = logging.getLogger("training.vlm")
IMAGE_TOKENS = 16  # 112x112 px → 8x8 patches of 14 px → 2x2 merge → 16 tokens
GRID = (1, 8, 8)
IM_END = "<|im_end|>"


class VLMInputs:
    """Builds Qwen2.5-VL batches the way the processor does, from cached per-scene pixel values."""

    def __init__(self, tok, proc, edit_area: int = VLM_EDIT_AREA):
        self.tok = tok
        self.proc = proc
        self.edit_area = edit_area
        self.image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
        self._direct: dict = {}
        self._edit: dict = {}

    def pixel_values(self, scene, edit_path: bool) -> torch.Tensor:
        cache = self._edit if edit_path else self._direct
        if scene not in cache:
            img = data.image(scene)
            if edit_path:
                img = data.rescale_like_edit_pipeline(img, self.edit_area)
            cache[scene] = self.proc.image_processor(images=[img], return_tensors="pt")["pixel_values"]
        return cache[scene]

    def caption_prompt(self) -> str:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CAPTION_QUESTION}]}]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def batch(self, prompts: list[str], answers: list[str] | None, scenes=None, edit_path=False, token_types=True):
        """Right-padded batch; ``labels`` cover each answer and its ``<|im_end|>``."""
        expanded = [p.replace("<|image_pad|>", "<|image_pad|>" * IMAGE_TOKENS) for p in prompts]
        ids = [self.tok(p)["input_ids"] for p in expanded]
        labels = [[-100] * len(x) for x in ids]
        if answers is not None:
            for i, a in enumerate(answers):
                extra = self.tok(a + IM_END)["input_ids"]
                ids[i] = ids[i] + extra
                labels[i] = labels[i] + extra
        n = max(len(x) for x in ids)
        pad = self.tok.pad_token_id
        out = {
            "input_ids": torch.tensor([x + [pad] * (n - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in ids]),
        }
        if answers is not None:
            out["labels"] = torch.tensor([x + [-100] * (n - len(x)) for x in labels])
        if scenes is not None:
            out["pixel_values"] = torch.cat([self.pixel_values(s, edit_path) for s in scenes])
            out["image_grid_thw"] = torch.tensor([GRID] * len(scenes))
            if token_types:
                out["mm_token_type_ids"] = (out["input_ids"] == self.image_pad).long()
        return out


def _tasks(rng: random.Random, inputs: VLMInputs, batch: int, caption_batch: int, prompt_batch: int):
    from triptych.families.qwenimage.tokenizer import EDIT_TEMPLATE, T2I_TEMPLATE

    scenes = list(data.train_scenes())
    cap = rng.sample(scenes, caption_batch)
    yield inputs.batch([inputs.caption_prompt()] * caption_batch, [data.caption_answer(s) for s in cap], cap)
    sources = rng.sample(scenes, batch * 2)
    pairs = []
    for s in sources:
        options = data.edits_of(s)
        if options:
            pairs.append(rng.choice(options))
        if len(pairs) == batch:
            break
    yield inputs.batch(
        [EDIT_TEMPLATE.format(p.instruction) for p in pairs],
        [data.caption_answer(p.target) for p in pairs],
        [p.source for p in pairs],
        edit_path=True,
        token_types=False,
    )
    t2i = rng.sample(scenes, prompt_batch)
    styles = [rng.choice(("short", "long", "tag")) for _ in t2i]
    yield inputs.batch(
        [T2I_TEMPLATE.format(data.prompt_for(s, st)) for s, st in zip(t2i, styles)],
        [data.prompt_for(s, "short" if st == "short" else "long") for s, st in zip(t2i, styles)],
    )


#: Phases (each a fresh warm-up + cosine): all three tasks, then mostly captioning. Shape and position
#: are the slow part: after phase 1 (1200 steps) the captioner got colour, background and size right
#: but shape and position at chance; phase 2 learnt position (96%), phase 3 got shape to 66%, phase 4 continues.
PHASES = {
    1: dict(batch=16, caption_batch=16, prompt_batch=16, lr=2e-3),
    2: dict(batch=16, caption_batch=32, prompt_batch=4, lr=2e-3),
    3: dict(batch=16, caption_batch=32, prompt_batch=4, lr=1.5e-3),
    4: dict(batch=16, caption_batch=32, prompt_batch=4, lr=1e-3),
    # Phase 5 adds an identity loss on the text-to-image template's prompt tokens (see
    # ``identity_loss``): after phase 4, prompts differing only in the shape word gave last hidden
    # states ~13% apart (colour, size, position words: 100-140%), so the transformer, which reads
    # those states, could not learn the shape kind. After it: 106-121%, captions 82%.
    5: dict(batch=16, caption_batch=32, prompt_batch=16, lr=5e-4, identity=1.0),
}

#: Tokens of the Qwen-Image template's system prefix (``QwenImagePipeline.prompt_template_encode_start_idx``).
T2I_DROP = 34


def identity_loss(hidden: torch.Tensor, batch: dict, table: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Cross-entropy of each prompt token's last hidden state against ``table`` (the phase's starting
    input embeddings, normalised, frozen) by cosine / ``tau``: every prompt token's state must point
    at its own token, so the pipeline's embeddings carry every word. Answer tokens are left out."""
    h, ids = hidden[:, T2I_DROP:], batch["input_ids"][:, T2I_DROP:]
    keep = (batch["labels"][:, T2I_DROP:] == -100) & (batch["attention_mask"][:, T2I_DROP:] == 1)
    logits = torch.nn.functional.normalize(h, dim=-1) @ table.T / tau
    return torch.nn.functional.cross_entropy(logits[keep], ids[keep])


def train_vlm(
    out: Path, seed: int, steps: int, phase: int = 1, resume: bool = False, log_every: int = 25, ckpt_every: int = 100
):
    """Phase k continues from ``out/vlm_phase{k-1}`` and writes ``out/vlm_phase{k}``; the last phase writes ``out``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from training import build

    cfg = PHASES[phase]
    batch, lr = cfg["batch"], cfg["lr"]
    out.mkdir(parents=True, exist_ok=True)
    dest = out / (f"vlm_phase{phase}" if phase < len(PHASES) else ".")
    if (out / "text_encoder" / "config.json").is_file():
        dest = out  # the last phase's output: every phase is done
    if (dest / "text_encoder" / "config.json").is_file():
        logger.info("vlm phase %d: done already (%s)", phase, dest / "text_encoder")
        return
    seed_all(seed + 100 * (phase - 1))
    tok = build.tokenizer()
    proc = build.processor(tok)
    if phase == 1:
        model = build.text_encoder(seed)
    else:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / f"vlm_phase{phase - 1}" / "text_encoder")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(f"{seed}|vlm" if phase == 1 else f"{seed}|vlm|{phase}")
    ckpt = out / f"vlm{phase}.ckpt"
    start, state = resume_from(ckpt, resume, model, opt, rng)
    if state:
        logger.info("vlm: resumed at step %d", start)
    inputs = VLMInputs(tok, proc)
    table = torch.nn.functional.normalize(model.get_input_embeddings().weight.detach().clone(), dim=-1)
    timer = Timer()
    model.train()
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr)
        losses = []
        opt.zero_grad(set_to_none=True)
        for k, b in enumerate(_tasks(rng, inputs, batch, cfg["caption_batch"], cfg["prompt_batch"])):
            if k == 2 and cfg.get("identity"):  # the text-to-image template batch
                out_ = model(**b, output_hidden_states=True)
                loss = out_.loss + cfg["identity"] * identity_loss(out_.hidden_states[-1], b, table)
            else:
                loss = model(**b).loss
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            logger.info(
                f"vlm{phase} step %d/%d loss caption %.3f edit %.3f prompt %.3f (%.0fs)", step, steps, *losses, timer()
            )
        if (step + 1) % ckpt_every == 0:
            save_checkpoint(
                ckpt,
                model=model.state_dict(),
                opt=opt.state_dict(),
                step=step + 1,
                rng=rng_state(),
                pyrng=rng.getstate(),
            )
    model.eval()
    model.save_pretrained(dest / "text_encoder")
    tok.save_pretrained(dest / "tokenizer")
    proc.save_pretrained(dest / "processor")
    logger.info("vlm phase %d: saved (%.0fs)", phase, timer())


@torch.no_grad()
def caption_images(model, proc, images, max_new_tokens: int = 24) -> list[str]:
    """Ask the model 'What is in this image?' through its chat template (greedy)."""
    tok = proc.tokenizer
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CAPTION_QUESTION}]}]
    text = tok.apply_chat_template(msgs, chat_template=proc.chat_template, tokenize=False, add_generation_prompt=True)
    answers = []
    for img in images:
        inp = proc(text=[text], images=[img], return_tensors="pt")
        gen = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tok.decode(gen[0, inp["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    return answers
