"""The step runner as the trainer runs it: microsteps in ``accumulating``, the update in
``stepping``, retries (fp16's skipped updates included), and the host syncs a step makes."""

import itertools

import pytest
import torch
from cli_process import Cli, assert_one_clean_error
from helper_hooks import CaptureHook
from sync_counter import SyncCounter
from tiny_trainer import FlakyTrainer, ItemsTrainer, TinyTrainer, make_data

from trainloop import BaseHook, State
from trainloop.checkpoint import latest_checkpoint
from trainloop.hooks import CheckpointingHook
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.progress import ProgressHook


def params(trainer):
    return [p.detach().clone() for p in trainer.unwrapped_model.parameters()]


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_the_retry_edge_leaves_stepping_whatever_the_accumulation(accumulation):
    retried, states = [], []
    # The first microstep of step 2 is NaN, so step 2's first update finds non-finite gradients.
    trainer = FlakyTrainer(max_steps=3, gradient_accumulation_steps=accumulation, max_non_finite_grad_retries=1,
                           nan_at={accumulation + 1}, trace=True)
    trainer.on_transition("stepping", "retrying", lambda t: retried.append(t.step))

    class Where(BaseHook):
        def on_before_optimizer_step(self, t):
            states.append(("before_optimizer_step", t.state.value))

        def on_after_step(self, t):
            states.append(("after_step", t.state.value))

    trainer._hooks = [Where()]
    trainer.train()
    assert retried == [2]
    assert trainer.step == 3
    assert trainer.calls == 4 * accumulation  # 3 steps and one redone
    counts = trainer.trace.counts()
    assert counts[(State.ACCUMULATING, State.STEPPING, "update")] == 4
    assert counts[(State.ACCUMULATING, State.ACCUMULATING, "accumulate")] == 4 * (accumulation - 1)
    assert counts[(State.RETRYING, State.ACCUMULATING, "redo_step")] == 1
    assert counts[(State.STEPPING, State.ACCUMULATING, "begin_step")] == 2
    # Four updates, each in stepping; on_after_step only for the three applied.
    assert states.count(("before_optimizer_step", "stepping")) == 4
    assert states.count(("after_step", "stepping")) == 3
    assert len(states) == 7
    assert all(torch.isfinite(p).all() for p in params(trainer))


def test_fp16_skipped_updates_are_retries_and_only_applied_updates_advance_step_and_schedule():
    scheduled = []

    class Scheduled(FlakyTrainer):
        def build_lr_scheduler(self):
            return torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: scheduled.append(n) or 1.0)

        def build_grad_scaler(self):
            return torch.amp.GradScaler("cpu", init_scale=2.0**8)  # low enough not to overflow here

    hook = CaptureHook()
    trainer = Scheduled(max_steps=4, mixed_precision="fp16", max_non_finite_grad_retries=4,
                        nan_at={3, 4}, hooks=[hook], trace=True)
    trainer.train()
    counts = trainer.trace.counts()
    # Forward calls 3 and 4 are NaN: step 3 is refused by GradScaler twice, then applied.
    assert counts[(State.STEPPING, State.RETRYING, "retry")] == 2
    assert counts[(State.RETRYING, State.ACCUMULATING, "redo_step")] == 2
    assert trainer.step == 4
    assert len(hook.events("on_after_step")) == 4
    assert [info.non_finite_grad_retries for info in hook.step_infos] == [0, 0, 2, 0]
    assert scheduled == [0, 1, 2, 3, 4]  # built at 0, then one per applied update only
    assert trainer.grad_scaler.get_scale() == 2.0**6  # halved once per refused update
    assert all(torch.isfinite(p).all() for p in params(trainer))


def test_an_fp16_nan_storm_raises_when_retries_run_out_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = FlakyTrainer(
        max_steps=10, mixed_precision="fp16", max_non_finite_grad_retries=3, workspace=tmp_path,
        nan_at=set(range(8, 1000)), hooks=[CheckpointingHook(interval=1, keep_previous=1)],
    )
    with pytest.raises(RuntimeError, match=r"non-finite gradients at step \d after 3 retries.*loss scale is now"):
        trainer.train()
    last_applied = trainer.step - 1
    assert last_applied >= 2
    assert latest_checkpoint(tmp_path / "checkpoints").name == str(last_applied)
    stored = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert stored == [last_applied - 1, last_applied]  # the storm wrote nothing, pruned nothing good


def test_fp16_as_the_seeds_declare_it_trains_with_refused_updates_as_retries():
    # No max_non_finite_grad_retries: GradScaler's first scale (2**16) overflows on this model,
    # and each refused update shows as stepping -> retrying while the scale comes down.
    trainer = TinyTrainer(max_steps=3, mixed_precision="fp16", trace=True)
    trainer.train()
    assert trainer.step == 3
    assert trainer.grad_scaler.get_scale() < 2.0**16
    assert trainer.trace.counts()[(State.STEPPING, State.RETRYING, "retry")] > 0


