"""The optimizer declared in settings: discovery, validation, param groups (schedules: test_schedule.py)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from trainloop.settings.optimizer import OPTIMIZERS, OptimizerSettings, build_optimizer

# -- helpers ------------------------------------------------------------------------------------


def bias_free_mlp() -> nn.Module:
    # Bias-free so that Muon, which takes only matrices, builds on it like the others.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, bias=False), nn.Tanh(), nn.Linear(4, 2, bias=False))


class MyRMSNorm(nn.Module):
    """A model's own norm layer, as LLM code often defines one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.scale


class ZooModel(nn.Module):
    """One of each kind of parameter the no-weight-decay rules tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.rms = nn.RMSNorm(4)
        self.own_norm = MyRMSNorm(4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one tensor, two owners
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


# -- optimizers: discovery and building -----------------------------------------------------------


def test_optimizers_are_torch_optim_classes_found_by_discovery():
    public = {
        name
        for name in torch.optim.__all__
        if inspect.isclass(getattr(torch.optim, name))
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    }
    assert {"AdamW", "SGD", "Adam", "LBFGS"} <= set(OPTIMIZERS)
    assert public <= set(OPTIMIZERS)
    assert "Optimizer" not in OPTIMIZERS
    for name, cls in OPTIMIZERS.items():
        assert getattr(torch.optim, name) is cls


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_builds_with_its_defaults_and_steps(name):
    fields = OptimizerSettings.model_json_schema()["$defs"][f"{name}Settings"]
    required = set(fields.get("required", [])) - {"name"}
    settings = OptimizerSettings(name=name, **{key: 0.01 for key in required})  # lr where needed
    if name == "SparseAdam":  # takes sparse gradients only
        torch.manual_seed(0)
        model = nn.Embedding(5, 3, sparse=True)

        def loss_fn():
            return model(torch.tensor([0, 3])).square().sum()
    else:
        model = bias_free_mlp()

        def loss_fn():
            return model(torch.linspace(-1, 1, 6).reshape(2, 3)).square().sum()

    optimizer = build_optimizer(settings, model)
    assert type(optimizer) is OPTIMIZERS[name]
    assert [group["name"] for group in optimizer.param_groups] == ["default"]
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    optimizer.step(closure)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_declared_arguments_reach_the_constructor():
    settings = OptimizerSettings.model_validate(
        {"name": "AdamW", "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.2, "amsgrad": True}
    )
    optimizer = build_optimizer(settings, bias_free_mlp())
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"]) == (
        3e-4, (0.9, 0.95), 1e-6, 0.2, True,
    )
    assert settings.name == "AdamW"
    assert settings.optimizer_class is torch.optim.AdamW
    assert settings.kwargs["betas"] == (0.9, 0.95)
    # Undeclared arguments keep the constructor's defaults.
    assert settings.kwargs["maximize"] is False
    assert OptimizerSettings(name="SGD").kwargs["lr"] == inspect.signature(torch.optim.SGD).parameters["lr"].default


def test_an_integer_is_taken_for_a_float_but_a_string_is_not():
    assert OptimizerSettings(name="SGD", lr=1).kwargs["lr"] == 1
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name="SGD", lr="0.1")
    assert info.value.errors()[0]["loc"] == ("SGD", "lr")


# -- optimizers: invalid settings --------------------------------------------------------------------


def test_unknown_optimizer_name_lists_the_valid_ones():
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name="Adamw", lr=1e-3)
    message = str(info.value)
    assert "'Adamw'" in message
    for name in OPTIMIZERS:
        assert f"'{name}'" in message


def test_missing_name_is_an_error():
    with pytest.raises(ValidationError, match="name"):
        OptimizerSettings.model_validate({"lr": 1e-3})


def test_unknown_argument_is_named_and_the_valid_ones_listed():
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name="AdamW", lrr=1e-3, beta=0.9)
    message = str(info.value)
    assert "'lrr'" in message
    assert "'beta'" in message
    assert "valid arguments: module, no_weight_decay, lr, betas, eps, weight_decay" in message


def test_no_weight_decay_needs_an_optimizer_with_weight_decay():
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name="Rprop", no_weight_decay=["bias"])
    message = str(info.value)
    assert "'no_weight_decay'" in message
    assert "etas" in message
    assert "weight_decay" not in OptimizerSettings(name="Rprop").kwargs


@pytest.mark.parametrize(
    ("arguments", "loc"),
    [
        ({"lr": "fast"}, ("AdamW", "lr")),
        ({"amsgrad": "yes"}, ("AdamW", "amsgrad")),
        ({"amsgrad": 1}, ("AdamW", "amsgrad")),
        ({"betas": [0.9]}, ("AdamW", "betas", 1)),
        ({"lr": float("nan")}, ("AdamW", "lr")),
        ({"no_weight_decay": ["weights"]}, ("AdamW", "no_weight_decay", 0)),
    ],
)
def test_wrong_types_are_pydantic_errors_at_the_field(arguments, loc):
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name="AdamW", **arguments)
    assert [error["loc"] for error in info.value.errors()] == [loc]


@pytest.mark.parametrize(
    ("name", "arguments", "named", "said"),
    [
        ("AdamW", {"lr": -1.0}, "lr", "Invalid learning rate"),
        ("AdamW", {"betas": [0.9, 1.5], "lr": 0.1}, "betas", "beta parameter at index 1"),
        ("SGD", {"momentum": -0.5}, "momentum", "momentum"),
        ("SGD", {"nesterov": True}, "nesterov", "Nesterov"),  # needs momentum > 0
        ("AdamW", {"fused": True, "foreach": True}, "foreach, fused", "cannot be `True` together"),
        ("Muon", {"adjust_lr_fn": "bogus"}, "adjust_lr_fn", "not supported"),
    ],
)
def test_values_the_constructor_rejects_fail_with_the_settings_naming_the_argument(name, arguments, named, said):
    with pytest.raises(ValidationError) as info:
        OptimizerSettings(name=name, **arguments)
    message = info.value.errors()[0]["msg"]
    assert f"{named}: {name} rejected its arguments" in message
    assert said in message


# -- optimizers: param groups ------------------------------------------------------------------------


def groups_by_name(optimizer):
    return {group["name"]: group for group in optimizer.param_groups}


def names_of(model, params):
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def test_biases_and_norm_weights_get_no_weight_decay():
    model = ZooModel()
    settings = OptimizerSettings(name="AdamW", lr=1e-3, weight_decay=0.1, no_weight_decay=["bias", "norm"])
    optimizer = build_optimizer(settings, model)
    groups = groups_by_name(optimizer)
    assert list(groups) == ["decay", "no_decay"]
    assert groups["decay"]["weight_decay"] == 0.1
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert names_of(model, groups["no_decay"]["params"]) == {
        "lin.bias",
        "ln.weight", "ln.bias",
        "bn.weight", "bn.bias",
        "gn.weight", "gn.bias",
        "rms.weight",
        "own_norm.scale",
        "attn.in_proj_bias", "attn.out_proj.bias",
    }
    # The tied embedding/head matrix is one parameter, listed once under its first name.
    assert names_of(model, groups["decay"]["params"]) == {
        "emb.weight", "lin.weight", "attn.in_proj_weight", "attn.out_proj.weight",
    }


def test_every_trainable_parameter_is_in_exactly_one_group():
    model = ZooModel()
    settings = OptimizerSettings(name="AdamW", weight_decay=0.1, no_weight_decay=["bias", "norm", "embedding"])
    optimizer = build_optimizer(settings, model)
    in_groups = [id(p) for group in optimizer.param_groups for p in group["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(in_groups) == sorted(trainable)
    assert len(in_groups) == len(set(in_groups))
    frozen = {id(p) for p in model.frozen.parameters()}
    assert not frozen & set(in_groups)
    # "embedding" exempts the tied matrix, wherever else it is used.
    assert "emb.weight" in names_of(model, groups_by_name(optimizer)["no_decay"]["params"])


def test_groups_drive_the_update_weight_decay_only_where_declared():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    settings = OptimizerSettings(name="SGD", lr=0.5, weight_decay=0.1, no_weight_decay=["bias", "norm"])
    optimizer = build_optimizer(settings, model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # only the weight decay moves parameters
    optimizer.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["0.weight"], before["0.weight"] * (1 - 0.5 * 0.1))
    for name in ("0.bias", "1.weight", "1.bias"):
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)


def test_an_empty_group_is_left_out():
    model = bias_free_mlp()  # no bias, no norm: nothing to exempt
    optimizer = build_optimizer(OptimizerSettings(name="AdamW", no_weight_decay=["bias", "norm"]), model)
    assert [group["name"] for group in optimizer.param_groups] == ["decay"]
    only_norm = nn.LayerNorm(3)
    optimizer = build_optimizer(OptimizerSettings(name="AdamW", no_weight_decay=["norm"]), only_norm)
    assert [group["name"] for group in optimizer.param_groups] == ["no_decay"]


def test_the_optimizer_rejecting_the_model_parameters_is_an_error():
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        build_optimizer(OptimizerSettings(name="Muon"), nn.Linear(2, 2))


def test_a_model_without_trainable_parameters_is_an_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        build_optimizer(OptimizerSettings(name="SGD"), model)


# -- optimizer settings as data ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_settings_round_trip_through_json(name):
    settings = OptimizerSettings(name=name)
    assert OptimizerSettings.model_validate_json(settings.model_dump_json()) == settings
    assert OptimizerSettings.model_validate(json.loads(settings.model_dump_json())) == settings


def test_optimizer_settings_round_trip_with_arguments():
    settings = OptimizerSettings.model_validate(
        {"name": "AdamW", "lr": 3e-4, "betas": [0.8, 0.9], "no_weight_decay": ["bias", "norm"]}
    )
    again = OptimizerSettings.model_validate_json(settings.model_dump_json())
    assert again == settings
    assert again.no_weight_decay == ("bias", "norm")


def test_optimizer_settings_are_frozen():
    settings = OptimizerSettings(name="SGD", lr=0.1)
    with pytest.raises(ValidationError):
        settings.root.lr = 0.2
    with pytest.raises(ValidationError):
        settings.root = None


def test_optimizer_json_schema_describes_each_optimizer():
    schema = OptimizerSettings.model_json_schema()
    assert set(schema["discriminator"]["mapping"]) == set(OPTIMIZERS)
    adamw = schema["$defs"]["AdamWSettings"]
    assert adamw["additionalProperties"] is False
    assert adamw["properties"]["lr"]["type"] == "number"
    assert adamw["properties"]["lr"]["default"] == 1e-3
    assert adamw["properties"]["lr"]["description"] == "``lr`` of ``torch.optim.AdamW`` (see its documentation)."
    assert adamw["properties"]["no_weight_decay"]["items"]["enum"] == ["bias", "norm", "embedding"]
    assert "no_weight_decay" not in schema["$defs"]["LBFGSSettings"]["properties"]
    json.dumps(schema)


def test_the_schema_embeds_no_torch_docstring(monkeypatch):
    # The committed schema must not change with torch's docstrings (they differ between versions).
    from trainloop.settings.optimizer import _optimizer_args_model

    before = {name: _optimizer_args_model(name).model_json_schema() for name in ("AdamW", "SGD")}
    for name in before:
        monkeypatch.setattr(OPTIMIZERS[name], "__doc__", "Another version's words.\n\nArgs:\n    lr (float): other words\n")
    _optimizer_args_model.cache_clear()  # made again, from the changed docstrings
    try:
        assert {name: _optimizer_args_model(name).model_json_schema() for name in before} == before
    finally:
        _optimizer_args_model.cache_clear()
