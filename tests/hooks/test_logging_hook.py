"""LoggingHook: the StatsHook aggregate reaches ``trainer.log`` every interval and at the end."""

from __future__ import annotations

import pytest
import torch
from helper_hooks import CaptureHook, ExitAt, LogCapture, MemoryHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.stats import StatsHook


def test_logs_at_multiples_of_interval_and_at_the_last_step():
    logs = LogCapture()
    TinyTrainer(max_steps=5, hooks=[LoggingHook(interval=2), logs]).train()
    assert [step for step, _ in logs.logged] == [2, 4, 5]


def test_records_are_the_stats_aggregate():
    capture, logs, stats = CaptureHook(), LogCapture(), StatsHook(interval=2)
    trainer = TinyTrainer(
        max_steps=4, grad_clip=0.5, gradient_accumulation_steps=2,
        hooks=[MemoryHook(lambda step: float(step * 1000)), stats, LoggingHook(interval=2), logs, capture],
    )
    trainer.train()

    (_, first), (_, second) = logs.logged
    assert set(first) == {
        "loss", "grad_norm", "lr", "step_time", "data_time", "non_finite_grad_retries", "max_memory", "records",
    }
    # The very numbers StatsHook computed over the same window.
    assert second == capture.step_infos[3].get("stats").to_records()
    losses = [loss.item() for info in capture.step_infos[:2] for loss in info.loss]
    assert first["loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert first["records"] == {"mse": pytest.approx(first["loss"], rel=1e-6)}
    norms = [info.grad_norm.item() for info in capture.step_infos[:2]]
    assert first["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-6)
    assert first["lr"] == {"group_0": 0.05}
    assert (first["max_memory"], second["max_memory"]) == (2000.0, 4000.0)
    assert first["non_finite_grad_retries"] == 0
    assert all(isinstance(v, float) for v in (first["loss"], first["step_time"], first["data_time"]))


def test_without_clipping_or_records_the_keys_are_absent():
    class NoRecords(TinyTrainer):
        def forward(self, batch):
            return super().forward(batch)[0], {}

    logs = LogCapture()
    NoRecords(max_steps=1, hooks=[LoggingHook(interval=1), logs]).train()
    assert set(logs.logged[0][1]) == {"loss", "lr", "step_time", "data_time", "non_finite_grad_retries"}


def test_lr_of_each_named_group_before_the_scheduler_step():
    class Scheduled(TinyTrainer):
        def build_optimizer(self):
            return torch.optim.SGD(
                [
                    {"params": self.model[0].parameters(), "lr": 0.1, "name": "body"},
                    {"params": self.model[2].parameters(), "lr": 0.01},
                ]
            )

        def build_lr_scheduler(self):
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.1)

    logs = LogCapture()
    Scheduled(max_steps=2, hooks=[LoggingHook(interval=1), logs]).train()
    assert [records["lr"] for _, records in logs.logged] == [
        {"body": pytest.approx(0.1), "group_1": pytest.approx(0.01)},
        {"body": pytest.approx(0.01), "group_1": pytest.approx(0.001)},
    ]


def test_an_exit_request_logs_the_last_steps_before_training_ends():
    logs = LogCapture()
    TinyTrainer(max_steps=100, hooks=[ExitAt(7), LoggingHook(interval=5), logs]).train()
    assert [step for step, _ in logs.logged] == [5, 7]


def test_defaults_and_settings_declaration():
    hook = LoggingHook()
    assert (hook.interval, hook.sync) == (10, True)
    assert HOOK_TYPES["logging"] is LoggingHook
    model = hook_settings_model(LoggingHook)
    built = model.model_validate_json('{"type": "logging", "interval": 3, "sync": false}').build()
    assert type(built) is LoggingHook
    assert (built.interval, built.sync) == (3, False)
    with pytest.raises(ValidationError, match="sync"):
        model.model_validate_json('{"type": "logging", "sync": "no"}')
    with pytest.raises(ValidationError, match="type"):
        model.model_validate_json('{"type": "stats", "interval": 3}')


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"interval": 0}, "interval"), ({"interval": "5"}, "interval"), ({"sync": None}, "sync"), ({"sync": 0}, "sync")],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(ValidationError) as error:
        LoggingHook(**kwargs)
    assert error.value.errors()[0]["loc"][-1] == name


def test_unknown_parameter_is_rejected():
    with pytest.raises(ValidationError, match="every"):
        LoggingHook(every=3)


def test_graph_with_settings_shows_the_logging_hook_a_run_adds_by_itself(tmp_path):
    import json

    from cli_process import Cli, cli_env

    declared = {"max_steps": 4, "workspace": "ws", "hooks": [{"type": "checkpointing", "interval": 2}]}
    (tmp_path / "adds.json").write_text(json.dumps(declared))
    (tmp_path / "declares.json").write_text(json.dumps({**declared, "hooks": [{"type": "logging", "interval": 5}]}))
    (tmp_path / "no_file.json").write_text(json.dumps({**declared, "metrics_file": False}))
    runs = {name: Cli("graph", "--settings", f"{name}.json", cwd=tmp_path, env=cli_env()) for name in ("adds", "declares", "no_file")}
    shown = {name: process.result().stdout for name, process in runs.items()}
    assert "logging (added by default) — LoggingHook, after stepping, every 10 steps and at the end" in shown["adds"]
    assert "added by default" not in shown["declares"]
    assert "logging — LoggingHook, after stepping, every 5 steps" in shown["declares"]
    assert "LoggingHook" not in shown["no_file"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adds.json", "declares.json", "no_file.json"]  # drew only


@pytest.mark.parametrize(
    ("items", "said"),
    [
        ("", "an empty key: give a key of forward's records (dotted for a nested one: tokens.input) (got '')"),
        ("tokens..input", "'tokens..input' has an empty part between its dots: give a key such as tokens.input (got 'tokens..input')"),
    ],
)
def test_an_empty_items_key_is_refused_by_validate(tmp_path, items, said):
    # Issue 29, defect 8: `items: ""` validated, then failed at the first emission with a TypeError.
    import json

    from cli_process import Cli

    hooks = [{"type": "logging", "interval": 2, "items": items}, {"type": "progress", "interval": 2, "items": items}]
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 4, "workspace": "ws", "hooks": hooks}))
    runs = [Cli(command, "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path) for command in ("validate", "run")]
    for command, run in zip(("validate", "run"), runs, strict=True):
        result = run.result()
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            f"trainloop {command}: error: run.json: hooks[{i}].items: {said}" for i in (0, 1)
        ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    with pytest.raises(ValidationError, match="items"):
        LoggingHook(items=items)
