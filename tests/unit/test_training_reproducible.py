"""Training is reproducible: the same seed gives byte-identical weights (the model card's hashes rest on this).

A few steps of the VAE stage (the default model's first stage, its real architecture and data) run
twice from one seed and once from another; one torch thread, deterministic algorithms, as
``python -m training`` runs.
"""

from __future__ import annotations

import torch

from training import data
from training.common import file_sha256, setup
from training.train_vae import train_vae


def _train(out, seed):
    threads = torch.get_num_threads()
    try:
        setup(seed, threads=1)
        train_vae(out, seed, steps=3, phase=1, batch=2, log_every=1000, ckpt_every=1000)
    finally:
        torch.set_num_threads(threads)
    return file_sha256(out / "vae_phase1" / "diffusion_pytorch_model.safetensors")


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, monkeypatch):
    subset = data.train_scenes()[::40]  # the stage's latent statistics pass runs over every train scene
    monkeypatch.setattr(data, "train_scenes", lambda: subset)
    first, again, other = _train(tmp_path / "a", 0), _train(tmp_path / "b", 0), _train(tmp_path / "c", 1)
    assert first == again
    assert other != first
