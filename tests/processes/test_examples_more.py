"""The cfgx + specbuild and character-level LM examples run end to end, as their READMEs say."""

import importlib.util
import json
import logging
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from trainloop.hooks.ema import EmaHook
from trainloop.trainer import ChangedSettingsWarning

ROOT = Path(__file__).resolve().parents[2]
CONFIG_BUILDER = ROOT / "examples" / "config_builder"
CHAR_LM = ROOT / "examples" / "char_lm"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config_builder():
    pytest.importorskip("sklearn")
    pytest.importorskip("cfgx")
    pytest.importorskip("specbuild")
    return load(CONFIG_BUILDER / "train.py")


@pytest.fixture(scope="module")
def char_lm():
    return load(CHAR_LM / "train.py")


@pytest.fixture
def one_thread():
    # The char LM is tiny: intra-op threads only add synchronisation, and on a shared machine
    # their spin-waits cost more than the work. One thread keeps the test's time predictable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- config_builder --------------------------------------------------------------------------------


def test_config_builder_reaches_95_percent_and_resumes(config_builder, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # the config's workspace is relative: runs/config_builder
    with caplog.at_level(logging.INFO, logger="trainloop"):
        accuracy = config_builder.main([])
    assert accuracy >= 0.95
    assert "Step 400/400" in caplog.text
    workspace = tmp_path / "runs" / "config_builder"
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir()) == ["200", "400", "latest"]
    # The specs are settings: recorded as data with the run, cfgx's references resolved.
    recorded = json.loads((workspace / "settings.json").read_text())
    assert recorded["model"]["type"] == "torch.nn.Sequential"
    assert [layer.get("out_features") for layer in recorded["model"]["*"]] == [128, None, 10]
    assert recorded["lr_scheduler"]["T_max"] == 400
    assert recorded["optimizer"] == {"type": "partial:torch.optim.AdamW", "lr": 0.01, "weight_decay": 1e-4}

    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChangedSettingsWarning)  # the same config: the same settings
        with caplog.at_level(logging.INFO, logger="trainloop"):
            assert config_builder.main([]) == accuracy  # resumed at step 400: nothing left to train
    assert "at step 400: the run is already complete (400 steps); nothing to train" in caplog.text
    assert "Step " not in caplog.text


