import itertools
import math
import re
import warnings

import pytest
import torch
from helper_hooks import CaptureHook, CounterHook
from tiny_trainer import FlakyTrainer, TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader

from trainloop import BaseHook, BaseTrainer, CheckpointingHook, DataExhaustedError, PreflightError, State
from trainloop.hooks import Schedule


def params(trainer):
    return [p.detach().clone() for p in trainer.unwrapped_model.parameters()]


def test_train_runs_the_machine_to_exiting_and_calls_hooks_in_their_states():
    hook = CaptureHook()
    trainer = TinyTrainer(max_steps=3, hooks=[hook], trace=True)
    assert trainer.state is State.IDLE
    trainer.train()
    assert trainer.state is State.EXITING
    assert trainer.step == 3
    assert hook.calls[0] == ("on_before_train", "restoring", 0)
    assert hook.events("on_before_step") == [("on_before_step", "accumulating", s) for s in (1, 2, 3)]
    assert hook.events("on_after_step") == [("on_after_step", "stepping", s) for s in (1, 2, 3)]
    assert hook.calls[-1] == ("on_after_train", "exiting", 3)
    path = [(e.source.value, e.dest.value, e.trigger) for e in trainer.trace]
    assert path == [
        ("idle", "building", "start"), ("building", "restoring", "restore"),
        ("restoring", "accumulating", "begin_step"), ("accumulating", "stepping", "update"),
        ("stepping", "accumulating", "begin_step"), ("accumulating", "stepping", "update"),
        ("stepping", "accumulating", "begin_step"), ("accumulating", "stepping", "update"),
        ("stepping", "exiting", "finish"),
    ]
    with pytest.raises(RuntimeError, match="train\\(\\) runs once per trainer"):
        trainer.train()


def test_accumulation_enters_accumulating_per_microstep_and_stepping_per_update_and_matches_a_full_batch():
    entered = {State.STEPPING: 0, State.ACCUMULATING: 0}
    accumulated = TinyTrainer(max_steps=4, gradient_accumulation_steps=4,
                              data=DataLoader(make_data(), batch_size=2))
    for state in entered:
        accumulated.on_enter(state, lambda t, s=state: entered.__setitem__(s, entered[s] + 1))
    accumulated.train()
    assert entered == {State.STEPPING: 4, State.ACCUMULATING: 16}
    assert len(accumulated.step_info.loss) == 4
    full = TinyTrainer(max_steps=4, data=DataLoader(make_data(), batch_size=8))
    full.train()
    for a, b in zip(params(accumulated), params(full)):
        torch.testing.assert_close(a, b)


def test_step_info_carries_times_losses_records_and_retries():
    hook = CaptureHook()
    TinyTrainer(max_steps=2, gradient_accumulation_steps=2, grad_clip=10.0, hooks=[hook]).train()
    info = hook.step_infos[-1]
    assert len(info.data_time) == 2
    assert all(t >= 0 for t in info.data_time)
    assert info.step_time > 0
    assert [loss.shape for loss in info.loss] == [torch.Size([]), torch.Size([])]
    assert not any(loss.requires_grad for loss in info.loss)
    assert set(info.records[0]) == {"mse"}
    assert info.non_finite_grad_retries == 0
    assert torch.isfinite(info.grad_norm)


def test_grad_clip_limits_the_update():
    trainer = TinyTrainer(max_steps=1, grad_clip=1e-3, lr=1.0)
    before = None

    class Before(BaseHook):
        def on_before_step(self, t):
            nonlocal before
            before = params(t)

    trainer._hooks = [Before()]
    trainer.train()
    update = torch.cat([(a - b).flatten() for a, b in zip(params(trainer), before)])
    assert trainer.step_info.grad_norm > 1e-3
    torch.testing.assert_close(update.norm(), torch.tensor(1e-3), rtol=1e-3, atol=0)


