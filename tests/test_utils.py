import math
from collections import namedtuple

import pytest
import torch

from trainloop import map_nested_tensor
from trainloop.utils import flatten_nested_dict, key_average


def test_map_nested_tensor_maps_tensors_in_any_nesting_and_keeps_the_rest():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "meta": ["id", 3, (torch.zeros(1), Pair(torch.ones(1), "s"))]}
    out = map_nested_tensor(lambda t: t + 1, batch)
    assert torch.equal(out["x"], torch.full((2,), 2.0))
    assert out["meta"][:2] == ["id", 3]
    inner = out["meta"][2]
    assert isinstance(inner, tuple)
    assert torch.equal(inner[0], torch.ones(1))
    assert isinstance(inner[1], Pair)
    assert torch.equal(inner[1].a, torch.full((1,), 2.0))
    assert inner[1].b == "s"
    assert torch.equal(batch["x"], torch.ones(2))  # the input is untouched


def test_key_average_handles_nesting_missing_keys_and_tensors():
    records = [
        {"loss": torch.tensor(1.0), "acc": {"top1": 0.5}},
        {"loss": 3, "acc": {"top1": 1.0, "top5": 1.0}},
    ]
    assert key_average(records) == {"loss": 2.0, "acc": {"top1": 0.75, "top5": 1.0}}
    assert key_average([]) == {}


def test_key_average_nan_handling():
    records = [{"a": 1.0, "b": math.nan}, {"a": math.nan, "b": math.nan}, {"a": 3.0}]
    assert math.isnan(key_average(records)["a"])
    averaged = key_average(records, exclude_nan=True)
    assert averaged["a"] == 2.0
    assert math.isnan(averaged["b"])


@pytest.mark.parametrize(
    ("record", "error", "message"),
    [
        ({"x": {"y": "high"}}, TypeError, "record 'x/y' is a str, not a number"),
        ({"v": torch.ones(3)}, ValueError, r"record 'v' is a tensor of shape \(3,\), not a scalar"),
    ],
)
def test_key_average_names_bad_records(record, error, message):
    with pytest.raises(error, match=message):
        key_average([record])


def test_flatten_nested_dict():
    assert flatten_nested_dict({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
    assert flatten_nested_dict({"a": {"b": 1}}, sep=".") == {"a.b": 1}


RESUMED_SCRIPT = """\
import sys
from tiny_trainer import TinyTrainer
from trainloop import CheckpointingHook

trainer = TinyTrainer(max_steps=int(sys.argv[1]), workspace="ws", hooks=[CheckpointingHook(interval=100)])
trainer.train()
"""


def test_a_changed_settings_warning_points_at_the_users_train_call_not_at_trainloop(tmp_path):
    import subprocess
    import sys

    from cli_process import cli_env

    (tmp_path / "train.py").write_text(RESUMED_SCRIPT)

    def run(max_steps):
        return subprocess.run(
            [sys.executable, "-W", "always", "train.py", str(max_steps)], cwd=tmp_path, env=cli_env(),
            capture_output=True, text=True, timeout=180, check=True,
        )

    run(2)
    resumed = run(4)  # max_steps changed
    lines = resumed.stderr.splitlines()
    warned = [i for i, line in enumerate(lines) if "ChangedSettingsWarning" in line]
    assert [lines[i] for i in warned] == [
        f"{tmp_path / 'train.py'}:6: ChangedSettingsWarning: resuming with settings that differ from the checkpoint's: "
        "max_steps"
    ], resumed.stderr
    assert lines[warned[0] + 1] == "  trainer.train()"  # the user's line, not one of trainloop's source
