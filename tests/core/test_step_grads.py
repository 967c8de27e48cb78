import pytest
import torch
from torch import nn

from trainloop.core.step import NonFiniteGradCheck


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    m[1].to(torch.float64)  # two dtypes: two fused groups
    return m


def backward(model, scale=1.0):
    x = torch.randn(2, 3)
    model[1](model[0](x).double()).sum().mul(scale).backward()


def test_finite_gradients_pass_and_are_left_untouched(model):
    check = NonFiniteGradCheck(model.parameters())
    backward(model)
    grads = [p.grad.clone() for p in model.parameters()]
    assert check() is False
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_single_non_finite_element_in_any_group_is_found_and_the_flag_clears(model, bad):
    check = NonFiniteGradCheck(model.parameters())
    backward(model)
    model[1].weight.grad[0, 2] = bad
    assert check() is True
    model.zero_grad()
    backward(model)
    assert check() is False  # the flag is cleared after a hit


def test_missing_and_frozen_gradients_are_skipped(model):
    model[0].weight.requires_grad_(False)
    check = NonFiniteGradCheck(model.parameters())
    assert check() is False  # no gradient at all yet
    backward(model)
    assert check() is False


def test_the_device_flag_is_set_by_a_non_finite_gradient_and_cleared_by_the_next_check(model):
    check = NonFiniteGradCheck(model.parameters())
    backward(model)
    flag = check.found()
    assert flag.shape == ()  # as fused optimizers take found_inf
    assert flag.item() == 0.0
    model[0].bias.grad[1] = float("nan")
    assert check.found().item() == 1.0
    model.zero_grad()
    backward(model)
    assert check.found().item() == 0.0  # cleared, though the host never read the hit
    model[1].weight.grad[0, 0] = float("inf")
    assert check() is True  # the synced check after the device one
    model.zero_grad()
    backward(model)
    assert check() is False


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_bfloat16_gradients_are_checked_too(device, bad):
    # GradScaler's kernel has no bfloat16 version on CUDA: a model kept in bf16 (or DeepSpeed's bf16) is
    # checked another way, with the same answers, and its gradients are left untouched.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).to(device)
    model[1].to(torch.bfloat16)
    check = NonFiniteGradCheck(model.parameters())
    model[1](model[0](torch.randn(2, 3, device=device)).bfloat16()).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert check() is False
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    model[1].weight.grad[0, 2] = bad
    assert check() is True
    assert check.found().item() == 1.0
    model[1].weight.grad[0, 2] = 0.0
    assert check() is False
    assert check.found().item() == 0.0