def test_non_finite_gradients_retry_the_step_without_stepping_the_optimizer():
    hook = CaptureHook()
    trainer = FlakyTrainer(max_steps=3, max_non_finite_grad_retries=2, nan_at={2, 3}, hooks=[hook], trace=True)
    trainer.train()
    assert trainer.step == 3
    assert [info.non_finite_grad_retries for info in hook.step_infos] == [0, 2, 0]
    assert all(torch.isfinite(p).all() for p in params(trainer))
    counts = trainer.trace.counts()
    assert counts[(State.STEPPING, State.RETRYING, "retry")] == 2
    assert counts[(State.RETRYING, State.ACCUMULATING, "redo_step")] == 2
    assert len(hook.events("on_before_step")) == 3  # a retry is not a new step
    # The retried step's losses are those of its last attempt; its data time counts every attempt.
    assert len(hook.step_infos[1].loss) == 1
    assert len(hook.step_infos[1].data_time) == 3


def test_retries_exhausted_raise_and_never_step_on_non_finite_gradients():
    hook = CaptureHook()
    trainer = FlakyTrainer(max_steps=5, max_non_finite_grad_retries=3, nan_at={"all"}, hooks=[hook])
    with pytest.raises(RuntimeError, match=r"non-finite gradients at step 1 after 3 retries \(max_non_finite_grad_retries=3\)"):
        trainer.train()
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    for a, b in zip(params(trainer), fresh.parameters()):
        torch.testing.assert_close(a, b.detach())  # the optimizer never stepped
    assert trainer.state is State.EXITING
    assert isinstance(trainer.error, RuntimeError)
    assert hook.calls[-1][0] == "on_after_train"
    assert trainer.calls == 4  # the first try and three retries, never more


@pytest.mark.parametrize("retries", [None, 0])
def test_no_retries_raise_at_once_naming_the_setting(retries):
    trainer = FlakyTrainer(max_steps=5, max_non_finite_grad_retries=retries, nan_at={1})
    with pytest.raises(RuntimeError, match=f"max_non_finite_grad_retries is {retries}, so the step is not retried"):
        trainer.train()
    assert trainer.calls == 1


def test_non_finite_check_uses_the_clipped_norm_when_clipping():
    trainer = FlakyTrainer(max_steps=2, grad_clip=1.0, max_non_finite_grad_retries=1, nan_at={1})
    trainer.train()
    assert all(torch.isfinite(p).all() for p in params(trainer))


def test_detection_off_steps_on_whatever_the_gradients_hold():
    trainer = FlakyTrainer(max_steps=1, detect_non_finite_grads=False, nan_at={1})
    trainer.train()
    assert not all(torch.isfinite(p).all() for p in params(trainer))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_autocasts_forward_on_cpu(precision):
    seen = []

    class Check(TinyTrainer):
        def forward(self, batch):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().forward(batch)

    trainer = Check(max_steps=2, mixed_precision=precision, max_non_finite_grad_retries=5, trace=True)
    trainer.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # fp16: each update GradScaler finds inf in (its first scale, 2**16, overflows here) is a retry.
    retries = trainer.trace.counts()[(State.STEPPING, State.RETRYING, "retry")]
    assert (retries > 0) is (precision == "fp16")
    assert seen == [(True, dtype)] * (2 + retries)
    assert trainer.grad_scaler.is_enabled() is (precision == "fp16")
    assert not torch.is_autocast_enabled("cpu")
    if precision == "fp16":
        assert trainer.grad_scaler.get_scale() > 0


def test_loss_none_draws_the_next_batch_and_does_not_count():
    class Skipping(TinyTrainer):
        drawn = 0

        def forward(self, batch):
            Skipping.drawn += 1
            if Skipping.drawn % 2 == 1:
                return None, {}
            return super().forward(batch)

    trainer = Skipping(max_steps=3, gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no LossNoneWarning for a plain model
        trainer.train()
    assert Skipping.drawn == 12
    assert len(trainer.step_info.loss) == 2
    assert len(trainer.step_info.data_time) == 2  # per microstep, the skipped batch's time included


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (torch.tensor(1.0), r"forward\(\) must return \(loss, records\), got Tensor"),
        ((torch.ones(3), {}), r"must return a scalar tensor loss, got a tensor of shape \(3,\)"),
        ((1.0, {}), r"must return a scalar tensor loss, got float"),
    ],
)
def test_bad_forward_outputs_are_clear_errors(output, message):
    class Bad(TinyTrainer):
        def forward(self, batch):
            return output

    trainer = Bad(max_steps=1)
    with pytest.raises(TypeError, match=message):
        trainer.train()
    assert trainer.state is State.EXITING


