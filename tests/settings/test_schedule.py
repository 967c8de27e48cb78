"""The learning-rate schedule declared in settings: shapes, param groups, resume, validation."""

from __future__ import annotations

import io
import itertools
import math
import re

import pytest
import torch
from helper_hooks import ExitAt
from pydantic import ValidationError
from tiny_trainer import TinyTrainer
from torch import nn

from trainloop import BaseHook, BaseTrainer, TrainerSettings
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.stats import StatsHook
from trainloop.settings.optimizer import OptimizerSettings, build_optimizer
from trainloop.settings.schedule import LR_SCHEDULES, LrScheduleSettings, build_lr_scheduler, lr_factor

# -- helpers ------------------------------------------------------------------------------------


def lrs_over(scheduler, optimizer, steps: int) -> list[list[float]]:
    """The lr of every group used at each of ``steps`` optimizer steps, then the one after."""
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    seen.append([group["lr"] for group in optimizer.param_groups])
    return seen


def sgd(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def schedule(max_steps: int, optimizer=None, **settings):
    optimizer = optimizer or sgd(1.0)
    scheduler = build_lr_scheduler(LrScheduleSettings(**settings), optimizer, max_steps)
    return lrs_over(scheduler, optimizer, max_steps)


def firsts(rows: list[list[float]]) -> list[float]:
    return [row[0] for row in rows]


# -- learning-rate schedules -----------------------------------------------------------------------


def test_constant_without_and_with_warmup():
    assert firsts(schedule(5, name="constant")) == [1.0] * 6
    lrs = firsts(schedule(6, name="constant", warmup_steps=3))
    assert lrs == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("final", [None, 0.1])
def test_linear_decays_to_the_final_ratio(final):
    base, steps = 0.2, 8
    lrs = firsts(schedule(steps, sgd(base), name="linear", final_lr_ratio=final))
    r = final or 0.0
    expected = [base * (1 - (1 - r) * j / steps) for j in range(steps + 1)]
    assert lrs == pytest.approx(expected)
    assert lrs[0] == pytest.approx(base)
    assert lrs[-1] == pytest.approx(base * r)


@pytest.mark.parametrize("final", [None, 0.25])
def test_cosine_after_warmup(final):
    base, warmup, steps = 0.4, 2, 10
    lrs = firsts(schedule(steps, sgd(base), name="cosine", warmup_steps=warmup, final_lr_ratio=final))
    r = final or 0.0
    decay = steps - warmup
    ramp = [base * k / (warmup + 1) for k in range(1, warmup + 1)]
    cosine = [base * (r + (1 - r) * (1 + math.cos(math.pi * j / decay)) / 2) for j in range(decay + 1)]
    assert lrs == pytest.approx(ramp + cosine)
    assert lrs[warmup] == pytest.approx(base)  # the peak, right after warmup
    assert lrs[-1] == pytest.approx(base * r)  # reached as the last step completes
    assert min(lrs[warmup:]) == pytest.approx(base * r)


def test_linear_with_warmup_scales_every_group_by_its_own_lr():
    rows = schedule(6, sgd(1.0, 0.1), name="linear", warmup_steps=2, final_lr_ratio=0.5)
    for column, base in enumerate((1.0, 0.1)):
        expected = [base / 3, base * 2 / 3] + [base * (1 - 0.5 * j / 4) for j in range(5)]
        assert [row[column] for row in rows] == pytest.approx(expected)


def test_warmup_ratio_is_rounded_up_to_whole_steps():
    settings = LrScheduleSettings(name="constant", warmup_ratio=0.25)
    assert settings.warmup_steps_for(10) == 3
    assert settings.warmup_steps_for(8) == 2
    assert LrScheduleSettings(name="constant", warmup_steps=4).warmup_steps_for(100) == 4
    assert LrScheduleSettings(name="constant").warmup_steps_for(100) == 0
    assert schedule(10, name="cosine", warmup_ratio=0.25) == schedule(10, name="cosine", warmup_steps=3)


def test_cosine_scales_every_group_by_its_own_lr():
    # Groups of different learning rates each decay to their own final_lr_ratio of it.
    base, warmup, steps, r = (1.0, 0.5, 0.01), 2, 10, 0.1
    rows = schedule(steps, sgd(*base), name="cosine", warmup_steps=warmup, final_lr_ratio=r)
    decay = steps - warmup
    for column, lr in enumerate(base):
        ramp = [lr * k / (warmup + 1) for k in range(1, warmup + 1)]
        cosine = [lr * (r + (1 - r) * (1 + math.cos(math.pi * j / decay)) / 2) for j in range(decay + 1)]
        assert [row[column] for row in rows] == pytest.approx(ramp + cosine)
        assert rows[-1][column] == pytest.approx(lr * r)


def test_a_declared_cosine_trains_groups_of_different_lrs():
    class TwoGroups(BaseTrainer):
        def build_data_loader(self):
            return itertools.repeat(torch.ones(2, 4))

        def build_model(self):
            return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

        def build_optimizer(self):
            first, second = self.model
            return torch.optim.SGD([{"params": first.parameters(), "lr": 0.1}, {"params": second.parameters(), "lr": 0.01}])

        def forward(self, batch):
            return self.model(batch).pow(2).mean(), {}

    trainer = TwoGroups(max_steps=4, lr_schedule={"name": "cosine", "final_lr_ratio": 0.5})
    trainer.train()
    assert [group["lr"] for group in trainer.optimizer.param_groups] == pytest.approx([0.05, 0.005])


def test_scheduler_is_a_torch_lambda_lr():
    optimizer = sgd(1.0)
    scheduler = build_lr_scheduler(LrScheduleSettings(name="cosine"), optimizer, 10)
    assert type(scheduler) is torch.optim.lr_scheduler.LambdaLR
    # The factor is a function of the step: not saved, so a resumed run uses its own settings.
    assert scheduler.state_dict()["lr_lambdas"] == [None]


@pytest.mark.parametrize("name", LR_SCHEDULES)
@pytest.mark.parametrize("stop", [1, 3, 6])
def test_state_dict_resumes_the_same_lrs(name, stop):
    steps, settings = 9, LrScheduleSettings(name=name, warmup_steps=3)
    optimizer = sgd(0.3, 0.3)
    straight = lrs_over(build_lr_scheduler(settings, optimizer, steps), optimizer, steps)

    optimizer = sgd(0.3, 0.3)
    scheduler = build_lr_scheduler(settings, optimizer, steps)
    lrs_over(scheduler, optimizer, stop)
    saved = io.BytesIO()
    torch.save({"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)

    optimizer = sgd(0.3, 0.3)
    resumed = build_lr_scheduler(settings, optimizer, steps)
    # In the trainer's order: the scheduler first, then the optimizer (whose lr wins).
    resumed.load_state_dict(state["scheduler"])
    optimizer.load_state_dict(state["optimizer"])
    torch.testing.assert_close(torch.tensor(lrs_over(resumed, optimizer, steps - stop)), torch.tensor(straight[stop:]))


# -- schedules: invalid settings -------------------------------------------------------------------


def test_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValidationError) as info:
        LrScheduleSettings(name="exponential")
    message = str(info.value)
    assert all(f"'{name}'" in message for name in LR_SCHEDULES)
    assert info.value.errors()[0]["loc"] == ("name",)


def test_both_warmup_forms_are_an_error():
    with pytest.raises(ValidationError, match="warmup_steps or warmup_ratio, not both"):
        LrScheduleSettings(name="linear", warmup_steps=10, warmup_ratio=0.1)


def test_final_lr_ratio_does_not_apply_to_constant():
    with pytest.raises(ValidationError, match="final_lr_ratio applies to the linear and cosine"):
        LrScheduleSettings(name="constant", final_lr_ratio=0.1)


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.0}, "warmup_steps"),
        ({"warmup_steps": "5"}, "warmup_steps"),
        ({"warmup_ratio": -0.1}, "warmup_ratio"),
        ({"warmup_ratio": 1.0}, "warmup_ratio"),
        ({"final_lr_ratio": -0.5}, "final_lr_ratio"),
        ({"final_lr_ratio": 1.5}, "final_lr_ratio"),
        ({"final_lr_ratio": "0.1"}, "final_lr_ratio"),
        ({"decay": 0.1}, "decay"),
    ],
)
def test_bad_schedule_values_are_errors_at_the_field(arguments, field):
    with pytest.raises(ValidationError) as info:
        LrScheduleSettings(name="linear", **arguments)
    assert {error["loc"][0] for error in info.value.errors()} == {field}


