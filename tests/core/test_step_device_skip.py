"""The non-finite guard decided on the device: an optimizer that skips a non-finite update in its
own kernel (torch's fused ones) is handed the verdict, and the loop reads it a step late from host
memory. Which optimizers take that path, what a skipped update leaves untouched, what it costs in
host reads, how the limit still ends the run, and how a skip shows (log, step_info, trace)."""

import copy
import itertools
import logging

import pytest
import torch
from cli_process import Cli
from helper_hooks import CaptureHook
from sync_counter import SyncCounter
from tiny_trainer import FlakyTrainer, TinyTrainer, make_data

from trainloop import BaseHook, State
from trainloop.checkpoint import latest_checkpoint
from trainloop.core.step import skips_on_device
from trainloop.hooks import CheckpointingHook
from trainloop.machine import read_skipped_updates, read_trace


def fused_adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, fused=True)


def fused_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)


def fused_adagrad(params, lr):
    return torch.optim.Adagrad(params, lr=lr, fused=True)


def foreach_adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, foreach=True)


FUSED = [fused_adamw, fused_sgd, fused_adagrad]


def params(trainer):
    return [p.detach().clone() for p in trainer.unwrapped_model.parameters()]


def assert_same(a, b):
    """Two nested records of tensors (state dicts, parameter lists) hold bitwise the same values."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


class Snapshots(BaseHook):
    """The weights and the optimizer's state dict at the start of each step and after its update."""

    def __init__(self):
        self.before, self.after = {}, {}

    def _take(self, trainer):
        return params(trainer), copy.deepcopy(trainer.optimizer.state_dict())

    def on_before_step(self, trainer):
        self.before[trainer.step] = self._take(trainer)

    def on_after_step(self, trainer):
        self.after[trainer.step] = self._take(trainer)


def test_which_optimizers_skip_on_the_device():
    model = torch.nn.Linear(2, 1)
    for build in FUSED:
        assert skips_on_device(build(model.parameters(), 0.1)), build.__name__
    assert skips_on_device(torch.optim.Adam(model.parameters(), fused=True))

    class MyAdamW(torch.optim.AdamW):  # a subclass keeping torch's step still qualifies
        pass

    class Stepping(torch.optim.AdamW):  # one with a step of its own may ignore the flag
        def step(self, closure=None):
            return super().step(closure)

    assert skips_on_device(MyAdamW(model.parameters(), fused=True))
    assert not skips_on_device(Stepping(model.parameters(), fused=True))
    for other in (
        foreach_adamw(model.parameters(), 0.1),
        torch.optim.AdamW(model.parameters(), foreach=False),
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.LBFGS(model.parameters()),
    ):
        assert not skips_on_device(other), type(other).__name__
    mixed = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "fused": False}], fused=True)
    assert not skips_on_device(mixed)  # its unfused group would refuse the flag


@pytest.mark.parametrize("optimizer", FUSED)
@pytest.mark.parametrize("settings", [{}, {"grad_clip": 1.0}, {"mixed_precision": "fp16"}], ids=["plain", "clip", "fp16"])
def test_a_skipped_update_leaves_weights_and_optimizer_state_untouched(optimizer, settings):
    snapshots = Snapshots()
    # Forward call 4 (step 4) is NaN: its update is skipped in the optimizer's kernel.
    trainer = FlakyTrainer(max_steps=6, nan_at={4}, max_non_finite_grad_retries=2, make_optimizer=optimizer,
                           hooks=[snapshots], trace=True, **settings)
    if settings.get("mixed_precision"):
        trainer.build_grad_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8)  # no overflow here
    trainer.train()
    assert trainer.trace.skipped == [4]
    assert trainer.trace.counts()[(State.STEPPING, State.RETRYING, "retry")] == 0  # a skip, not a retry
    assert trainer.step == 6
    assert_same(snapshots.after[4], snapshots.before[4])  # weights, moments, step counts, momentum
    assert_same(snapshots.after[4], snapshots.after[3])
    assert not all(torch.equal(a, b) for a, b in zip(snapshots.after[5][0], snapshots.after[4][0], strict=True))
    assert all(torch.isfinite(p).all() for p in params(trainer))