def test_epochs_restart_a_reiterable_loader_and_call_set_epoch():
    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __iter__(self):
            return iter(range(16))

        def __len__(self):
            return 16

    sampler = Sampler()
    loader = DataLoader(make_data(16), batch_size=8, sampler=sampler)
    trainer = TinyTrainer(max_steps=5, data=loader)
    trainer.train()
    assert sampler.epochs == [0, 1, 2]
    assert trainer.epoch == 2


def test_a_one_shot_iterator_that_runs_out_is_a_clear_error():
    batches = iter(list(DataLoader(make_data(16), batch_size=8)))
    trainer = TinyTrainer(max_steps=3, data=batches)
    with pytest.raises(DataExhaustedError, match="ran out after 2 batches and cannot be iterated again"):
        trainer.train()
    assert trainer.step == 3
    assert trainer.state is State.EXITING


def test_an_infinite_iterator_is_fine_and_a_generator_is_closed_on_exit():
    closed = []

    def forever():
        try:
            yield from itertools.cycle(DataLoader(make_data(16), batch_size=8))
        finally:
            closed.append(True)

    TinyTrainer(max_steps=5, data=forever()).train()
    assert closed == [True]


def test_an_empty_loader_is_a_clear_error():
    with pytest.raises(DataExhaustedError, match="yielded no batch in epoch 0"):
        TinyTrainer(max_steps=1, data=[]).train()


def test_scheduler_steps_after_the_optimizer():
    lrs = []

    class Scheduled(TinyTrainer):
        def build_lr_scheduler(self):
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    class Watch(BaseHook):
        def on_before_optimizer_step(self, trainer):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])

    trainer = Scheduled(max_steps=3, hooks=[Watch()], lr=0.4)
    trainer.train()
    assert lrs == [0.4, 0.2, 0.1]
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


class Scheduled(TinyTrainer):
    """AdamW + cosine schedule on 5 batches per epoch, so a resume at step 5 starts a fresh epoch
    in both runs (plain loaders do not restore their position)."""

    def build_data_loader(self):
        return DataLoader(make_data(40), batch_size=8)

    def build_optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=10)


def test_state_dict_round_trip_resumes_to_the_same_result():
    straight = Scheduled(max_steps=8)
    straight.train()

    first = Scheduled(max_steps=5)
    first.train()
    saved = first.state_dict()
    assert saved["training_state"]["step"] == 5
    assert set(saved) == {"model", "training_state"}

    class Restore(BaseHook):
        def on_enter_restoring(self, trainer):
            trainer.load_state_dict(saved)

    resumed = Scheduled(max_steps=8, hooks=[Restore()])
    resumed.train()
    assert resumed.step == 8
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(straight.optimizer.param_groups[0]["lr"])
    for a, b in zip(params(resumed), params(straight)):
        torch.testing.assert_close(a, b)


def test_hooks_add_and_restore_their_state_by_name_whatever_their_order():
    a, b = CounterHook(), CounterHook()
    b.name = "second"
    trainer = TinyTrainer(max_steps=2, hooks=[a, b])
    trainer.train()
    b.count = 7
    state = trainer.state_dict()
    assert state["counter_hook"] == {"count": 2}
    assert state["second"] == {"count": 7}
    c, d = CounterHook(), CounterHook()
    d.name = "second"
    restored = TinyTrainer(max_steps=2, hooks=[d, c])  # another order: each finds its own state
    restored.on_enter(State.RESTORING, lambda t: t.load_state_dict(state))
    restored.train()
    assert (c.count, d.count) == (2, 7)


def test_two_hooks_with_one_name_are_an_error_naming_it():
    trainer = TinyTrainer(max_steps=2, hooks=[CounterHook(), CounterHook()])
    with pytest.raises(ValueError, match=r"2 hooks are named 'counter_hook' \(CounterHook, CounterHook\): give each a name"):
        trainer.train()
    assert trainer.step == 0


