"""Stage 3: the QwenImageTransformer2DModel trained jointly on text-to-image and edit (flow matching).

Everything the transformer sees is computed by the Qwen-Image pipelines' own code paths, once, up
front (the VAE and the captioner are frozen):

- targets: VAE posterior means of world images, normalised with the VAE's ``latents_mean/std`` and
  packed into 2x2 patches (``_pack_latents``), exactly as ``QwenImagePipeline`` unpacks/denormalises;
- text-to-image conditions: ``QwenImagePipeline._get_qwen_prompt_embeds`` of every train prompt;
- edit conditions: the Qwen2.5-VL hidden states of QwenImageEditPipeline's template (source image
  resized to the model's ``condition_area``, 64x64, as the edit family resizes it, plus the
  instruction, first 64 tokens dropped), and the source image's VAE latents at that size
  (``_encode_vae_image``), appended to the noise tokens with ``img_shapes = [(1, h, w), (1, H, W)]``
  as the pipeline does.

Objective: rectified flow as FlowMatchEulerDiscreteScheduler integrates it: ``x_s = (1 - s) x0 + s e``,
the transformer gets ``timestep = s`` (the pipeline passes ``t / 1000``) and predicts ``e - x0``.
10% of conditions are replaced by the negative prompt " " so true CFG works. EMA weights are saved.
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path

import numpy as np
import torch

from training import data
from training.common import (
    CONDITION_AREA,
    Timer,
    cosine_lr,
    resume_from,
    rng_state,
    save_checkpoint,
    seed_all,
    single_frame_convs,
)
from training.dit_objective import _ema, _log, _pad, flow_loss, token_foreground

logger = logging.getLogger("training.dit")
STYLES = ("short", "long", "tag")
STYLE_P = (0.4, 0.4, 0.2)
NEGATIVE = " "
CFG_DROP = 0.1


def load_frozen(out: Path, vae_dir: Path | None = None) -> dict:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from training import build

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    parts = {
        "vae": AutoencoderKLQwenImage.from_pretrained(vae_dir or out / "vae").eval(),
        "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "text_encoder").eval(),
        "tokenizer": tok,
        "processor": build.processor(tok),
    }
    return parts


def scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Qwen-Image's scheduler settings (as the family's tiny builder writes them).
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def pipelines(parts: dict, transformer):
    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    common = dict(
        scheduler=scheduler(),
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        tokenizer=parts["tokenizer"],
        transformer=transformer,
    )
    return QwenImagePipeline(**common), QwenImageEditPipeline(**common, processor=parts["processor"])


def new_transformer(seed: int):
    from diffusers import QwenImageTransformer2DModel

    from training.common import dims

    d = dims()
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * d.z_dim,
        out_channels=d.z_dim,
        num_layers=d.layers,
        attention_head_dim=d.head_dim,
        num_attention_heads=d.heads,
        joint_attention_dim=d.text_dim,
        guidance_embeds=False,
        axes_dims_rope=d.rope_axes,
    )


def _split(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [e[: int(m.sum())].clone() for e, m in zip(embeds, mask)]


@torch.no_grad()
def precompute(out: Path, seed: int, edit_sources: int) -> dict:
    path = out / "dit_data.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    from training.train_vae import encoder_dir
    from training.train_vlm import VLMInputs
    from triptych.families.qwenimage.tokenizer import EDIT_TEMPLATE

    timer = Timer()
    parts = load_frozen(out, encoder_dir(out))  # the decoder may still be training: only the encoder is used
    t2i, edit = pipelines(parts, new_transformer(seed))
    vae = parts["vae"]
    scenes = list(data.train_scenes())
    index = {s: i for i, s in enumerate(scenes)}
    with single_frame_convs():
        lat = _normalised_latents(vae, scenes)
    c, h, w = lat.shape[1], lat.shape[3], lat.shape[4]
    x0 = t2i._pack_latents(lat, lat.shape[0], c, h, w)  # (N, tokens, 4c)
    logger.info("dit: %d target latents %s (%.0fs)", len(scenes), tuple(x0.shape), timer())

    prompts = data.all_prompts(scenes) + [NEGATIVE]
    embeds: list[torch.Tensor] = []
    for i in range(0, len(prompts), 64):
        e, m = t2i._get_qwen_prompt_embeds(prompt=prompts[i : i + 64], device=torch.device("cpu"))
        embeds += _split(e, m)
    ref, _ = t2i.encode_prompt(prompt=prompts[7], device=torch.device("cpu"))
    logger.info(
        "dit: %d prompt embeddings (batched vs single max diff %.2e) (%.0fs)",
        len(prompts),
        (ref[0] - embeds[7]).abs().max().item(),
        timer(),
    )
    prompt_index = {p: i for i, p in enumerate(prompts)}
    t2i_table = np.array([[prompt_index[data.prompt_for(s, st)] for st in STYLES] for s in scenes])

    # Edit: K sources, their condition latents at the model's condition size, every train edit of them.
    sources = data.sample_edit_sources(edit_sources, seed)
    inputs = VLMInputs(parts["tokenizer"], parts["processor"], edit_area=CONDITION_AREA)
    cond, pairs, edit_embeds, neg_index = [], [], [], []
    for k, src in enumerate(sources):
        big = data.rescale_like_edit_pipeline(data.image(src), CONDITION_AREA)
        pix = edit.image_processor.preprocess(big, big.size[1], big.size[0]).unsqueeze(2)
        with single_frame_convs():
            latents = edit._encode_vae_image(image=pix, generator=None)
        cond.append(edit._pack_latents(latents, 1, latents.shape[1], latents.shape[3], latents.shape[4]))
        src_pairs = data.edits_of(src)
        texts = [p.instruction for p in src_pairs] + [NEGATIVE]
        for i in range(0, len(texts), 32):
            chunk = texts[i : i + 32]
            b = inputs.batch(
                [EDIT_TEMPLATE.format(t) for t in chunk], None, [src] * len(chunk), edit_path=True, token_types=False
            )
            hs = parts["text_encoder"](**b, output_hidden_states=True).hidden_states[-1]
            edit_embeds += [e[64:] for e in _split(hs, b["attention_mask"])]
        base = len(edit_embeds) - len(texts)
        neg_index.append(len(edit_embeds) - 1)
        pairs += [(k, base + j, index[p.target]) for j, p in enumerate(src_pairs)]
        if k == 0:
            ref, _ = edit.encode_prompt(image=big, prompt=src_pairs[0].instruction, device=torch.device("cpu"))
            logger.info(
                "dit: edit embedding vs pipeline max diff %.2e", (ref[0] - edit_embeds[base]).abs().max().item()
            )
        if k % 64 == 0:
            logger.info("dit: edit source %d/%d (%.0fs)", k, len(sources), timer())
    shape = (1, latents.shape[3] // 2, latents.shape[4] // 2)
    result = dict(
        x0=x0,
        embeds=embeds,
        t2i_table=torch.from_numpy(t2i_table),
        neg=prompt_index[NEGATIVE],
        cond=torch.cat(cond),
        cond_shape=shape,
        pairs=torch.tensor(pairs),
        edit_embeds=edit_embeds,
        edit_neg=torch.tensor(neg_index),
        noise_shape=(1, h // 2, w // 2),
    )
    torch.save(result, path)
    logger.info("dit: %d edit pairs from %d sources, condition %s (%.0fs)", len(pairs), len(sources), shape, timer())
    return result


def _normalised_latents(vae, scenes) -> torch.Tensor:
    """``(mode - latents_mean) / latents_std``, the pipelines' normalisation (``_encode_vae_image``)."""
    from training.train_vae import encode_mode

    z = encode_mode(vae, scenes)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) / std