@pytest.mark.parametrize("optimizer", FUSED)
@pytest.mark.parametrize(
    "settings",
    [{}, {"grad_clip": 0.5}, {"gradient_accumulation_steps": 3}, {"mixed_precision": "fp16"}],
    ids=["plain", "clip", "accumulation", "fp16"],
)
def test_finite_runs_are_bitwise_equal_with_the_guard_on_and_off(optimizer, settings):
    runs = []
    for guard in (True, False):
        trainer = TinyTrainer(max_steps=12, make_optimizer=optimizer, detect_non_finite_grads=guard, **settings)
        if settings.get("mixed_precision"):  # fp16 guards whatever it says; low scale: nothing refused
            trainer.build_grad_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**4)
        trainer.train()
        runs.append((params(trainer), trainer.optimizer.state_dict()))
    assert_same(runs[0], runs[1])


# The window counted: from step 2's start to step 10's end, steps that log nothing.
@pytest.mark.parametrize("optimizer", [fused_adamw, fused_sgd])
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"grad_clip": 1.0},
        {"gradient_accumulation_steps": 3},
        {"mixed_precision": "fp16"},
        {"mixed_precision": "fp16", "grad_clip": 1.0},
        {"mixed_precision": "fp16", "detect_non_finite_grads": False},
    ],
    ids=["plain", "clip", "accumulation", "fp16", "fp16-clip", "fp16-unchecked"],
)
@pytest.mark.parametrize("nan_at", [(), (4, 7, 8)], ids=["finite", "skips"])
def test_zero_host_reads_per_update_on_the_device_path(monkeypatch, optimizer, settings, nan_at):
    marks = {}

    class Mark(BaseHook):
        def on_before_step(self, trainer):
            if trainer.step == 2:
                marks["start"] = counter.count

        def on_after_step(self, trainer):
            if trainer.step == 10:
                marks["end"] = counter.count

    accumulation = settings.get("gradient_accumulation_steps", 1)
    nan_calls = {accumulation * (step - 1) + 1 for step in nan_at}  # each step's first microstep
    batches = [(x.unsqueeze(0), y.unsqueeze(0)) for x, y in make_data(8)]
    counter = SyncCounter(monkeypatch)
    trainer = FlakyTrainer(max_steps=10, hooks=[Mark()], data=itertools.cycle(batches), make_optimizer=optimizer,
                           nan_at=nan_calls, max_non_finite_grad_retries=3, trace=True, **settings)
    if settings.get("mixed_precision"):  # a scale that does not overflow by itself here
        trainer.build_grad_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.train()
    assert marks["end"] - marks["start"] == 0
    updates = sum(1 for e in trainer.trace if e.trigger == "update" and e.step >= 2)
    assert updates == 9  # no retry: every refused update was a skip
    assert set(nan_at) <= set(trainer.trace.skipped)


def test_the_first_update_is_decided_on_the_host_and_refused_as_a_retry():
    # A fused optimizer builds its state in its first step, even a skipped one: until an
    # update is applied, the guard takes the synced path (stepping -> retrying).
    trainer = FlakyTrainer(max_steps=3, nan_at={1}, max_non_finite_grad_retries=1, make_optimizer=fused_sgd, trace=True)
    trainer.train()
    counts = trainer.trace.counts()
    assert counts[(State.STEPPING, State.RETRYING, "retry")] == 1
    assert trainer.trace.skipped == []
    assert trainer.step == 3
    assert trainer.calls == 4


def test_a_skip_is_reported_in_the_log_step_info_and_trace_file(tmp_path, caplog):
    capture = CaptureHook()
    trainer = FlakyTrainer(max_steps=5, nan_at={3}, max_non_finite_grad_retries=1, make_optimizer=fused_adamw,
                           hooks=[capture], workspace=tmp_path, trace=True)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        trainer.train()
    # Learned during step 4's update, before its on_after_step.
    assert [info.skipped_update for info in capture.step_infos] == [None, None, None, 3, None]
    assert "Non-finite gradients at step 3: its update was skipped (1 in a row, at most 1)" in caplog.text
    assert read_skipped_updates(tmp_path / "trace.jsonl") == [3]
    entries = read_trace(tmp_path / "trace.jsonl")  # the mark is not a transition
    assert [e.trigger for e in entries].count("update") == 5
    assert "retry" not in {e.trigger for e in entries}