def test_a_declared_hook_takes_its_name_from_settings():
    from trainloop import TrainerSettings

    settings = TrainerSettings(max_steps=2, hooks=[{"type": "ema", "name": "ema_slow"}, {"type": "ema", "decay": 0.5}])
    trainer = TinyTrainer(settings)
    trainer.train()
    assert [hook.name for hook in trainer.hooks] == ["ema_slow", "ema_hook"]
    assert {"ema_slow", "ema_hook"} <= set(trainer.state_dict())


def test_resuming_at_max_steps_goes_straight_to_exiting():
    first = TinyTrainer(max_steps=2)
    first.train()
    saved = first.state_dict()
    hook = CaptureHook()
    again = TinyTrainer(max_steps=2, hooks=[hook], trace=True)
    again.on_enter(State.RESTORING, lambda t: t.load_state_dict(saved))
    again.train()
    assert not hook.events("on_before_step")
    assert [(e.source, e.dest) for e in again.trace][-1] == (State.RESTORING, State.EXITING)


def test_state_entry_methods_of_hooks_are_attached():
    class Saver(BaseHook):
        def __init__(self):
            self.saved_at = []

        def on_after_step(self, trainer):
            if trainer.step % 2 == 0:
                trainer.request_checkpoint()

        def on_enter_checkpointing(self, trainer):
            self.saved_at.append(trainer.step)

    saver = Saver()
    trainer = TinyTrainer(max_steps=5, hooks=[saver], trace=True)
    trainer.train()
    assert saver.saved_at == [2, 4]
    assert trainer.trace.counts()[(State.CHECKPOINTING, State.ACCUMULATING, "begin_step")] == 2


def test_a_checkpointing_schedule_saves_in_checkpointing_and_the_last_step_once():
    class Saver(BaseHook):
        def __init__(self):
            self.saved_at = []
            self.schedule = Schedule(2, state="checkpointing")

        def on_schedule(self, trainer):
            self.saved_at.append((trainer.step, trainer.state))

    for max_steps, expected in ((5, [2, 4, 5]), (4, [2, 4])):
        saver = Saver()
        trainer = TinyTrainer(max_steps=max_steps, hooks=[saver], trace=True)
        trainer.train()
        assert saver.saved_at == [(step, State.CHECKPOINTING) for step in expected]
        assert trainer.trace.counts()[(State.STEPPING, State.CHECKPOINTING, "checkpoint")] == len(expected)


def test_a_requested_save_runs_every_saving_hook_once_and_the_end_does_not_repeat_it():
    class Saver(BaseHook):
        def __init__(self):
            self.saved_at = []
            self.schedule = Schedule(100, state="checkpointing")

        def on_after_step(self, trainer):
            if trainer.step in (2, 4):
                trainer.request_checkpoint()

        def on_schedule(self, trainer):
            self.saved_at.append(trainer.step)

    saver = Saver()
    TinyTrainer(max_steps=4, hooks=[saver]).train()
    assert saver.saved_at == [2, 4]


def test_a_requested_save_that_no_hook_makes_is_said(caplog):
    class Asker(BaseHook):
        def on_after_step(self, trainer):
            if trainer.step == 2:
                trainer.request_checkpoint()

    with caplog.at_level("WARNING", logger="trainloop"):
        TinyTrainer(max_steps=3, hooks=[Asker()]).train()
    assert [r.getMessage() for r in caplog.records] == [
        "A checkpoint was requested at step 2, but no hook of this run saves one (add a CheckpointingHook)"
    ]


class _Saver(BaseHook):
    """Saves (records) in checkpointing only when a request asks: its own schedule is never due in these runs."""

    def __init__(self):
        self.saved_at = []
        self.schedule = Schedule(100, state="checkpointing", at_end=False)

    def on_schedule(self, trainer):
        self.saved_at.append(trainer.step)


class _AskInCheckpointing(BaseHook):
    """Requests a save from its own on_schedule, in checkpointing, every 3 steps."""

    def __init__(self):
        self.schedule = Schedule(3, state="checkpointing", at_end=False)

    def on_schedule(self, trainer):
        trainer.request_checkpoint()


