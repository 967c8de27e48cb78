"""CudaMaxMemoryHook: a warned no-op on CPU; the real peak on CUDA where a GPU exists."""

from __future__ import annotations

import warnings

import pytest
import torch
from helper_hooks import CaptureHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.cuda_memory import CudaMaxMemoryHook


def test_cpu_device_is_a_no_op_with_one_warning():
    capture = CaptureHook()
    trainer = TinyTrainer(max_steps=4, device="cpu", hooks=[CudaMaxMemoryHook(), capture])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()

    ours = [w for w in caught if "CudaMaxMemoryHook" in str(w.message)]
    assert len(ours) == 1  # once per run, not once per step
    assert issubclass(ours[0].category, RuntimeWarning)
    assert "'cpu'" in str(ours[0].message)
    assert "max_memory" in str(ours[0].message)
    assert len(capture.step_infos) == 4
    assert all(info.get("max_memory") is None for info in capture.step_infos)
    assert trainer.step == 4


@pytest.mark.cuda
def test_cuda_peak_is_recorded_per_step():
    class Allocating(CaptureHook):
        # Runs after the memory hook reset the peak, so step 2's big allocation shows at step 2
        # only.
        def on_before_step(self, trainer):
            if trainer.step == 2:
                self.big = torch.empty(256 << 20, dtype=torch.uint8, device=trainer.device)
                del self.big

    capture = Allocating()
    trainer = TinyTrainer(max_steps=3, device="cuda", hooks=[CudaMaxMemoryHook(), capture])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train()
    peaks = [info.get("max_memory") for info in capture.step_infos]
    assert all(isinstance(p, float) and p > 0 for p in peaks)
    assert peaks[1] >= 0.25 > peaks[0]
    assert peaks[2] < 0.25


def test_takes_no_parameters_and_is_declarable():
    assert HOOK_TYPES["cuda_memory"] is CudaMaxMemoryHook
    hook = hook_settings_model(CudaMaxMemoryHook).model_validate({"type": "cuda_memory"}).build()
    assert isinstance(hook, CudaMaxMemoryHook)
    with pytest.raises(ValidationError, match="interval"):
        hook_settings_model(CudaMaxMemoryHook).model_validate({"type": "cuda_memory", "interval": 3})
    with pytest.raises(ValidationError):
        CudaMaxMemoryHook(3)