def test_an_fp16_nan_storm_stops_at_the_loss_scale_floor(tmp_path):
    # Every forward from the 8th on is NaN: the scale halves per refused update until it would
    # fall below min_loss_scale; then a clear error, the last good checkpoint intact.
    trainer = FlakyTrainer(
        max_steps=10, mixed_precision="fp16", min_loss_scale=1.0, workspace=tmp_path,
        nan_at=set(range(8, 1000)), hooks=[CheckpointingHook(interval=1)],
    )
    with pytest.raises(RuntimeError, match=r"loss scale fell to 0\.5, below min_loss_scale=1, so the gradients are non-finite at any scale"):
        trainer.train()
    assert trainer.grad_scaler.get_scale() == 0.5
    assert latest_checkpoint(tmp_path / "checkpoints").name == str(trainer.step - 1)


def test_fp16_from_a_settings_file_validates_and_a_bad_floor_is_refused_naming_it(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 5\nworkspace: ws\nmixed_precision: fp16\n")
    trainer = ["--trainer", "tiny_trainer:TinyTrainer"]
    good = Cli("validate", "run.yaml", *trainer, cwd=tmp_path)
    bad = Cli("run", "run.yaml", *trainer, "--set", "min_loss_scale=0", cwd=tmp_path)
    assert good.result().returncode == 0, good.result().stderr
    result = bad.result()
    assert result.returncode == 2
    assert result.stdout == ""
    assert_one_clean_error(result.stderr, "min_loss_scale", "greater than 0")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "ws").exists()


def fused_adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, fused=True)


FUSED = {"make_optimizer": fused_adamw}  # skips a non-finite update in its kernel: the check needs no read


@pytest.mark.parametrize("throughput", [False, True], ids=["plain", "throughput"])
@pytest.mark.parametrize(
    ("settings", "syncs"),
    [
        ({}, 1),  # the non-finite check
        ({"detect_non_finite_grads": False}, 0),
        ({"grad_clip": 1.0}, 1),  # the clipped norm answers the check
        ({"gradient_accumulation_steps": 3}, 1),
        ({"mixed_precision": "fp16"}, 1),  # GradScaler's own
        ({"mixed_precision": "fp16", "detect_non_finite_grads": False}, 1),
        (FUSED, 0),  # from the second step on, decided on the device, read a step late from host memory
        ({**FUSED, "detect_non_finite_grads": False}, 0),
        ({**FUSED, "grad_clip": 1.0}, 0),
        ({**FUSED, "gradient_accumulation_steps": 3}, 0),
        ({**FUSED, "mixed_precision": "fp16"}, 0),
        ({**FUSED, "mixed_precision": "fp16", "grad_clip": 1.0}, 0),
    ],
)
def test_host_syncs_per_update(monkeypatch, settings, syncs, throughput):
    marks = {}

    class Mark(BaseHook):
        def on_before_step(self, trainer):
            if trainer.step == 2:
                marks["start"] = counter.count

        def on_after_step(self, trainer):
            if trainer.step == 10:  # before the stats hooks after it read their window at the last step
                marks["end"] = counter.count

    batches = [(x.unsqueeze(0), y.unsqueeze(0)) for x, y in make_data(8)]
    # With throughput: Loss(sum, count) with a tensor count, items and records counted by the
    # stats hooks every step, read only at their emission (here the last step, after the mark).
    stats = [ProgressHook(interval=100, bar=False), LoggingHook(interval=100)] if throughput else []
    trainer_class = ItemsTrainer if throughput else TinyTrainer
    if throughput:
        settings = {**settings, "rank_items": 1}  # no batch of one sample counts 0 items (a 0/0 gradient)
    counter = SyncCounter(monkeypatch)
    # An endless iterator: a DataLoader draws its base seed with .item() at every epoch.
    trainer = trainer_class(max_steps=10, hooks=[Mark(), *stats], data=itertools.cycle(batches), trace=True, **settings)
    trainer.train()
    updates = sum(1 for e in trainer.trace if e.trigger == "update" and e.step >= 2)  # retries included
    refused = sum(1 for e in trainer.trace if e.trigger == "retry" and e.step >= 2)
    assert updates >= 9
    # A refused fp16 update also reads the loss scale, for its floor (min_loss_scale).
    assert marks["end"] - marks["start"] == syncs * updates + refused
    if throughput:  # the counting was on: the last step's report has the items
        assert stats[1].latest.throughput.items > 0