@pytest.mark.parametrize("asker_first", [True, False])
def test_a_save_requested_in_checkpointing_is_met_by_the_saves_of_that_step(asker_first):
    saver, asker = _Saver(), _AskInCheckpointing()
    TinyTrainer(max_steps=8, hooks=[asker, saver] if asker_first else [saver, asker]).train()
    assert saver.saved_at == [3, 6]  # not 4, 5, 6, 7, 8: the request is met where it is made


def test_a_save_requested_by_a_checkpointing_callback_is_that_steps_save():
    class AskOnEnter(BaseHook):
        def on_enter_checkpointing(self, trainer):
            if trainer.step in (2, 5):
                trainer.request_checkpoint()

    class DueAtTwoAndFive(BaseHook):  # enters checkpointing at 2 and 5, saving nothing itself
        def __init__(self):
            self.schedule = Schedule(100, state="checkpointing", at_end=False, also_at=frozenset({2, 5}))

        def on_schedule(self, trainer):
            pass

    saver = _Saver()
    trainer = TinyTrainer(max_steps=7, hooks=[DueAtTwoAndFive(), AskOnEnter(), saver])
    trainer.on_exit("checkpointing", lambda t: t.request_checkpoint())  # after the saves: met by them
    trainer.train()
    assert saver.saved_at == [2, 5]


def test_a_save_requested_as_the_run_ends_is_said(caplog, tmp_path):
    class AskAtEnd(BaseHook):
        def on_after_train(self, trainer):
            trainer.request_checkpoint()

    with caplog.at_level("WARNING", logger="trainloop"):
        TinyTrainer(max_steps=3, hooks=[AskAtEnd()]).train()
    assert [r.getMessage() for r in caplog.records] == [
        "A checkpoint was requested at step 3, but no hook of this run saves one (add a CheckpointingHook)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainloop"):
        TinyTrainer(max_steps=3, hooks=[_Saver(), AskAtEnd()]).train()
    assert [r.getMessage() for r in caplog.records] == [
        "A checkpoint was requested at step 3 as the run ended, after its last save: no save follows a request made "
        "in exiting (request it in on_after_step)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainloop"):  # the last step is saved: the request is met
        TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=10), AskAtEnd()]).train()
    assert caplog.records == []


def test_request_exit_ends_cleanly_and_an_exit_code_raises_system_exit():
    class Stop(BaseHook):
        def __init__(self, code=None):
            self.code = code

        def on_after_step(self, trainer):
            if trainer.step == 2:
                trainer.request_exit(self.code)

    trainer = TinyTrainer(max_steps=10, hooks=[Stop()])
    trainer.train()
    assert trainer.step == 2
    assert trainer.state is State.EXITING
    assert trainer.exit_requested
    hook = CaptureHook()
    trainer = TinyTrainer(max_steps=10, hooks=[Stop(143), hook])
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 143
    assert hook.calls[-1] == ("on_after_train", "exiting", 2)


def test_outside_callbacks_on_states_and_transitions():
    seen = []
    trainer = TinyTrainer(max_steps=2)
    trainer.on_enter("building", lambda t: seen.append(("enter building", t.state.value)))
    trainer.on_exit(State.BUILDING, lambda t: seen.append(("exit building", hasattr(t, "model"))))
    trainer.on_transition("stepping", "exiting", lambda t: seen.append(("finish", t.step)))
    trainer.train()
    assert seen == [("enter building", "building"), ("exit building", True), ("finish", 2)]


def test_an_error_moves_to_exiting_runs_after_train_and_propagates():
    class Boom(TinyTrainer):
        def forward(self, batch):
            if self.step == 2:
                raise ValueError("boom")
            return super().forward(batch)

    hook = CaptureHook()
    trainer = Boom(max_steps=5, hooks=[hook], trace=True)
    with pytest.raises(ValueError, match="boom"):
        trainer.train()
    assert trainer.state is State.EXITING
    assert trainer.trace[-1].trigger == "fail"
    assert trainer.trace[-1].step == 2
    assert hook.calls[-1] == ("on_after_train", "exiting", 2)