def test_config_builder_composes_files_and_overrides(config_builder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = config_builder.build_trainer(
        [CONFIG_BUILDER / "quick.py"], ["hidden_dim=16", "trainer.max_steps=30"]
    )
    assert isinstance(trainer, config_builder.DigitsTrainer)
    settings = trainer.settings
    assert settings.max_steps == 30
    assert settings.workspace is None
    assert settings.lr_scheduler["T_max"] == 30  # cfgx's final.trainer.max_steps follows the override
    assert [h.type for h in settings.hooks] == ["progress"]  # quick.py replaced the list
    trainer.train()
    assert trainer.step == 30
    assert [type(m) for m in trainer.model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    assert trainer.model[0].out_features == 16
    assert trainer.model[2].in_features == 16
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert trainer.optimizer.defaults["lr"] == 0.01
    assert trainer.optimizer.defaults["weight_decay"] == 1e-4
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert trainer.lr_scheduler.T_max == 30
    assert trainer.lr_scheduler.last_epoch == 30
    assert len(trainer.data.train_set) + len(trainer.data.val_set) == 1797
    assert not (tmp_path / "runs").exists()  # quick.py has no workspace


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ("trainer.max_steps=0", ValidationError, "max_steps"),
        ("trainer.seed='0'", ValidationError, "seed"),
        ("trainer.model.type=NoSuchModel", ValidationError, "'NoSuchModel' is neither registered"),
        ("trainer.model.type=torch.nn.NoSuchLayer", ValidationError, "'torch.nn.NoSuchLayer' is neither"),
        ("trainer.model.type=no_such_module.Model", ValidationError, "'no_such_module.Model' is neither"),
        ('trainer.model.*=expr:[{"type": "torch.nn.Linaer"}]', ValidationError, "*[0]: type 'torch.nn.Linaer'"),
        ("trainer.data.type!=", ValidationError, 'needs a "type"'),
        ("trainer.data.type=3", ValidationError, 'needs a "type"'),
        ("trainer.optimizer.type=torch.optim.AdamW", ValidationError, 'optimizer must be a factory: write "type": "partial:torch.optim.AdamW"'),
        ("trainer.lr_scheduler.type=torch.optim.lr_scheduler.CosineAnnealingLR", ValidationError, "lr_scheduler must be a factory"),
        ("trainer.optimizer.lr=expr:object()", ValidationError, "optimizer.lr"),
        ("trainer.no_such_setting=1", ValidationError, "no_such_setting"),
        ("trainer.hooks=expr:[{'type': 'no_such_hook'}]", ValidationError, "no_such_hook"),
        ("trainer.type=torch.nn.Identity", TypeError, "built a Identity, not a BaseTrainer"),
    ],
)
def test_config_builder_rejects_bad_configs_before_training(config_builder, tmp_path, monkeypatch, override, error, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as caught:
        config_builder.build_trainer([CONFIG_BUILDER / "config.py"], [override])
    assert message in str(caught.value)
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_config_builder_components_fail_when_built_with_bad_arguments(config_builder, tmp_path, monkeypatch):
    # Resolvable types with arguments the constructor rejects fail in the building state,
    # from the constructor itself, before any step.
    monkeypatch.chdir(tmp_path)
    trainer = config_builder.build_trainer([CONFIG_BUILDER / "quick.py"], ["trainer.data.no_such_argument=1"])
    with pytest.raises(TypeError, match="no_such_argument"):
        trainer.train()
    assert trainer.step == 0


# -- char_lm ---------------------------------------------------------------------------------------


def test_char_lm_learns_and_samples_from_the_ema_model(char_lm, tmp_path, monkeypatch, caplog, capsys, one_thread):
    monkeypatch.chdir(tmp_path)  # the text is found beside the example, not in the working directory
    with caplog.at_level(logging.INFO, logger="trainloop"):
        bpc = char_lm.main([])
    vocab = len(char_lm.CharCodec(char_lm.load_text()))
    uniform_bits = math.log2(vocab)
    assert bpc < 0.6 * uniform_bits  # validation, far below the uniform baseline

    losses = {int(step): float(loss) for step, loss in re.findall(r"Step (\d+)/200: .* loss (\d+\.\d+)", caplog.text)}
    assert sorted(losses) == [50, 100, 150, 200]
    assert losses[200] < losses[50]
    assert losses[200] < 0.6 * math.log(vocab)  # training loss, in nats
    assert re.findall(r"Step (\d+): validation \d+\.\d+ bits per character", caplog.text) == ["100", "200"]

    out = capsys.readouterr().out
    sample = re.search(r"^sample \(EMA model\): The trainer(.*?)\nvalidation ", out, re.MULTILINE | re.DOTALL).group(1)
    assert len(sample) == 160
    assert sample.strip()
    assert set(sample) <= set(char_lm.load_text())
    assert f"validation {bpc:.3f} bits per character after 200 steps" in out


def test_char_lm_batches_count_only_real_characters(char_lm):
    pieces = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    inputs, targets, mask = char_lm.pad_collate(pieces)
    assert inputs.tolist() == [[1, 2, 3], [5, 0, 0], [7, 8, 0]]
    assert targets.tolist() == [[2, 3, 4], [6, 0, 0], [8, 9, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]

    trainer = char_lm.CharLMTrainer(max_steps=1, d_model=16, n_heads=2, n_layers=1)
    trainer.data_loader = trainer.build_data_loader()
    trainer.model = trainer.build_model()
    loss, _ = trainer.forward((inputs, targets, mask))
    assert loss.count == 6
    # The sum covers the real positions only: changing a padded target changes nothing.
    padded = targets.clone()
    padded[1, 2] = 5
    assert torch.equal(trainer.forward((inputs, padded, mask))[0].sum, loss.sum)


def test_char_lm_split_holds_out_blocks_and_sequences_have_the_declared_lengths(char_lm):
    ids = torch.arange(1000)
    train, val = char_lm.split(ids, block=50, val_every=4)
    assert [len(v) for v in val] == [50] * 5
    assert sorted(torch.cat(train + val).tolist()) == ids.tolist()
    assert val[0].tolist() == list(range(150, 200))
    settings = char_lm.CharLMSettings(max_steps=1, context=20, min_length=5, stride=7)
    pieces = char_lm.training_sequences(train, settings, torch.Generator().manual_seed(0))
    assert all(6 <= len(p) <= 21 for p in pieces)
    assert {int(p[0]) for p in pieces} == {int(t[s]) for t in train for s in range(0, len(t) - 5, 7)}
    predicted = [p[1:] for p in char_lm.validation_sequences(val, context=20)]
    assert sorted(torch.cat(predicted).tolist()) == sorted(torch.cat([v[1:] for v in val]).tolist())


def test_char_lm_model_is_causal(char_lm):
    torch.manual_seed(0)
    model = char_lm.CharTransformer(vocab=10, context=8, d_model=16, n_heads=2, n_layers=2, ff_mult=2).eval()
    ids = torch.randint(0, 10, (2, 8))
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 10
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_length": 40, "context": 32}, "min_length (40) must not exceed context (32)"),
        ({"d_model": 30, "n_heads": 4}, "d_model (30) must be a multiple of n_heads (4)"),
        ({"temperature": -1.0}, "temperature"),
        ({"prompt": ""}, "prompt"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "8"}, "batch_size"),
        ({"context": 1}, "context"),
        ({"prompt": 3}, "prompt"),
    ],
)
def test_char_lm_rejects_bad_settings(char_lm, settings, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        char_lm.CharLMSettings(max_steps=1, **settings)


def test_char_lm_prompt_outside_the_vocabulary_fails_before_training(char_lm):
    # An optimizer declared, or the preflight would stop the run before the build checks the prompt.
    trainer = char_lm.CharLMTrainer(max_steps=1, prompt="\u2603 snowman", optimizer={"name": "SGD", "lr": 0.1})
    with pytest.raises(ValueError, match="not in the vocabulary: '\u2603'"):
        trainer.train()
    assert trainer.step == 0


def test_char_lm_settings_file_declares_the_shown_features(char_lm):
    settings = char_lm.CharLMSettings.from_file(CHAR_LM / "settings.json")
    assert settings.mixed_precision == "bf16"
    assert settings.gradient_accumulation_steps > 1
    assert settings.optimizer.name == "AdamW"
    assert settings.lr_schedule.name == "cosine"
    assert settings.lr_schedule.warmup_steps > 0
    assert EmaHook in {type(spec.build()) for spec in settings.hooks}


def test_char_lm_runs_from_another_settings_file_without_ema(char_lm, tmp_path, monkeypatch, capsys, one_thread):
    # A short fp32 run without the ema hook: main falls back to the trained model, and the
    # greedy sample from a one-character prompt is still text of the declared length.
    monkeypatch.chdir(tmp_path)
    settings = json.loads((CHAR_LM / "settings.json").read_text())
    settings.update(max_steps=5, mixed_precision=None, hooks=[], lr_schedule=None, prompt="T", temperature=0.0, sample_length=20)
    (tmp_path / "short.json").write_text(json.dumps(settings))
    bpc = char_lm.main(["short.json"])
    out = capsys.readouterr().out
    sample = re.search(r"^sample \(model\): T(.*?)\nvalidation ", out, re.MULTILINE | re.DOTALL).group(1)
    assert len(sample) == 20
    assert f"validation {bpc:.3f} bits per character after 5 steps" in out
