"""Several optimizers by name: one update each per step, in order, on the step's batches (a GAN)."""

import itertools
import json
import logging
import re
import shutil
import warnings

import pytest
import torch
from cli_process import Cli, call
from helper_hooks import CaptureHook
from pydantic import ValidationError
from torch import nn

from trainloop import BaseHook, BaseTrainer, State, TrainerSettings, lr_find
from trainloop.checkpoint import read_checkpoint
from trainloop.core.result import RefusedRunError
from trainloop.core.step import NoGradientWarning
from trainloop.hooks import CheckpointingHook, LoggingHook


def batches(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 2, generator=g) * 0.5 + 1.0 for _ in range(n)]


class Gan(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))


def gan_loss(model, batch, optimizer):
    """DCGAN's losses; the noise comes from torch's global generator (which checkpoints restore)."""
    fake = model.generator(torch.randn(len(batch), 3))
    bce = nn.functional.binary_cross_entropy_with_logits
    if optimizer == "discriminator":
        real, faked = model.discriminator(batch), model.discriminator(fake.detach())
        return bce(real, torch.ones_like(real)) + bce(faked, torch.zeros_like(faked))
    logits = model.discriminator(fake)
    return bce(logits, torch.ones_like(logits))


class GanTrainer(BaseTrainer):
    def __init__(self, *args, hooks=(), data=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._hooks = list(hooks)
        self._data = data
        self.calls = []

    def build_data_loader(self):
        return self._data if self._data is not None else itertools.cycle(batches())

    def build_model(self):
        return Gan()

    def build_optimizer(self):
        return {
            "discriminator": torch.optim.Adam(self.model.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999)),
            "generator": torch.optim.Adam(self.model.generator.parameters(), lr=0.01, betas=(0.5, 0.999)),
        }

    def build_hooks(self):
        return self._hooks

    def forward(self, batch, optimizer):
        self.calls.append((self.step, optimizer, batch.sum().item()))
        loss = gan_loss(self.model, batch, optimizer)
        return loss, {f"{optimizer[0]}_loss": loss.detach()}


def hand_written(steps, accumulation=1):
    """``for name, opt in optimizers: opt.zero_grad(); loss = forward(batch, name); loss.backward(); opt.step()``."""
    model = Gan()
    optimizers = {
        "discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999)),
        "generator": torch.optim.Adam(model.generator.parameters(), lr=0.01, betas=(0.5, 0.999)),
    }
    data = itertools.cycle(batches())
    for _ in range(steps):
        step_batches = [next(data) for _ in range(accumulation)]
        for name, optimizer in optimizers.items():
            optimizer.zero_grad()
            for batch in step_batches:
                loss = gan_loss(model, batch, name)
                (loss / accumulation if accumulation > 1 else loss).backward()
            optimizer.step()
    return model