def test_build_hooks_must_return_hooks():
    with pytest.raises(TypeError, match="build_hooks\\(\\) item 0 is a str, not a BaseHook"):
        TinyTrainer(max_steps=1, hooks=["progress"]).train()


def test_missing_contract_methods_name_themselves():
    # Found by the preflight, all at once, before anything is built.
    with pytest.raises(PreflightError, match="BaseTrainer must implement build_data_loader\\(\\)\nBaseTrainer must implement build_model"):
        BaseTrainer(max_steps=1).train()


def test_log_and_log_images_dispatch_to_hooks():
    class Images(BaseHook):
        def __init__(self):
            self.images = []

        def on_log_images(self, trainer, records):
            self.images.append(records)

    capture, images = CaptureHook(), Images()
    trainer = TinyTrainer(max_steps=1, hooks=[capture, images])
    trainer.train()
    trainer.log({"a": {"b": 1.0}})
    trainer.log_images({"x": "img"})
    assert capture.logged == [{"a": {"b": 1.0}}]
    assert images.images == [{"x": "img"}]


def test_unwrap_sees_through_wrappers():
    inner = nn.Linear(2, 2)
    wrapped = nn.DataParallel(torch.compile(inner))
    assert BaseTrainer.unwrap(wrapped) is inner
    averaged = torch.optim.swa_utils.AveragedModel(wrapped)  # holds a deep copy
    assert isinstance(BaseTrainer.unwrap(averaged), nn.Linear)
    assert BaseTrainer.unwrap(averaged) is averaged.module.module._orig_mod
    trainer = TinyTrainer(max_steps=1)
    trainer.train()
    assert trainer.unwrapped_model is trainer.model


def test_diagram_is_available_before_training():
    trainer = TinyTrainer(max_steps=1)
    assert "accumulating --> accumulating: accumulate [microsteps_remain]" in trainer.diagram()
    assert '"retrying" -> "accumulating"' in trainer.diagram("dot")


def test_losses_stay_on_device_until_a_hook_reads_them():
    # Nothing in the step converts a loss to a Python number (that would be a host sync).
    hook = CaptureHook()
    TinyTrainer(max_steps=2, gradient_accumulation_steps=3, hooks=[hook]).train()
    assert all(isinstance(loss, torch.Tensor) for info in hook.step_infos for loss in info.loss)
    assert math.isfinite(float(torch.stack(hook.step_infos[-1].loss).mean()))


class Declared(TinyTrainer):
    """Leaves the optimizer and schedule to the settings."""

    build_optimizer = BaseTrainer.build_optimizer


def test_optimizer_and_schedule_declared_in_settings_are_built_and_seed_applies():
    def make():
        return Declared(
            max_steps=6, seed=7,
            optimizer={"name": "AdamW", "lr": 0.01, "no_weight_decay": ["bias"]},
            lr_schedule={"name": "linear", "warmup_steps": 2},
        )

    first, second = make(), make()
    first.train()
    second.train()
    assert isinstance(first.optimizer, torch.optim.AdamW)
    assert [g["name"] for g in first.optimizer.param_groups] == ["decay", "no_decay"]
    assert isinstance(first.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
    for a, b in zip(params(first), params(second)):
        assert torch.equal(a, b)


def test_no_optimizer_anywhere_is_a_clear_error():
    with pytest.raises(PreflightError, match="optimizer: none declared, and Declared does not implement build_optimizer\\(\\)"):
        Declared(max_steps=1).train()


@pytest.mark.parametrize(("run", "said"), [
    ("train", "what a run trains is forward() and the build_* methods"),
    ("predict", "what a predict run does per batch is predict_step(), over build_predict_data_loader()'s data"),
    ("evaluate", "rename your validation method (e.g. val_metrics)"),
])
def test_a_trainer_that_overrides_a_run_is_refused_when_the_class_is_defined(run, said):
    # Issue 29: train() and predict() were not refused, unlike evaluate(): the run would silently be the user's method.
    with pytest.raises(TypeError, match=rf"^Mine\.{run} overrides BaseTrainer\.{run}\(\), the {run} run: {re.escape(said)}"):
        type("Mine", (BaseTrainer,), {run: lambda self: None})
