"""``init_from``: a run starts from another run's (or a file's) weights, and only when it resumes
nothing of its own; declared as a user would (keyword, settings file, the CLI)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from cli_process import Cli, cli_env
from safetensors.torch import save_file
from tiny_trainer import TinyTrainer
from torch import nn

from trainloop import TrainerSettings
from trainloop.checkpoint import CheckpointError
from trainloop.checkpoint.weights import load_weights, read_weights
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.ema import EmaHook


def pretrain(tmp_path, format="full", steps=5, hooks=()):
    """A finished run whose weights differ from TinyTrainer's fresh initialisation."""
    trainer = TinyTrainer(
        max_steps=steps, workspace=tmp_path / "pre", lr=0.2,
        hooks=[CheckpointingHook(interval=steps, format=format), *hooks],
    )
    trainer.train()
    return trainer


def weights_of(model):
    return {k: v.detach().clone() for k, v in TinyTrainer.unwrap(model).state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


class Probe(TinyTrainer):
    """Records the model's weights when training starts (after restoring)."""

    def build_hooks(self):
        probe = self

        class _Probe(CheckpointingHook.__mro__[1]):  # BaseHook
            def on_before_train(self, trainer):
                probe.initial = weights_of(trainer.model)

        return [*self._hooks, _Probe()]


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_a_fine_tune_starts_from_a_checkpoint_full_or_sharded(tmp_path, format):
    pre = pretrain(tmp_path, format)
    tune = Probe(max_steps=1, init_from=str(tmp_path / "pre" / "checkpoints"))  # a root: its latest
    tune.train()
    assert_same(tune.initial, weights_of(pre.model))
    assert tune.step == 1  # the step is the fine-tune's own, not the source's


def test_a_fine_tune_starts_from_a_safetensors_file_and_a_nanogpt_style_pt(tmp_path):
    source = {k: v + 1.0 for k, v in weights_of(TinyTrainer(max_steps=1).build_model()).items()}
    save_file(source, tmp_path / "w.safetensors")
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in source.items()}, "iter_num": 3}, tmp_path / "ckpt.pt")
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 1, "init_from": {"path": str(tmp_path / "w.safetensors")}}))
    from_file = Probe(TrainerSettings.from_file(tmp_path / "run.json"))
    from_file.train()
    assert_same(from_file.initial, source)
    from_pt = Probe(max_steps=1, init_from=tmp_path / "ckpt.pt")  # compiled keys cleaned
    from_pt.train()
    assert_same(from_pt.initial, source)


def test_ema_weights_can_be_the_source(tmp_path):
    ema = EmaHook(decay=0.5)
    pretrain(tmp_path, hooks=[ema])
    tune = Probe(max_steps=1, init_from={"path": str(tmp_path / "pre"), "weights": "ema"})  # a workspace
    tune.train()
    assert_same(tune.initial, weights_of(ema.ema_model.module))
    assert not torch.equal(tune.initial["0.weight"], weights_of(pretrain(tmp_path / "again").model)["0.weight"])


def test_a_preempted_fine_tune_resumes_its_own_checkpoint_and_never_reinitialises(tmp_path):
    pretrain(tmp_path)
    settings = {"max_steps": 4, "init_from": str(tmp_path / "pre" / "checkpoints"), "workspace": str(tmp_path / "tune")}
    first = TinyTrainer(**{**settings, "max_steps": 2}, hooks=[CheckpointingHook(interval=2)])
    first.train()
    at_two = weights_of(first.model)
    resumed = Probe(**settings, hooks=[CheckpointingHook(interval=2)])
    resumed.train()
    assert_same(resumed.initial, at_two)  # its own step-2 weights, not the pretrained ones
    assert resumed.step == 4


def test_strictness_prefixes_and_ignored_keys(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    source = {f"backbone.{k}": torch.full_like(v, 7.0) for k, v in model.state_dict().items() if k.startswith("0.")}
    source["backbone.extra"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as error:
        load_weights(model, source, strip_prefixes=["backbone."])
    assert str(error.value).splitlines() == [
        "init_from: missing key 2.weight (the model's own initialisation is kept)",
        "init_from: missing key 2.bias (the model's own initialisation is kept)",
        "init_from: unexpected key extra (not in the model, not loaded)",
        "init_from: set strict to false, or list keys in ignore or strip_prefixes",
    ]
    assert not torch.equal(model[0].weight, torch.full_like(model[0].weight, 7.0))  # nothing loaded
    head = model[2].weight.detach().clone()
    assert load_weights(model, source, strip_prefixes=["backbone."], ignore=["2.", "extra"]) == ["0.bias", "0.weight"]
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 7.0))
    assert torch.equal(model[2].weight, head)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        load_weights(model, source, strip_prefixes=["backbone."], strict=False)
    assert [r.getMessage() for r in caplog.records] == [
        "init_from: missing key 2.weight (the model's own initialisation is kept)",
        "init_from: missing key 2.bias (the model's own initialisation is kept)",
        "init_from: unexpected key extra (not in the model, not loaded)",
    ]


