"""Training checkpoints restore model, optimiser and RNG streams (``--resume``)."""

from __future__ import annotations

import random

import torch

from training.common import resume_from, rng_state, save_checkpoint


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_resume_restores_everything_and_is_off_without_resume(tmp_path):
    model, opt = _model_and_opt(0)
    pyrng = random.Random(7)
    pyrng.random()
    path = tmp_path / "x.ckpt"
    save_checkpoint(
        path, model=model.state_dict(), opt=opt.state_dict(), step=42, rng=rng_state(), pyrng=pyrng.getstate()
    )
    expected_torch, expected_py = torch.rand(3), pyrng.random()

    fresh, fresh_opt = _model_and_opt(1)
    assert resume_from(path, False, fresh, fresh_opt) == (0, None)
    assert not torch.equal(fresh.weight, model.weight)

    other = random.Random(0)
    start, state = resume_from(path, True, fresh, fresh_opt, other)
    assert start == 42 and state is not None
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), expected_torch) and other.random() == expected_py
    assert resume_from(tmp_path / "missing.ckpt", True, fresh, fresh_opt) == (0, None)


def test_cli_wants_one_schedule_per_transformer_phase(tmp_path, capsys):
    import pytest

    from training.__main__ import DIT_STEPS, main
    from training.train_dit import PHASES

    assert len(DIT_STEPS) == len(PHASES)  # the defaults train every phase
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "run"), "--dit-steps", "100", "200:50"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--dit-steps: 2 values given" in err and f"{len(PHASES)} phases" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
