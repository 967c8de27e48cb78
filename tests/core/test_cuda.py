"""The engine on a CUDA device (marked ``cuda``: skipped without one): fp16 with its grad scaler."""

from __future__ import annotations

import math

import pytest
import torch
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer

pytestmark = pytest.mark.cuda


def test_fp16_on_cuda_trains_through_the_grad_scaler():
    capture = CaptureHook()
    trainer = TinyTrainer(max_steps=30, device="cuda", mixed_precision="fp16", hooks=[capture])
    before = [p.detach().clone() for p in trainer.build_model().parameters()]  # the seeded initial weights
    result = trainer.train()
    assert result.step == 30
    assert trainer.grad_scaler.is_enabled()
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    losses = [float(torch.stack(info.loss).mean()) for info in capture.step_infos]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]  # it learns
    assert any(not torch.equal(a.cuda(), b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert 0 < trainer.grad_scaler.get_scale() <= 65536.0


class _ModestScaleTrainer(TinyTrainer):
    """fp16 with a loss scale that overflows nothing: no update is refused, so no batch is drawn again."""

    def build_grad_scaler(self):
        return torch.amp.GradScaler("cuda", init_scale=2.0**8)


def test_fp16_on_cuda_matches_float32_closely_when_no_update_is_refused():
    # With the default scale (65536) the first updates overflow and are retried on fresh batches,
    # so the fp16 run trains on other batches than the fp32 one: compare where they draw the same.
    fp16 = _ModestScaleTrainer(max_steps=30, device="cuda", mixed_precision="fp16")
    fp16.train()
    assert fp16.grad_scaler.get_scale() == 2.0**8  # never halved: no update was refused
    fp32 = TinyTrainer(max_steps=30, device="cuda")
    fp32.train()
    for a, b in zip(fp16.model.parameters(), fp32.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