#: Phase 2 starts from phase 1's weights (fresh optimiser and schedule) and draws a third of the noise
#: levels from [0.8, 1]: after phase 1 the transformer read the shape's colour and position from the
#: prompt but took the background from the noisy latents (x0 predicted at sigma 1 got the background
#: right 9% of the time, at sigma 0.8 100%), so samples had random backgrounds.
#: Phase 3 (from phase 2's weights) also weights the loss of image tokens that cover the shape ``fg``
#: times more: after phase 2 colours, background, position and size came out right but the shape
#: kind was at chance, even on train prompts; the shape is a few tokens' fine detail and a small part
#: of a whole-image MSE.
#: Phase 4 continues phase 3 on the text encoder after its identity phase (``train_vlm.PHASES[5]``):
#: before it, prompts that differ only in the shape word gave hidden states ~13% apart (size, colour
#: and position words: 100-140%), and no phase taught the transformer the shape kind. lr 1e-3: a
#: 5e-4 run beside it ended at 50% of held-out prompts fully right, this one at 62%.
#: Phase 5 continues phase 4 with the same settings on a fresh 20,000-step cosine schedule: held-out
#: shape kind was still rising when phase 4 ended (40% -> 46% -> 62% at its last checks).
#: Phase 6 is one more such restart (lr 1e-3 to 0 over 20,000 steps). On 200 selection pairs, edits
#: fully right went 75% -> 78.5% (text-to-image 87% -> 88.5%); a run beside it at lr 5e-4 with 24
#: edit rows a step ended at 87.5% / 78.5%.
#: Phase 7 is one more such restart, 16,000 steps: on 400 selection prompts (seeds "select" to
#: "select4") text-to-image fully right went 88.25% -> 89.5%, on 200 selection pairs edits 78.5% ->
#: 83%. A run beside it with the shape tokens weighted 8x (14,000 steps) ended at 88.5% / 84%, and
#: the average of the two runs' weights at 87.75% / 84%.
PHASES = {
    1: {"lr": 1e-3, "high": 0.0},
    2: {"lr": 5e-4, "high": 1 / 3},
    3: {"lr": 5e-4, "high": 1 / 3, "fg": 4.0},
    4: {"lr": 1e-3, "high": 1 / 3, "fg": 4.0},
    5: {"lr": 1e-3, "high": 1 / 3, "fg": 4.0},
    6: {"lr": 1e-3, "high": 1 / 3, "fg": 4.0},
    7: {"lr": 1e-3, "high": 1 / 3, "fg": 4.0},
}