@pytest.mark.parametrize(
    ("settings", "max_steps", "warmup"),
    [
        ({"warmup_steps": 10}, 10, 10),
        ({"warmup_steps": 12}, 10, 12),
        ({"warmup_ratio": 0.95}, 10, 10),  # rounded up to every step
    ],
)
def test_a_run_shorter_than_its_warmup_only_warms_up_with_a_warning(settings, max_steps, warmup):
    with pytest.warns(UserWarning, match=rf"the warmup of {warmup} steps is not shorter than the run \({max_steps} steps\)"):
        lrs = schedule(max_steps, name="cosine", **settings)
    assert firsts(lrs)[:max_steps] == pytest.approx([k / (warmup + 1) for k in range(1, max_steps + 1)])


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py ``get_lr``, verbatim."""
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize(("max_iters", "lr_decay_iters"), [(60, 40), (40, 40), (30, 50)])
def test_nanogpts_get_lr_one_to_one(max_iters, lr_decay_iters):
    """Step k + 1 runs at get_lr(k), k = iter_num; a decay shorter than the run holds min_lr after it,
    a longer one is cut off by the run's end."""
    settings = TrainerSettings.model_validate(
        {"max_steps": max_iters, "lr_schedule": {"name": "cosine", "warmup_steps": 5, "decay_steps": lr_decay_iters, "final_lr": 6e-5}}
    )
    used = firsts(schedule(max_iters, sgd(6e-4), **settings.lr_schedule.model_dump(exclude_none=True)))[:max_iters]
    expected = [nanogpt_get_lr(it, 6e-4, 5, lr_decay_iters, 6e-5) for it in range(max_iters)]
    assert used == pytest.approx(expected, rel=1e-12, abs=0)