def test_a_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    source = dict(model.state_dict())
    source["2.weight"] = torch.zeros(2, 8)
    with pytest.raises(CheckpointError, match=r"^init_from: 2.weight: shape \(2, 8\) in the source, \(1, 8\) in the model$"):
        load_weights(model, source)


def test_tied_weights_count_as_loaded_when_their_twin_is(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.wte.weight

    model = Tied()
    loaded = load_weights(model, {"wte.weight": torch.ones(5, 3)})  # as transformers saves GPT-2
    assert loaded == ["wte.weight"]
    assert torch.equal(model.head.weight, torch.ones(5, 3))


def test_a_missing_source_is_refused_by_the_preflight_exit_2_nothing_written(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "init_from": "nowhere/model.safetensors"}))
    runs = [Cli(command, "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=cli_env()) for command in ("run", "validate")]
    for command, process in zip(("run", "validate"), runs):
        result = process.result()
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.splitlines() == [
            f"trainloop {command}: error: run.json: init_from.path: no checkpoint or weights file at 'nowhere/model.safetensors'"
        ]
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_reading_names_what_is_wrong(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        read_weights(tmp_path / "empty")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list.pt: not a state dict"):
        read_weights(tmp_path / "list.pt")
    (tmp_path / "text.pt").write_text("hello")  # torch's own error is a bare "101"
    with pytest.raises(CheckpointError, match=r"text.pt: cannot load: not a file torch.save wrote, or damaged \(KeyError"):
        read_weights(tmp_path / "text.pt")
    pretrain(tmp_path)
    said = r"weights='ema': this checkpoint holds no EMA weights \(the run that saved it had no such EMA hook\)"
    with pytest.raises(CheckpointError, match=said):
        read_weights(tmp_path / "pre", "ema")


@pytest.mark.parametrize(
    ("declared", "line"),
    [
        ({"init_from": ""}, "init_from: an empty path"),
        ({"init_from": {"path": ""}}, "init_from.path: an empty path"),
        ({"hooks": [{"type": "export", "path": ""}]}, "hooks[0].path: an empty path"),
        # A union of "latest" and a path: the path's own refusal, not "should be 'latest' or an empty path".
        ({"hooks": [{"type": "checkpointing", "interval": 1, "load": ""}]}, "hooks[0].load: an empty path; give a"),
    ],
)
def test_what_run_would_refuse_late_validate_refuses_first(tmp_path, declared, line):
    # Each of these would fail `run` after training (or after writing the workspace): `validate` refuses it first.
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", **declared}))
    runs = [Cli(command, "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=cli_env()) for command in ("run", "validate")]
    for command, process in zip(("run", "validate"), runs, strict=True):
        result = process.result()
        assert result.returncode == 2, result.stderr
        (said,) = result.stderr.splitlines()
        assert said.startswith(f"trainloop {command}: error: run.json: {line}"), said
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_averaged_weights_a_source_lacks_are_refused_before_anything_is_built(tmp_path):
    pretrain(tmp_path)  # a full checkpoint without an EMA hook
    save_file(weights_of(TinyTrainer(max_steps=1).build_model()), tmp_path / "plain.safetensors")
    for source, said in [
        ("pre", "init_from.weights: weights='ema', but "),
        ("plain.safetensors", "init_from.weights: weights='ema' needs a checkpoint; 'plain.safetensors' is a weights"),
    ]:
        settings = {"max_steps": 2, "workspace": "ws", "init_from": {"path": source, "weights": "ema"}}
        (tmp_path / "run.json").write_text(json.dumps(settings))
        result = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=cli_env()).result()
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"trainloop run: error: run.json: {said}"), line
        assert not (tmp_path / "ws").exists()
        if source == "pre":
            assert line.endswith("holds no such averaged weights (its hook entries: none)"), line


def test_a_model_whose_own_submodule_is_named_module_loads_its_weights_everywhere(tmp_path):
    # Issue 29, defect 1: every "module." was taken for DDP's and stripped, so such a model could not
    # load its own checkpoint or export in evaluate, predict and init_from (training and resuming worked).
    from predict_trainers import ModuleNamedTrainer, PredictSettings

    hooks = [{"type": "validation", "evaluate": "val_metrics", "interval": 4}, {"type": "checkpointing", "interval": 4}]
    settings = {"max_steps": 4, "workspace": "ws", "trainer": "predict_trainers:ModuleNamedTrainer", "hooks": hooks}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    trained = ModuleNamedTrainer(PredictSettings.model_validate({**settings, "workspace": str(tmp_path / "ws")}))
    trained.train()
    assert next(iter(trained.model.state_dict())) == "module.0.weight"
    assert Cli("export", "ws", "-o", "model.safetensors", cwd=tmp_path).result().returncode == 0
    for name, source in (("from_checkpoint", "ws"), ("from_export", "model.safetensors")):
        (tmp_path / f"{name}.json").write_text(json.dumps({**settings, "workspace": name, "init_from": source}))
    runs = {
        "evaluate": Cli("evaluate", "run.json", cwd=tmp_path),
        "predict": Cli("predict", "run.json", "-o", "preds.safetensors", cwd=tmp_path),
        **{name: Cli("evaluate", f"{name}.json", "--checkpoint", "none", cwd=tmp_path) for name in ("from_checkpoint", "from_export")},
    }
    expected = {"val/loss": trained.result.metrics["val/loss"]}
    for name, run in runs.items():
        result = run.result()
        assert result.returncode == 0, (name, result.stderr[-2000:])
        assert "missing key" not in result.stderr
        assert "Traceback" not in result.stderr
        if name != "predict":
            assert json.loads(result.stdout) == expected, name
    assert "Initialised 4 weights of the model from model.safetensors" in runs["from_export"].result().stderr
    from safetensors.torch import load_file

    x = torch.stack([x for x, _ in __import__("tiny_trainer").make_data(13, seed=1)])
    torch.testing.assert_close(load_file(tmp_path / "preds.safetensors")["y"], trained.model(x).detach())


def test_a_wrappers_prefix_goes_only_where_the_keys_fit_the_model_better_without_it():
    from predict_trainers import NamedModule

    model = NamedModule()
    own = {k: v + 1.0 for k, v in model.state_dict().items()}
    for saved in (own, {f"module.{k}": v for k, v in own.items()}, {f"_orig_mod.module.{k}": v for k, v in own.items()}):
        fresh = NamedModule()
        assert load_weights(fresh, saved) == sorted(own)  # as saved; by DDP around it; compiled DDP around it
        assert_same(fresh.state_dict(), own)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = {f"module.{k}": v for k, v in plain.state_dict().items()}
    assert load_weights(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), wrapped) == sorted(plain.state_dict())


DAMAGED = {
    "empty": ("w.safetensors", lambda good: b"", "'w.safetensors' is empty"),
    "header cut": ("w.safetensors", lambda good: good[:100], "'w.safetensors' is not a readable .safetensors file (Error while deserializing header: invalid header length)"),
    "garbage": ("w.safetensors", lambda good: b"garbage garbage garbage", "'w.safetensors' is not a readable .safetensors file (Error while deserializing header: header too large)"),
    "data cut": ("w.safetensors", lambda good: good[:-10], "'w.safetensors' is not a readable .safetensors file (Error while deserializing header: incomplete metadata, file not fully covered)"),
    "safetensors named .pt": ("w.pt", lambda good: good, "'w.pt': it is a .safetensors file under a .pt name: name it .safetensors"),
}


def test_a_damaged_init_from_file_is_refused_before_anything_is_written(tmp_path):
    # Issue 29, defects 2 and 6: safetensors' own error naming no file (a traceback under `trainloop run`),
    # after settings.json, metrics.jsonl and runs.jsonl were written.
    source = weights_of(TinyTrainer(max_steps=1).build_model())
    save_file(source, tmp_path / "good.safetensors")
    good = (tmp_path / "good.safetensors").read_bytes()
    torch.save(source, tmp_path / "good.pt")
    cases = {**DAMAGED, "torch file named .safetensors": ("w.safetensors", lambda _: (tmp_path / "good.pt").read_bytes(), "'w.safetensors': it is a torch.save file, not a .safetensors file: name it .pt")}
    cases["torch file cut"] = ("w.pt", lambda _: (tmp_path / "good.pt").read_bytes()[:300], "'w.pt' is not a file torch.save wrote, or it is damaged")
    runs = {}
    for i, (name, (file, damage, _)) in enumerate(cases.items()):
        case = tmp_path / f"case{i}"
        case.mkdir()
        (case / file).write_bytes(damage(good))
        (case / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "init_from": file}))
        runs[name] = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=case)
    for i, (name, run) in enumerate(runs.items()):
        result = run.result()
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert result.stderr.splitlines() == [f"trainloop run: error: run.json: init_from.path: {cases[name][2]}"], name
        assert sorted(p.name for p in (tmp_path / f"case{i}").iterdir()) == sorted(["run.json", cases[name][0]]), name
        with pytest.raises(CheckpointError, match=f"^{tmp_path}/case{i}/{cases[name][0]}: cannot load: "):
            read_weights(tmp_path / f"case{i}" / cases[name][0])


def test_keys_that_do_not_fit_end_trainloop_run_with_one_line_per_key(tmp_path):
    save_file({"other.weight": torch.ones(2)}, tmp_path / "other.safetensors")
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "init_from": "other.safetensors"}))
    result = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path).result()
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert errors[0] == "trainloop run: error: init_from: missing key 0.weight (the model's own initialisation is kept)"
    assert errors[-1] == "trainloop run: error: init_from: set strict to false, or list keys in ignore or strip_prefixes"
    assert "Traceback" not in result.stderr
    assert json.loads((tmp_path / "ws" / "runs.jsonl").read_text())["error"].startswith("CheckpointError: init_from: missing key")