def test_consecutive_skips_past_the_limit_end_the_run_one_step_late():
    snapshots = Snapshots()
    trainer = FlakyTrainer(max_steps=10, nan_at=set(range(3, 100)), max_non_finite_grad_retries=2,
                           make_optimizer=fused_adamw, hooks=[snapshots])
    with pytest.raises(
        RuntimeError,
        match=r"non-finite gradients at step 5 \(its update skipped on the device; the run stopped at step 6\) "
              r"after 3 skipped updates in a row \(max_non_finite_grad_retries=2\)$",
    ):
        trainer.train()
    assert trainer.step == 6
    assert_same(snapshots.after[5], snapshots.after[2])  # three skipped updates, nothing applied
    assert 6 not in snapshots.after  # stopped before step 6's update


def test_a_skip_is_never_saved_unread_and_the_fatal_one_is_not_saved(tmp_path):
    # Saving every step, the verdict is read before each save: the third skip in a row stops
    # the run at its own step, before its checkpoint.
    trainer = FlakyTrainer(max_steps=10, nan_at=set(range(4, 100)), max_non_finite_grad_retries=2,
                           make_optimizer=fused_adamw, workspace=tmp_path, hooks=[CheckpointingHook(interval=1)])
    with pytest.raises(RuntimeError, match=r"non-finite gradients at step 6 \(its update skipped on the device\) after 3"):
        trainer.train()
    assert trainer.step == 6
    assert latest_checkpoint(tmp_path / "checkpoints").name == "5"


def test_an_fp16_nan_storm_on_the_device_path_stops_at_the_loss_scale_floor():
    trainer = FlakyTrainer(max_steps=30, mixed_precision="fp16", min_loss_scale=1.0, make_optimizer=fused_adamw,
                           nan_at=set(range(5, 1000)), trace=True)
    trainer.build_grad_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with pytest.raises(RuntimeError, match=r"at step 9 \(its update skipped on the device; the run stopped at step "
                                           r"10\) after 5 skipped updates in a row: under fp16 the loss scale fell "
                                           r"to 0\.5, below min_loss_scale=1"):
        trainer.train()
    assert trainer.trace.skipped == [5, 6, 7, 8, 9]  # the scale 16 -> 8 -> 4 -> 2 -> 1 -> 0.5
    assert trainer.step == 10


def test_without_a_declared_limit_the_first_skip_ends_the_run():
    trainer = FlakyTrainer(max_steps=6, nan_at={3}, make_optimizer=fused_sgd)
    with pytest.raises(RuntimeError, match=r"max_non_finite_grad_retries is None, so no update may be skipped"):
        trainer.train()
    assert trainer.step == 4


@pytest.mark.parametrize("optimizer", [None, foreach_adamw], ids=["sgd", "foreach-adamw"])
def test_optimizers_that_cannot_skip_keep_the_synced_retry(optimizer):
    trainer = FlakyTrainer(max_steps=4, nan_at={3}, max_non_finite_grad_retries=1, make_optimizer=optimizer, trace=True)
    trainer.train()
    counts = trainer.trace.counts()
    assert counts[(State.STEPPING, State.RETRYING, "retry")] == 1
    assert trainer.trace.skipped == []
    assert trainer.step == 4
    assert trainer.calls == 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "settings", [{}, {"grad_clip": 1.0}, {"mixed_precision": "fp16"}], ids=["plain", "clip", "fp16"]
)
def test_the_device_path_never_synchronises_on_cuda(settings):
    class SyncsAreErrors(BaseHook):
        """From step 2's start to step 9's end, a synchronising CUDA call raises."""

        def on_before_step(self, trainer):
            if trainer.step == 2:
                torch.cuda.set_sync_debug_mode("error")

        def on_after_step(self, trainer):
            if trainer.step == 9:
                torch.cuda.set_sync_debug_mode("default")

    # The batches already on the GPU: copying pageable memory to it is a synchronising call.
    batches = [(x.unsqueeze(0).cuda(), y.unsqueeze(0).cuda()) for x, y in make_data(8)]
    trainer = FlakyTrainer(max_steps=10, nan_at={5}, max_non_finite_grad_retries=1, make_optimizer=fused_adamw,
                           data=itertools.cycle(batches), device="cuda", hooks=[SyncsAreErrors()], trace=True,
                           **settings)
    if settings.get("mixed_precision"):
        trainer.build_grad_scaler = lambda: torch.amp.GradScaler("cuda", init_scale=2.0**4)
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.trace.skipped == [5]
    assert trainer.step == 10