@pytest.mark.parametrize("accumulation", [1, 3])
def test_weights_equal_the_hand_written_loop_bit_for_bit(accumulation):
    trainer = GanTrainer(max_steps=12, gradient_accumulation_steps=accumulation, detect_non_finite_grads=False)
    trainer.train()
    reference = hand_written(12, accumulation)
    for mine, theirs in zip(trainer.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_each_update_calls_forward_with_its_name_on_the_steps_batches_in_declaration_order():
    trainer = GanTrainer(max_steps=2, gradient_accumulation_steps=2)
    trainer.train()
    names = [(step, name) for step, name, _ in trainer.calls]
    assert names == [(1, "discriminator")] * 2 + [(1, "generator")] * 2 + [(2, "discriminator")] * 2 + [
        (2, "generator")
    ] * 2
    sums = [total for _, _, total in trainer.calls]
    assert sums[0:2] == sums[2:4]  # the generator's update trains on the discriminator's batches
    assert sums[4:6] == sums[6:8]  # drawn once per step
    assert sums[4:6] != sums[0:2]


def test_every_update_of_an_epochs_last_step_trains_on_all_its_batches():
    # max_epochs, 6 batches an epoch, accumulation 3: the second step ends the epoch as its first update's last
    # microstep draws, and the generator's update still replays the step's three batches.
    trainer = GanTrainer(max_epochs=1, gradient_accumulation_steps=3, data=batches(6))
    trainer.train()
    names = [(step, name) for step, name, _ in trainer.calls]
    assert names == [(s, n) for s in (1, 2) for n in ("discriminator", "generator") for _ in range(3)]


def test_the_machine_shows_each_update():
    updates = []
    trainer = GanTrainer(max_steps=3, trace=True)
    trainer.on_enter(State.STEPPING, lambda t: updates.append((t.step, t.updating)))
    trainer.train()
    assert updates == [(s, n) for s in (1, 2, 3) for n in ("discriminator", "generator")]
    counts = trainer.trace.counts()
    assert counts[(State.STEPPING, State.ACCUMULATING, "next_update")] == 3
    assert counts[(State.STEPPING, State.ACCUMULATING, "begin_step")] == 2


def test_a_one_argument_forward_with_several_optimizers_is_refused():
    class OneArgument(GanTrainer):
        def forward(self, batch):
            return gan_loss(self.model, batch, "generator"), {}

    with pytest.raises(TypeError, match=r"OneArgument.forward\(\) takes no optimizer, but the run updates several "
                                        r"\(discriminator, generator\)"):
        OneArgument(max_steps=1).train()

    class Declared(BaseTrainer):
        def build_data_loader(self):
            return itertools.cycle(batches())

        def build_model(self):
            return Gan()

        def forward(self, batch):
            return None, {}

    declared = {"discriminator": {"name": "SGD", "lr": 0.1, "module": "discriminator"},
                "generator": {"name": "SGD", "lr": 0.1, "module": "generator"}}
    with pytest.raises(TypeError, match=r"takes no optimizer"):
        Declared(max_steps=1, optimizers=declared)  # at construction: the settings say there are several


def test_a_list_of_optimizers_is_refused_in_one_line_before_step_1(tmp_path):
    # Lightning's configure_optimizers returns lists: here several optimizers are a mapping of names.
    class Listed(GanTrainer):
        def build_optimizer(self):
            return [torch.optim.SGD(self.model.generator.parameters(), lr=0.1),
                    torch.optim.SGD(self.model.discriminator.parameters(), lr=0.1)]

    trainer = Listed(max_steps=1, workspace=tmp_path / "ws")
    with pytest.raises(RefusedRunError) as error:
        trainer.train()
    assert str(error.value) == (
        "Listed.build_optimizer() returned a list of 2: return one optimizer, or a mapping of names to optimizers "
        "(docs/optimizers.md)"
    )
    assert trainer.step == 0
    assert not (tmp_path / "ws").exists()


def test_a_forward_that_needs_a_name_with_one_optimizer_is_refused():
    class OneOptimizer(GanTrainer):
        def build_optimizer(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    with pytest.raises(TypeError, match=r"needs an optimizer's name \(optimizer\), but build_optimizer\(\) returned one"):
        OneOptimizer(max_steps=1).train()


def test_optimizers_declared_in_a_settings_file_each_optimize_their_module(tmp_path):
    class Declared(GanTrainer):
        build_optimizer = BaseTrainer.build_optimizer

    path = tmp_path / "run.json"
    path.write_text(json.dumps({
        "max_steps": 4,
        "optimizers": {
            "discriminator": {"name": "Adam", "lr": 0.01, "betas": [0.5, 0.999], "module": "discriminator"},
            "generator": {"name": "Adam", "lr": 0.01, "betas": [0.5, 0.999], "module": "generator"},
        },
        "lr_schedule": {"name": "linear", "warmup_steps": 2},
        "detect_non_finite_grads": False,
    }))
    trainer = Declared(TrainerSettings.from_file(path))
    trainer.train()
    assert list(trainer.optimizers) == ["discriminator", "generator"]
    model = trainer.model
    assert [p for g in trainer.optimizers["generator"].param_groups for p in g["params"]] == list(
        model.generator.parameters()
    )
    assert set(trainer.lr_schedulers) == {"discriminator", "generator"}
    assert [s.last_epoch for s in trainer.lr_schedulers.values()] == [4, 4]  # each stepped once per step
    with pytest.raises(AttributeError, match=r"trainer.optimizer: this trainer builds several \(discriminator, "
                                             r"generator\); read trainer.optimizers\[name\]"):
        _ = trainer.optimizer


def test_declaring_both_or_an_unknown_module_is_a_clear_error(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({
        "max_steps": 4, "optimizer": {"name": "SGD", "lr": 0.1}, "optimizers": {"g": {"name": "SGD", "lr": 0.1}},
    }))
    result = Cli("validate", "run.json", "--trainer", "tiny_trainer:TinyTrainer", cwd=tmp_path).result()
    assert result.returncode == 2
    assert "declare optimizer (one) or optimizers (several by name), not both" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    class Declared(GanTrainer):
        build_optimizer = BaseTrainer.build_optimizer

    with pytest.raises(RefusedRunError, match=r"^optimizers.critic.module: 'critic': Gan has no such submodule \(its "
                                              r"children: generator, discriminator\)$"):
        Declared(max_steps=1, optimizers={"critic": {"name": "SGD", "lr": 0.1, "module": "critic"},
                                          "generator": {"name": "SGD", "lr": 0.1, "module": "generator"}}).train()


def test_loss_and_lr_are_logged_per_optimizer(tmp_path):
    trainer = GanTrainer(max_steps=4, workspace=tmp_path, hooks=[LoggingHook(interval=2)])
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4]
    for row in rows:
        assert {"loss/discriminator", "loss/generator", "lr/discriminator", "lr/generator"} <= row.keys()
        assert "loss" not in row
        assert row["lr/discriminator"] == 0.01


def test_checkpoint_resume_is_bit_exact_and_other_optimizers_are_refused(tmp_path):
    data = torch.utils.data.DataLoader(torch.cat(batches()), batch_size=8)  # a position a checkpoint records

    def run(steps, workspace, **kwargs):
        trainer = GanTrainer(max_steps=steps, workspace=workspace, seed=0, data=data,
                             hooks=[CheckpointingHook(interval=3, exit_signals=[])], **kwargs)
        trainer.train()
        return trainer

    unbroken = run(6, tmp_path / "unbroken")
    run(3, tmp_path / "broken")
    saved = read_checkpoint(tmp_path / "broken" / "checkpoints" / "3")["training_state"]
    assert list(saved["optimizers"]) == ["discriminator", "generator"]
    assert set(saved["lr_scheduler"]) == set()  # none built
    resumed = run(6, tmp_path / "broken")
    for mine, theirs in zip(resumed.model.parameters(), unbroken.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)

    class OneOptimizer(GanTrainer):
        def build_optimizer(self):
            return torch.optim.Adam(self.model.parameters(), lr=0.01)

        def forward(self, batch, optimizer=None):
            return gan_loss(self.model, batch, "generator"), {}

    with pytest.raises(ValueError, match=r"the checkpoint holds the state of optimizers discriminator, generator, "
                                         r"and this run builds one optimizer"):
        OneOptimizer(max_steps=6, workspace=tmp_path / "broken",
                     hooks=[CheckpointingHook(interval=3, exit_signals=[])]).train()


class NanOnce(GanTrainer):
    """The generator's first update of step 2 gets a NaN loss (once)."""

    def forward(self, batch, optimizer):
        loss, records = super().forward(batch, optimizer)
        if self.step == 2 and optimizer == "generator" and not getattr(self, "failed", False):
            self.failed = True
            loss = loss * float("nan")
        return loss, records


def test_a_refused_second_update_is_retried_on_fresh_batches(caplog):
    trainer = NanOnce(max_steps=3, max_non_finite_grad_retries=1, trace=True)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        trainer.train()
    assert "Non-finite gradients at step 2; retrying (1/1)" in caplog.text
    step2 = [(name, total) for step, name, total in trainer.calls if step == 2]
    assert [name for name, _ in step2] == ["discriminator", "generator", "generator"]
    assert step2[2][1] != step2[1][1]  # the retry drew a fresh batch
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.trace.counts()[(State.RETRYING, State.ACCUMULATING, "redo_step")] == 1


def test_a_retried_update_keeps_the_applied_losses_and_drops_the_refused_ones(tmp_path):
    capture = CaptureHook()
    trainer = NanOnce(max_steps=3, max_non_finite_grad_retries=1, workspace=tmp_path, gradient_accumulation_steps=2,
                      hooks=[capture, LoggingHook(interval=1)])
    trainer.train()
    info = capture.step_infos[1]
    assert info.non_finite_grad_retries == 1
    assert [len(info.losses[name]) for name in ("discriminator", "generator")] == [2, 2]
    assert all(torch.isfinite(loss) for losses in info.losses.values() for loss in losses)
    # Every applied microstep's loss, in order: the discriminator's update, then the generator's retried one.
    assert [loss.item() for loss in info.loss] == [loss.item() for name in info.losses for loss in info.losses[name]]
    assert [list(records) for records in info.records] == [["d_loss"]] * 2 + [["g_loss"]] * 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["step"] == 2
    assert rows[1]["loss/generator"] is not None
    assert rows[1]["loss/discriminator"] is not None


def test_an_optimizer_whose_update_cannot_move_its_parameters_is_said_once():
    class Unreached(GanTrainer):
        def build_model(self):
            model = super().build_model()
            model.spare = nn.Linear(2, 2)  # no loss reaches it
            return model

        def build_optimizer(self):
            return {**super().build_optimizer(), "spare": torch.optim.SGD(self.model.spare.parameters(), lr=0.1)}

        def forward(self, batch, optimizer):
            return super().forward(batch, "generator" if optimizer == "spare" else optimizer)

    class Frozen(GanTrainer):
        def build_model(self):
            model = super().build_model()
            model.generator.requires_grad_(False)
            return model

    for trainer, which, params in ((Unreached(max_steps=3), "spare", 2), (Frozen(max_steps=3), "generator", 4)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        said = [str(w.message) for w in caught if issubclass(w.category, NoGradientWarning)]
        assert said == [  # once, though every step updates it
            f"optimizer {which!r} ({type(trainer.optimizers[which]).__name__}, {params} parameter(s)) moves none of "
            f"its parameters: none got a gradient in its first update, so {type(trainer).__name__}.forward()'s loss "
            "does not reach them or they are frozen (requires_grad=False); its updates change nothing"
        ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GanTrainer(max_steps=3).train()
    assert not [w for w in caught if issubclass(w.category, NoGradientWarning)]


def test_lr_find_with_several_optimizers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"lr_find\(\) sweeps one optimizer's learning rate, and "
                                         r"GanTrainer.build_optimizer\(\) returned several \(discriminator, generator\)"):
        lr_find(GanTrainer(max_steps=3))

    class Declared(GanTrainer):
        build_optimizer = BaseTrainer.build_optimizer

    declared = {"discriminator": {"name": "SGD", "lr": 0.1, "module": "discriminator"},
                "generator": {"name": "SGD", "lr": 0.1, "module": "generator"}}
    with pytest.raises(ValueError, match=r"and the settings declare several \(discriminator, generator\): run the test "
                                         r"with one of them, e.g. settings with optimizer: that one alone"):
        lr_find(Declared(max_steps=3, optimizers=declared))


def test_hooks_see_the_update_in_progress():
    seen = []

    class Watch(BaseHook):
        def on_before_optimizer_step(self, trainer):
            seen.append((trainer.step, trainer.updating))

    GanTrainer(max_steps=2, hooks=[Watch()]).train()
    assert seen == [(1, "discriminator"), (1, "generator"), (2, "discriminator"), (2, "generator")]


def test_inspect_and_progress_show_each_optimizer(tmp_path, caplog):
    from trainloop.hooks import ProgressHook

    trainer = GanTrainer(max_steps=2, workspace=tmp_path, hooks=[CheckpointingHook(interval=2, exit_signals=[]),
                                                                  ProgressHook(interval=2)])
    with caplog.at_level(logging.INFO, logger="trainloop"):
        trainer.train()
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step 2/2")]
    assert len(progress) == 1
    assert "loss/discriminator " in progress[0]
    assert "loss/generator " in progress[0]
    assert "lr/discriminator 1.00e-02" in progress[0]
    result = Cli("inspect", str(tmp_path / "checkpoints"), cwd=tmp_path).result()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("optimizer discriminator: Adam") for line in lines), result.stdout
    assert any(line.startswith("optimizer generator: Adam") for line in lines), result.stdout


ONE_ARGUMENT_TRAINER = """
import itertools

import torch
from torch import nn

from trainloop import BaseTrainer


class OneArgument(BaseTrainer):
    def build_data_loader(self):
        return itertools.cycle([torch.zeros(2, 2)])

    def build_model(self):
        return nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})

    def forward(self, batch):
        return self.model["a"](batch).sum(), {}
"""


@pytest.mark.parametrize("command", ["validate", "run"])
def test_declared_optimizers_and_a_one_argument_forward_are_one_line_before_anything_is_written(tmp_path, command):
    (tmp_path / "one_argument.py").write_text(ONE_ARGUMENT_TRAINER)
    (tmp_path / "run.json").write_text(json.dumps({
        "max_steps": 2, "workspace": "ws",
        "optimizers": {"a": {"name": "SGD", "lr": 0.1, "module": "a"}, "b": {"name": "SGD", "lr": 0.1, "module": "b"}},
    }))
    result = Cli(command, "run.json", "--trainer", "one_argument:OneArgument", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "optimizers: OneArgument.forward() takes no optimizer, but the run updates several (a, b)" in lines[0]
    assert not (tmp_path / "ws").exists()



TWO_PARTS = {"body": {"name": "SGD", "lr": 0.05, "module": "body"}, "head": {"name": "SGD", "lr": 0.05, "module": "head"}}


def two_part_settings(tmp_path, optimizers, name="run.json"):
    """The settings file of a run of ``cli_trainers:TwoPartTrainer`` with these ``optimizers``, in the workspace ``ws``."""
    settings = tmp_path / name
    settings.write_text(json.dumps({
        "max_steps": 2, "workspace": "ws", "optimizers": optimizers,
        "hooks": [{"type": "checkpointing", "interval": 2, "exit_signals": []}],
    }))
    return settings


def two_part_run(tmp_path, optimizers, *overrides, name="run.json"):
    """``trainloop run`` of :func:`two_part_settings`; started."""
    settings = two_part_settings(tmp_path, optimizers, name)
    return Cli("run", settings, "--trainer", "cli_trainers:TwoPartTrainer", *overrides, cwd=tmp_path)


def files(workspace):
    """Every file of ``workspace`` but ``runs.jsonl``, with its bytes."""
    return {p: p.read_bytes() for p in workspace.rglob("*") if p.is_file() and p.name != "runs.jsonl"}


def test_a_resume_with_other_optimizers_is_refused_in_one_line_exit_2_writing_nothing(tmp_path, isolated_cli, capsys):
    # The run to resume is made in this process, through main() (the same command without a
    # subprocess's ~6 s of CPU: torch, and torch._dynamo that torch's optimizers import); the
    # refused resumes, what this test is about, are real subprocesses.
    code, _, err = call(capsys, "run", two_part_settings(tmp_path, TWO_PARTS), "--trainer", "cli_trainers:TwoPartTrainer")
    assert code == 0, err
    changed = {
        "order": ({"head": TWO_PARTS["head"], "body": TWO_PARTS["body"]},
                  "the checkpoint holds the state of optimizers body, head, and this run builds optimizers head, body"),
        "names": ({"body": TWO_PARTS["body"], "top": TWO_PARTS["head"]},
                  "the checkpoint holds the state of optimizers body, head, and this run builds optimizers body, top"),
        "class": ({"body": TWO_PARTS["body"], "head": {**TWO_PARTS["head"], "name": "Adam", "lr": 0.01}},
                  "the checkpoint's optimizer 'head' state was saved by torch.optim.sgd.SGD, and this run's optimizer "
                  "'head' is torch.optim.adam.Adam"),
    }
    kept = {}
    for case in changed:  # each resumes its own copy of the workspace
        shutil.copytree(tmp_path / "ws", tmp_path / case)
        kept[case] = files(tmp_path / case)
    refused = {
        case: two_part_run(tmp_path, optimizers, "--set", "max_steps=4", "--set", f"workspace={case}", name=f"{case}.json")
        for case, (optimizers, _) in changed.items()
    }
    for case, (_, said) in changed.items():
        result = refused[case].result()
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("trainloop run: error:")]
        assert len(errors) == 1, result.stderr
        assert errors[0].startswith(f"trainloop run: error: {said}"), errors[0]
        assert errors[0].endswith("or start fresh (another workspace, or CheckpointingHook(load=None))")
        # Nothing written: no checkpoint, metric, settings.json, trace, nor a line in runs.jsonl.
        workspace = tmp_path / case
        assert files(workspace) == kept[case]
        runs = [json.loads(line) for line in (workspace / "runs.jsonl").read_text().splitlines()]
        assert [run["exit_code"] for run in runs] == [0]


def test_an_empty_mapping_from_build_optimizer_is_one_line_before_step_one():
    class NoOptimizer(GanTrainer):
        def build_optimizer(self):
            return {}

    trainer = NoOptimizer(max_steps=2)
    with pytest.raises(RefusedRunError) as refused:
        trainer.train()
    assert str(refused.value) == "NoOptimizer.build_optimizer() returned an empty mapping: no optimizer: give at least one"
    assert trainer.step == 0


def test_names_from_build_optimizer_are_checked_as_the_settings_check_them():
    class Slashed(GanTrainer):
        def build_optimizer(self):  # "g/x" and group "x" of "g" would both log lr/g/x
            gan = self.model
            return {
                "g": torch.optim.SGD([{"params": gan.generator[0].parameters(), "name": "x"},
                                      {"params": gan.generator[2].parameters(), "name": "y"}], lr=0.1),
                "g/x": torch.optim.SGD(gan.discriminator.parameters(), lr=0.1),
            }

    said = ("'g/x' cannot name an optimizer: a name begins with a letter or '_' and holds letters, digits, '_', '.' "
            "and '-' (a '/' would mix it up with another optimizer's param groups in lr/<name>/<group>)")
    trainer = Slashed(max_steps=2)
    with pytest.raises(RefusedRunError) as refused:
        trainer.train()
    assert str(refused.value) == f"Slashed.build_optimizer() returned optimizers 'g', 'g/x': {said}"
    assert trainer.step == 0
    assert trainer.calls == []
    with pytest.raises(ValidationError, match=re.escape(said)):  # the same line where the settings declare it
        TrainerSettings(max_steps=2, optimizers={"g": {"name": "SGD", "lr": 0.1}, "g/x": {"name": "SGD", "lr": 0.1}})


def test_a_module_the_model_lacks_is_one_line_naming_the_entry_exit_2_before_step_one(tmp_path):
    typo = {"body": TWO_PARTS["body"], "head": {**TWO_PARTS["head"], "module": "torch.optim.AdamWW"}}
    result = two_part_run(tmp_path, typo).result()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainloop run: error:")]
    assert errors == [
        "trainloop run: error: optimizers.head.module: 'torch.optim.AdamWW': ModuleDict has no such submodule (its "
        "children: body, head)"
    ], result.stderr
    assert not (tmp_path / "ws").exists()  # refused while building: the workspace it made is gone again


def test_evaluate_refuses_a_module_the_model_lacks_in_one_line(tmp_path):
    typo = {"body": TWO_PARTS["body"], "head": {**TWO_PARTS["head"], "module": "haed"}}
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "optimizers": typo,
                                                   "hooks": [{"type": "validation", "evaluate": "forward", "interval": 1}]}))
    result = Cli("evaluate", "run.json", "--trainer", "cli_trainers:TwoPartTrainer", "--checkpoint", "none",
                 cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "error" in line] == [
        "trainloop evaluate: error: optimizers.head.module: 'haed': ModuleDict has no such submodule (its children: "
        "body, head)"
    ]


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_a_resume_equals_the_unbroken_run_in_every_format(tmp_path, format):
    data = torch.utils.data.DataLoader(torch.cat(batches()), batch_size=8)

    def run(steps, workspace):
        trainer = GanTrainer(max_steps=steps, workspace=workspace, seed=0, data=data,
                             hooks=[CheckpointingHook(interval=3, format=format, exit_signals=[])])
        trainer.train()
        return trainer

    unbroken = run(6, tmp_path / "unbroken")
    run(3, tmp_path / "broken")
    resumed = run(6, tmp_path / "broken")
    for mine, theirs in zip(resumed.model.parameters(), unbroken.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    for name, optimizer in unbroken.optimizers.items():
        theirs, mine = optimizer.state_dict(), resumed.optimizers[name].state_dict()
        assert mine["param_groups"] == theirs["param_groups"]
        for index, state in theirs["state"].items():
            for key, value in state.items():
                assert torch.equal(mine["state"][index][key], value), (name, index, key)
    saved = read_checkpoint(tmp_path / "broken" / "checkpoints" / "6")["training_state"]
    assert list(saved["optimizers"]) == ["discriminator", "generator"]