def test_an_absolute_final_lr_is_the_floor_of_every_group():
    rows = schedule(20, sgd(1.0, 0.1), name="linear", decay_steps=10, final_lr=0.05)
    assert rows[10] == pytest.approx([0.05, 0.05])
    assert rows[19] == pytest.approx([0.05, 0.05])
    assert rows[0] == pytest.approx([1.0, 0.1])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"name": "cosine", "final_lr": 0.1, "final_lr_ratio": 0.1}, "give final_lr or final_lr_ratio, not both"),
        ({"name": "constant", "decay_steps": 5}, "final_lr and decay_steps apply to the linear and cosine schedules"),
        ({"name": "cosine", "warmup_steps": 5, "decay_steps": 5}, r"decay_steps \(5\) must be greater than warmup_steps \(5\)"),
    ],
)
def test_contradictory_schedules_are_refused(arguments, message):
    with pytest.raises(ValidationError, match=message):
        LrScheduleSettings(**arguments)


@pytest.mark.parametrize("max_steps", [0, -3, True, 2.0])
def test_max_steps_must_be_a_positive_integer(max_steps):
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        build_lr_scheduler(LrScheduleSettings(name="constant"), sgd(1.0), max_steps)


def test_schedule_settings_round_trip_frozen_and_schema():
    for settings in (
        LrScheduleSettings(name="cosine", warmup_ratio=0.1, final_lr_ratio=0.1),
        LrScheduleSettings(name="linear", warmup_steps=5),
        LrScheduleSettings(name="constant"),
    ):
        assert LrScheduleSettings.model_validate_json(settings.model_dump_json()) == settings
    with pytest.raises(ValidationError):
        settings.warmup_steps = 3
    schema = LrScheduleSettings.model_json_schema()
    assert schema["properties"]["name"]["enum"] == list(LR_SCHEDULES)
    assert schema["additionalProperties"] is False
    assert all(field.get("description") for field in schema["properties"].values())


# -- in a trainer --------------------------------------------------------------------------------


class LrRecorder(StatsHook):
    """Keeps each emission's per-group learning rates."""

    def __init__(self) -> None:
        super().__init__(interval=1)
        self.lrs: list[dict[str, float]] = []

    def emit(self, trainer, stats):
        self.lrs.append(stats.lrs)



class DeclaredTrainer(TinyTrainer):
    """TinyTrainer whose optimizer and schedule come from settings."""

    optimizer_settings = OptimizerSettings(name="AdamW", lr=0.01, weight_decay=0.1, no_weight_decay=["bias"])
    schedule_settings = LrScheduleSettings(name="cosine", warmup_steps=2, final_lr_ratio=0.1)

    def build_optimizer(self):
        return build_optimizer(self.optimizer_settings, self.model)

    def build_lr_scheduler(self):
        return build_lr_scheduler(self.schedule_settings, self.optimizer, self.max_steps)


def test_trainer_runs_the_schedule_shows_group_lrs_and_resumes_it(tmp_path):
    steps = 8
    straight = LrRecorder()
    DeclaredTrainer(max_steps=steps, hooks=[straight], workspace=tmp_path / "straight").train()
    expected = firsts(schedule(steps, sgd(0.01), name="cosine", warmup_steps=2, final_lr_ratio=0.1))[:steps]
    assert [set(lrs) for lrs in straight.lrs] == [{"decay", "no_decay"}] * steps
    assert [lrs["decay"] for lrs in straight.lrs] == pytest.approx(expected)
    assert [lrs["no_decay"] for lrs in straight.lrs] == pytest.approx(expected)

    first = LrRecorder()
    split = tmp_path / "split"
    DeclaredTrainer(max_steps=steps, hooks=[first, ExitAt(3), CheckpointingHook(interval=3)], workspace=split).train()
    second = LrRecorder()
    DeclaredTrainer(max_steps=steps, hooks=[second, CheckpointingHook(interval=100)], workspace=split).train()
    assert len(first.lrs) == 3
    assert first.lrs + second.lrs == straight.lrs