@pytest.mark.parametrize("fused", [True, False])
def test_a_declared_fused_optimizer_skips_and_an_unfused_one_retries_from_the_cli(tmp_path, fused):
    (tmp_path / "run.yaml").write_text(
        "max_steps: 5\nworkspace: ws\ntrace: true\nmax_non_finite_grad_retries: 1\nnan_at_steps: [3]\n"
        "optimizer: {name: AdamW, lr: 0.01, fused: true}\n"
    )
    run = Cli("run", "run.yaml", "--trainer", "cli_trainers:CliTrainer", "--set", f"optimizer.fused={str(fused).lower()}",
              cwd=tmp_path).result()
    assert run.returncode == 0, run.stderr
    trace = tmp_path / "ws" / "trace.jsonl"
    retries = [e.step for e in read_trace(trace) if e.trigger == "retry"]
    if fused:
        assert read_skipped_updates(trace) == [3]
        assert retries == []
        assert "Non-finite gradients at step 3: its update was skipped (1 in a row, at most 1)" in run.stderr
    else:
        assert read_skipped_updates(trace) == []
        assert retries == [3]
        assert "Non-finite gradients at step 3; retrying (1/1)" in run.stderr


def resumable(workspace, max_steps, nan_at_steps, resumed_at=0, **kwargs):
    """A fused AdamW run in ``workspace`` saving every ``max_steps``, NaN at the steps of ``nan_at_steps`` (counted
    over the whole run: a run resumed at ``resumed_at`` counts its own forward calls from there)."""
    nan_at = {"all"} if nan_at_steps == "all" else {step - resumed_at for step in nan_at_steps if step > resumed_at}
    return FlakyTrainer(max_steps=max_steps, nan_at=nan_at, make_optimizer=fused_adamw, workspace=workspace,
                        hooks=[CheckpointingHook(interval=4, exit_signals=[])], trace=True, **kwargs)


def test_a_run_resumed_right_before_a_skipped_update_skips_it_on_the_device_as_the_unbroken_run(tmp_path):
    unbroken = resumable(tmp_path / "unbroken", 8, {5}, max_non_finite_grad_retries=1)
    unbroken.train()
    assert unbroken.trace.skipped == [5]
    resumable(tmp_path / "stopped", 4, {5}, max_non_finite_grad_retries=1).train()
    resumed = resumable(tmp_path / "stopped", 8, {5}, resumed_at=4, max_non_finite_grad_retries=1)
    resumed.train()
    assert resumed.trace.skipped == [5]  # on the device, as the unbroken run: no synced retry on fresh batches
    assert resumed.trace.counts()[(State.STEPPING, State.RETRYING, "retry")] == 0
    assert resumed.calls == 4
    assert_same(params(resumed), params(unbroken))
    assert_same(resumed.optimizer.state_dict(), unbroken.optimizer.state_dict())


def test_skips_in_a_row_are_counted_across_a_resume():
    # Skipped: 4, 5 (saved at 5: two in a row), then 6, the third, which max_non_finite_grad_retries=2 refuses.
    said = (r"non-finite gradients at step 6 \(its update skipped on the device; the run stopped at step 7\) after 3 "
            r"skipped updates in a row \(max_non_finite_grad_retries=2\)$")
    unbroken = FlakyTrainer(max_steps=10, nan_at=set(range(4, 100)), max_non_finite_grad_retries=2,
                            make_optimizer=fused_adamw)
    with pytest.raises(RuntimeError, match=said):
        unbroken.train()
    stopped = FlakyTrainer(max_steps=5, nan_at={4, 5}, max_non_finite_grad_retries=2, make_optimizer=fused_adamw)
    stopped.train()
    saved = stopped.state_dict()
    resumed = FlakyTrainer(max_steps=10, nan_at={"all"}, max_non_finite_grad_retries=2, make_optimizer=fused_adamw)
    resumed.on_enter(State.RESTORING, lambda t: t.load_state_dict(saved))
    with pytest.raises(RuntimeError, match=said):
        resumed.train()
    assert resumed.step == unbroken.step == 7