def train_dit(
    out: Path,
    seed: int,
    steps: int,
    batch: int = 48,
    edit_batch: int = 16,
    edit_every: int = 1,
    edit_sources: int = 512,
    resume: bool = False,
    log_every: int = 50,
    ckpt_every: int = 200,
    phase: int = 1,
    stop: int | None = None,
):
    """``edit_every``: an edit batch every that many steps (an edit row is 32 image tokens, a t2i row 16).
    Phase k > 1 starts from ``out/dit{k-1}.ckpt``'s weights; ``stop``: end at that step of a
    ``steps``-long schedule. The last phase writes ``out/transformer`` (EMA weights)."""
    if (out / "transformer" / "config.json").is_file():
        logger.info("dit: done already (%s)", out / "transformer")
        return
    lr, high, fg = PHASES[phase]["lr"], PHASES[phase]["high"], PHASES[phase].get("fg")
    edit_batch = PHASES[phase].get("edit_batch", edit_batch)
    seed_all(seed + 100 * (phase - 1))
    d = precompute(out, seed, edit_sources)
    model = new_transformer(seed)
    ema = copy.deepcopy(model).requires_grad_(False)
    if phase > 1:
        previous = torch.load(_ckpt(out, phase - 1), weights_only=False)
        model.load_state_dict(previous["model"])
        ema.load_state_dict(previous["ema"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed + 100 * (phase - 1))
    rng = random.Random(f"{seed}|dit" if phase == 1 else f"{seed}|dit|{phase}")
    ckpt = _ckpt(out, phase)
    start, state = resume_from(ckpt, resume, model, opt, rng)
    if state:
        ema.load_state_dict(state["ema"])
        gen.set_state(state["gen"])
        logger.info("dit: resumed at step %d", start)
    weights = None if fg is None else 1.0 + (fg - 1.0) * token_foreground(list(data.train_scenes()))
    n_scenes = d["x0"].shape[0]
    n_pairs = d["pairs"].shape[0]
    timer = Timer()
    model.train()
    loss_e = torch.zeros(())
    for step in range(start, stop or steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup=100)
        opt.zero_grad(set_to_none=True)
        # text-to-image
        idx = [rng.randrange(n_scenes) for _ in range(batch)]
        emb = []
        for i in idx:
            style = rng.choices(range(3), STYLE_P)[0]
            j = d["neg"] if rng.random() < CFG_DROP else int(d["t2i_table"][i, style])
            emb.append(d["embeds"][j])
        e, m = _pad(emb)
        loss_t = flow_loss(
            model,
            d["x0"][idx],
            e,
            m,
            [d["noise_shape"]],
            gen,
            high=high,
            weight=None if weights is None else weights[idx],
        )
        loss_t.backward()
        # edit
        if step % edit_every == 0:
            rows = d["pairs"][[rng.randrange(n_pairs) for _ in range(edit_batch)]]
            emb = [
                d["edit_embeds"][int(d["edit_neg"][k]) if rng.random() < CFG_DROP else int(j)]
                for k, j, _ in rows.tolist()
            ]
            e, m = _pad(emb)
            loss_e = flow_loss(
                model,
                d["x0"][rows[:, 2]],
                e,
                m,
                [d["noise_shape"], d["cond_shape"]],
                gen,
                extra=d["cond"][rows[:, 0]],
                high=high,
                weight=None if weights is None else weights[rows[:, 2]],
            )
            loss_e.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _ema(ema, model, step)
        _log(step, steps, loss_t, loss_e, timer, log_every)
        if (step + 1) % ckpt_every == 0:
            save_checkpoint(
                ckpt,
                model=model.state_dict(),
                ema=ema.state_dict(),
                opt=opt.state_dict(),
                step=step + 1,
                rng=rng_state(),
                gen=gen.get_state(),
                pyrng=rng.getstate(),
            )
    save_checkpoint(
        ckpt,
        model=model.state_dict(),
        ema=ema.state_dict(),
        opt=opt.state_dict(),
        step=stop or steps,
        rng=rng_state(),
        gen=gen.get_state(),
        pyrng=rng.getstate(),
    )
    if phase == len(PHASES):
        ema.save_pretrained(out / "transformer")
    logger.info("dit phase %d: done (%.0fs)", phase, timer())


def _ckpt(out: Path, phase: int) -> Path:
    return out / ("dit.ckpt" if phase == 1 else f"dit{phase}.ckpt")