def test_resuming_with_a_larger_max_steps_says_what_the_schedule_does(tmp_path):
    from trainloop.trainer import ChangedSettingsWarning

    class LrAfterStep(BaseHook):
        def __init__(self):
            self.lrs = {}

        def on_after_step(self, trainer):
            self.lrs[trainer.step] = trainer.optimizer.param_groups[0]["lr"]  # the next step's

    def make(max_steps, hook):
        settings = TrainerSettings(
            max_steps=max_steps, workspace=tmp_path, lr_schedule={"name": "cosine", "final_lr_ratio": 0.1},
            hooks=[{"type": "checkpointing", "interval": 4}],
        )
        return TinyTrainer(settings, hooks=[hook], lr=0.1)

    make(4, LrAfterStep()).train()
    hook = LrAfterStep()
    with pytest.warns(ChangedSettingsWarning) as caught:
        make(8, hook).train()
    factor = lr_factor(LrScheduleSettings(name="cosine", final_lr_ratio=0.1), 8)
    (note,) = [str(w.message) for w in caught if str(w.message).startswith("lr_schedule:")]
    assert "resuming after step 4 with max_steps 8" in note
    assert "the checkpoint's run had max_steps 4" in note
    assert f"step 6 runs at {factor(5):.4g} x each group's initial lr" in note
    assert "(the checkpoint's schedule had 0.1 there)" in note  # the old cosine had ended
    # The learning rate follows the schedule over the new max_steps, not back up a cosine.
    assert [hook.lrs[k] for k in range(5, 9)] == pytest.approx([0.1 * factor(k) for k in range(5, 9)])
    assert hook.lrs[8] == pytest.approx(0.1 * 0.1)


# -- what the schedule alone cannot tell (issue 29, defects 9 and 10) -----------------------------

WARMUP_PAST_DECAY = "lr_schedule: decay_steps (3) must be greater than the warmup (warmup_ratio 0.5 of max_steps 10: 5 steps)"
FLOOR_ABOVE_PEAK = (
    "lr_schedule: final_lr (1) is above the peak learning rate (0.1): the decay would climb; give a final_lr at most "
    "the peak, or final_lr_ratio"
)


def test_a_decay_ending_before_a_warmup_ratio_and_a_floor_above_the_peak_are_refused_by_validate(tmp_path):
    # A warmup_ratio warmed to the peak and dropped to the floor in one step; final_lr 1.0 over lr 0.1 made
    # the "decay" climb to 10x the peak, both without a word.
    import json

    from cli_process import Cli

    declared = {
        "warmup": {"max_steps": 10, "lr_schedule": {"name": "cosine", "warmup_ratio": 0.5, "decay_steps": 3}},
        "floor": {"max_steps": 10, "optimizer": {"name": "SGD", "lr": 0.1}, "lr_schedule": {"name": "cosine", "final_lr": 1.0}},
    }
    runs = {}
    for name, settings in declared.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**settings, "workspace": "ws"}))
        runs[name] = Cli("validate", f"{name}.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path)
    for name, said in (("warmup", WARMUP_PAST_DECAY), ("floor", FLOOR_ABOVE_PEAK)):
        result = runs[name].result()
        assert result.returncode == 2
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"trainloop validate: error: {name}.json: {said} (got "), line
        with pytest.raises(ValidationError, match=re.escape(said.removeprefix("lr_schedule: "))):
            TrainerSettings.model_validate(declared[name])
    assert not (tmp_path / "ws").exists()
    # Within bounds: a warmup shorter than the decay, a floor at the peak.
    TrainerSettings.model_validate({"max_steps": 10, "lr_schedule": {"name": "cosine", "warmup_ratio": 0.2, "decay_steps": 3}})
    TrainerSettings.model_validate({**declared["floor"], "lr_schedule": {"name": "cosine", "final_lr": 0.1}})


def test_what_only_the_built_run_knows_is_refused_before_the_first_step():
    # The optimizer built in code (its lr), the steps of max_epochs: known when the scheduler is built.
    floor = TinyTrainer(max_steps=4, lr_schedule={"name": "cosine", "final_lr": 1.0})  # TinyTrainer's SGD: lr 0.05
    with pytest.raises(ValueError, match=r"lr_schedule: final_lr \(1\) is above the peak learning rate \(0.05\)"):
        floor.train()
    assert floor.step == 0
    epochs = TinyTrainer(max_epochs=1, lr_schedule={"name": "cosine", "warmup_ratio": 0.5, "decay_steps": 3})  # 8 steps
    with pytest.raises(ValueError, match=r"decay_steps \(3\) must be greater than the warmup \(warmup_ratio 0.5 of max_steps 8: 4 steps\)"):
        epochs.train()
    assert epochs.step == 0
