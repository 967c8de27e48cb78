"""The learning-rate range test on real small problems: the suggestion, divergence, exact restore."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from child_process import HIDDEN_GPUS
from pydantic import ValidationError
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader

from trainloop.loss import Loss
from trainloop.lr_find import LrFindComponents, LrFindResult, lr_find

REPO = Path(__file__).resolve().parents[2]


def full_data_mse(model: nn.Module) -> float:
    x, y = make_data().tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def train_tiny(lr: float, steps: int = 20) -> float:
    trainer = TinyTrainer(max_steps=steps, lr=lr)
    trainer.train()
    return full_data_mse(trainer.model)


class RegressionSetup:
    """A model with BatchNorm and Dropout (buffers, modes, randomness), Adam with two param
    groups, already stepped a few times so that the moments are non-trivial."""

    def __init__(self, seed: int = 0, prestep: int = 3) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
        self.optimizer = torch.optim.Adam(
            [
                {"params": self.model[0].parameters(), "lr": 1e-3},
                {"params": [*self.model[1].parameters(), *self.model[4].parameters()], "lr": 1e-2},
            ]
        )
        self.data = DataLoader(make_data(), batch_size=16, shuffle=True)
        self.calls = 0
        for x, y in list(self.data)[:prestep]:
            self.optimizer.zero_grad()
            self.loss_fn((x, y)).backward()
            self.optimizer.step()

    def loss_fn(self, batch):
        self.calls += 1
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def components(self, **kwargs) -> LrFindComponents:
        return LrFindComponents(self.model, self.optimizer, self.data, self.loss_fn, **kwargs)

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict())


def assert_same_state(expected, actual) -> None:
    """Equal nested structures, tensors bitwise equal (dtype too)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.dtype == expected.dtype
        assert torch.equal(expected, actual)
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys()
        for key in expected:
            assert_same_state(expected[key], actual[key])
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual)
        for a, b in zip(expected, actual):
            assert_same_state(a, b)
    else:
        assert expected == actual


# -- the suggestion on a real problem -----------------------------------------------------------


def test_suggestion_on_tiny_regression_trains_faster_than_start_lr_and_does_not_diverge():
    result = lr_find(TinyTrainer(max_steps=1))
    assert isinstance(result, LrFindResult)
    assert result.suggestion is not None
    assert 1e-3 <= result.suggestion <= 1.0
    initial = full_data_mse(TinyTrainer(max_steps=1).build_model())
    with_suggestion, with_start_lr = train_tiny(result.suggestion), train_tiny(1e-7)
    assert math.isfinite(with_suggestion)
    assert with_suggestion < 0.5 * initial
    assert with_suggestion < with_start_lr
    # SGD on this problem blows up well before lr 1; the suggestion stays clear of it.
    assert result.diverged_at is not None
    assert result.suggestion < result.diverged_at


def test_lrs_sweep_exponentially_from_start_to_end_and_losses_are_a_moving_average():
    result = lr_find(TinyTrainer(max_steps=1), start_lr=1e-5, end_lr=1e-2, num_iterations=30, smoothing=0.1)
    assert result.diverged_at is None
    assert len(result.lrs) == len(result.losses) == len(result.raw_losses) == 30
    for i, lr in enumerate(result.lrs):
        assert lr == pytest.approx(1e-5 * 1000 ** (i / 29), rel=1e-9)
    assert result.lrs[0] == pytest.approx(1e-5, rel=1e-12)
    assert result.lrs[-1] == pytest.approx(1e-2, rel=1e-12)
    # Bias-corrected exponential moving average of the raw losses, weight 0.1 on the newest.
    ema = 0.0
    for i, (raw, smoothed) in enumerate(zip(result.raw_losses, result.losses)):
        ema = 0.9 * ema + 0.1 * raw
        assert smoothed == pytest.approx(ema / (1 - 0.9 ** (i + 1)), rel=1e-9)
    assert result.losses[0] == pytest.approx(result.raw_losses[0], rel=1e-12)


def test_smoothing_zero_reports_the_raw_losses():
    result = lr_find(TinyTrainer(max_steps=1, data=DataLoader(make_data(), batch_size=64)),
                     end_lr=1e-2, num_iterations=10, smoothing=0)
    assert result.losses == result.raw_losses
    # Full-batch SGD: the loss of the first iteration is the loss of the untrained model.
    assert result.raw_losses[0] == pytest.approx(full_data_mse(TinyTrainer(max_steps=1).build_model()), rel=1e-6)


def test_no_suggestion_when_the_loss_never_falls():
    # At these lrs SGD does not move the loss measurably: full batch, so no noise either.
    result = lr_find(TinyTrainer(max_steps=1, data=DataLoader(make_data(), batch_size=64)),
                     start_lr=1e-12, end_lr=1e-11, num_iterations=20, smoothing=0)
    assert result.diverged_at is None
    assert max(result.losses) - min(result.losses) < 1e-9 * result.losses[0]
    assert result.suggestion is None or result.losses[0] > result.losses[-1]


# -- divergence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [1.5, 4.0])
def test_divergence_stops_the_sweep_at_the_first_crossing(threshold):
    result = lr_find(TinyTrainer(max_steps=1), end_lr=100.0, num_iterations=100, divergence_threshold=threshold)
    assert result.diverged_at is not None
    assert result.diverged_at == result.lrs[-1]
    assert len(result.lrs) < 100
    assert result.lrs[-1] < 100.0
    *before, last = result.losses
    assert not math.isfinite(last) or last > threshold * min(before)
    for i, loss in enumerate(before):
        assert loss <= threshold * min(before[: i + 1])


def test_a_lower_threshold_stops_no_later():
    results = [lr_find(TinyTrainer(max_steps=1), end_lr=100.0, divergence_threshold=t) for t in (1.5, 10.0)]
    assert len(results[0].lrs) <= len(results[1].lrs)


def test_a_non_finite_loss_is_divergence_without_an_optimizer_step():
    setup = RegressionSetup()
    before = setup.snapshot()

    calls = []

    def loss_fn(batch):
        calls.append(1)
        loss = setup.loss_fn(batch)
        return loss * math.inf if len(calls) == 5 else loss

    result = lr_find(LrFindComponents(setup.model, setup.optimizer, setup.data, loss_fn), num_iterations=20)
    assert len(result.lrs) == 5
    assert result.diverged_at == result.lrs[4]
    assert math.isinf(result.raw_losses[-1])
    assert_same_state(before, setup.snapshot())


# -- restoring ----------------------------------------------------------------------------------


def test_model_optimizer_grads_modes_and_rng_are_restored_exactly():
    setup = RegressionSetup()
    setup.model[1].eval()  # a mixed-mode model: BatchNorm frozen, the rest training
    grads = [torch.full_like(p, 0.5) for p in setup.model.parameters()]
    for p, g in zip(setup.model.parameters(), grads):
        p.grad = g
    model_state, optimizer_state = setup.snapshot()
    assert optimizer_state["state"][0]["exp_avg"].abs().sum() > 0  # real Adam moments
    torch.manual_seed(123)
    rng = torch.get_rng_state()

    result = lr_find(setup.components(), end_lr=10.0, num_iterations=50)

    assert len(result.lrs) == 50
    assert max(result.raw_losses) > 3 * result.raw_losses[0]  # the sweep wrecked the parameters
    assert_same_state((model_state, optimizer_state), setup.snapshot())
    assert "initial_lr" not in setup.optimizer.param_groups[0]
    assert [p.grad for p in setup.model.parameters()] == grads  # the very same tensors
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in setup.model.parameters())
    assert [m.training for m in setup.model.modules()] == [True, True, False, True, True, True]
    assert torch.equal(torch.get_rng_state(), rng)
    # The scheduler's wrapper around optimizer.step is gone again.
    assert "step" not in vars(setup.optimizer)
    assert "_opt_called" not in vars(setup.optimizer)


def test_training_after_the_test_is_identical_to_training_without_it():
    runs = []
    for run_test in (False, True):
        setup = RegressionSetup()
        torch.manual_seed(7)
        if run_test:
            lr_find(setup.components(), num_iterations=30)
        for x, y in list(setup.data)[:4]:  # shuffled and with dropout: draws from the RNG
            setup.optimizer.zero_grad()
            setup.loss_fn((x, y)).backward()
            setup.optimizer.step()
        runs.append(setup.snapshot())
    assert_same_state(runs[0], runs[1])


def test_state_is_restored_when_the_loss_function_raises():
    setup = RegressionSetup()
    before = setup.snapshot()

    calls = []

    def loss_fn(batch):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("bad batch")
        return setup.loss_fn(batch)

    with pytest.raises(RuntimeError, match="bad batch"):
        lr_find(LrFindComponents(setup.model, setup.optimizer, setup.data, loss_fn))
    assert_same_state(before, setup.snapshot())
    assert "initial_lr" not in setup.optimizer.param_groups[1]


def test_an_earlier_schedulers_initial_lr_neither_steers_the_sweep_nor_is_lost():
    setup = RegressionSetup()
    # A warm-up scheduler leaves initial_lr (the target) and a lower current lr behind.
    torch.optim.lr_scheduler.LambdaLR(setup.optimizer, lambda step: 0.5)
    before = setup.snapshot()
    result = lr_find(setup.components(), start_lr=1e-4, end_lr=1e-3, num_iterations=5)
    assert result.lrs[0] == pytest.approx(1e-4)
    assert_same_state(before, setup.snapshot())
    assert setup.optimizer.param_groups[1]["initial_lr"] == 1e-2


def test_a_grad_scaler_changes_nothing_but_the_scale_and_its_state_is_restored():
    plain = RegressionSetup()
    expected = lr_find(plain.components(grad_clip=1.0), end_lr=1e-2, num_iterations=10)
    setup = RegressionSetup()
    # growth_interval=2: the scale would grow during the sweep if it were not restored.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler_state = copy.deepcopy(scaler.state_dict())
    result = lr_find(setup.components(grad_clip=1.0, grad_scaler=scaler), end_lr=1e-2, num_iterations=10)
    # Scaling by a power of two and unscaling before clipping and stepping is exact in float32.
    assert result.raw_losses == expected.raw_losses
    assert scaler.state_dict() == scaler_state
    # No half-finished step is left behind in the scaler: a normal step works.
    x, y = next(iter(setup.data))
    scaler.scale(setup.loss_fn((x, y))).backward()
    scaler.unscale_(setup.optimizer)
    scaler.step(setup.optimizer)
    scaler.update()


# -- param groups -------------------------------------------------------------------------------


def test_param_groups_keep_their_ratio_and_the_largest_follows_the_sweep():
    setup = RegressionSetup()
    frozen = nn.Parameter(torch.zeros(3))
    setup.optimizer.add_param_group({"params": [frozen], "lr": 0.0})
    seen = []

    def loss_fn(batch):
        seen.append([group["lr"] for group in setup.optimizer.param_groups])
        return setup.loss_fn(batch)

    result = lr_find(LrFindComponents(setup.model, setup.optimizer, setup.data, loss_fn),
                     start_lr=1e-4, end_lr=1e-1, num_iterations=10)
    assert len(seen) == len(result.lrs) == 10
    for (small, large, zero), lr in zip(seen, result.lrs):
        assert large == lr  # group 1 had the largest lr (1e-2)
        assert small == pytest.approx(lr / 10, rel=1e-12)
        assert zero == 0.0
    assert seen[0][1] == pytest.approx(1e-4)
    assert seen[-1][1] == pytest.approx(1e-1)
    assert torch.equal(frozen, torch.zeros(3))


def test_every_group_at_lr_zero_is_an_error_and_changes_nothing():
    setup = RegressionSetup()
    for group in setup.optimizer.param_groups:
        group["lr"] = 0.0
    before = setup.snapshot()
    with pytest.raises(ValueError, match="learning rate 0"):
        lr_find(setup.components())
    assert_same_state(before, setup.snapshot())


# -- the trainer form ---------------------------------------------------------------------------


def test_trainer_form_leaves_the_trainer_ready_to_train_as_if_untouched():
    trainer = TinyTrainer(max_steps=5)
    lr_find(trainer, num_iterations=20)
    assert trainer.state.value == "idle"
    assert trainer.step == 0
    for name in ("data_loader", "model", "optimizer", "grad_scaler"):
        assert not hasattr(trainer, name)
    trainer.train()
    reference = TinyTrainer(max_steps=5)
    reference.train()
    for a, b in zip(trainer.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


class PersistentModelTrainer(TinyTrainer):
    """Builds its model once, in __init__: the sweep trains that very object."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self._model = self.model

    def build_model(self):
        return self._model


def test_trainer_form_restores_a_model_that_outlives_the_test_and_keeps_attributes():
    trainer = PersistentModelTrainer(max_steps=1)
    before = copy.deepcopy(trainer.model.state_dict())
    result = lr_find(trainer, end_lr=100.0)
    assert result.diverged_at is not None
    assert trainer.model is trainer._model  # the attribute it had before
    assert_same_state(before, trainer.model.state_dict())


class AccumulatingLossTrainer(TinyTrainer):
    """forward returns Loss(sum, count), skips every third batch, and counts what it saw."""

    def forward(self, batch):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen % 3 == 0:
            return None, {}
        x, y = batch
        return Loss(((self.model(x) - y) ** 2).sum(), y.numel()), {}


def test_trainer_form_honours_accumulation_loss_sum_count_skipped_batches_and_clipping():
    trainer = AccumulatingLossTrainer(max_steps=1, gradient_accumulation_steps=2, grad_clip=0.5,
                                      data=DataLoader(make_data(), batch_size=4))
    result = lr_find(trainer, start_lr=0.1, end_lr=0.2, num_iterations=2, smoothing=0)
    # Iteration 1: batches 0 and 1 (2 is skipped); iteration 2: batches 3 and 4.
    assert len(result.lrs) == 2
    assert trainer.seen == 5
    x, y = make_data().tensors
    model = TinyTrainer(max_steps=1).build_model()
    first = nn.functional.mse_loss(model(x[:8]), y[:8])  # the mean over the step's 8 samples
    first.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    assert grad_norm > 0.5  # clipping matters here
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        second = nn.functional.mse_loss(model(x[12:20]), y[12:20]).item()
    assert result.raw_losses == pytest.approx((first.item(), second), rel=1e-5)


def test_trainer_form_seeds_like_train_and_restores_every_generator():
    import random

    import numpy

    class SeededTrainer(TinyTrainer):
        def build_model(self):
            self.built_with = torch.rand(1).item()  # depends on settings.seed only
            return super().build_model()

    random.seed(1)
    numpy.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.seed(1)
    numpy.random.seed(1)
    torch.manual_seed(1)
    trainer = SeededTrainer(max_steps=1, seed=42)
    lr_find(trainer, num_iterations=5)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == expected
    reference = SeededTrainer(max_steps=1, seed=42)
    reference.train()
    assert trainer.built_with == reference.built_with


def test_trainer_form_runs_forward_under_the_trainers_autocast():
    dtypes = []

    class Bf16Trainer(TinyTrainer):
        def forward(self, batch):
            dtypes.append(self.model(batch[0]).dtype)
            return super().forward(batch)

    result = lr_find(Bf16Trainer(max_steps=1, mixed_precision="bf16", device="cpu"), end_lr=1e-3, num_iterations=3)
    assert len(result.lrs) == 3
    assert set(dtypes) == {torch.bfloat16}


def test_a_trainer_that_already_trained_is_refused():
    trainer = TinyTrainer(max_steps=1)
    trainer.train()
    with pytest.raises(RuntimeError, match="not started train"):
        lr_find(trainer)


def test_forward_not_returning_loss_and_records_is_a_type_error():
    class BadTrainer(TinyTrainer):
        def forward(self, batch):
            return super().forward(batch)[0]

    with pytest.raises(TypeError, match=r"must return \(loss, records\)"):
        lr_find(BadTrainer(max_steps=1))


def test_a_non_scalar_loss_is_a_type_error_and_state_is_restored():
    setup = RegressionSetup()
    before = setup.snapshot()
    components = LrFindComponents(setup.model, setup.optimizer, setup.data, lambda b: setup.model(b[0]))
    with pytest.raises(TypeError, match=r"scalar tensor loss, got a tensor of shape \(16, 1\)"):
        lr_find(components)
    assert_same_state(before, setup.snapshot())


# -- parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("start_lr", 0.0),
        ("start_lr", -1e-3),
        ("start_lr", "1e-3"),
        ("end_lr", 0.0),
        ("end_lr", 1e-8),  # not above start_lr
        ("end_lr", 1e-7),
        ("end_lr", math.inf),
        ("num_iterations", 1),
        ("num_iterations", 2.5),
        ("num_iterations", "100"),
        ("smoothing", 1.0),
        ("smoothing", -0.1),
        ("smoothing", math.nan),
        ("divergence_threshold", 1.0),
        ("divergence_threshold", math.inf),
    ],
)
def test_invalid_parameters_raise_a_validation_error_naming_the_parameter(name, value):
    with pytest.raises(ValidationError) as info:
        lr_find(TinyTrainer(max_steps=1), **{name: value})
    assert [error["loc"] for error in info.value.errors()] == [(name,)]
    assert name in str(info.value)


def test_neither_trainer_nor_components_is_a_validation_error():
    with pytest.raises(ValidationError, match="trainer_or_components"):
        lr_find(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model", "not a model"),
        ("optimizer", None),
        ("data", 5),
        ("loss_fn", "loss"),
        ("gradient_accumulation_steps", 0),
        ("grad_clip", -1.0),
        ("grad_scaler", object()),
    ],
)
def test_invalid_components_raise_a_validation_error_naming_the_field(name, value):
    setup = RegressionSetup(prestep=0)
    fields = {"model": setup.model, "optimizer": setup.optimizer, "data": setup.data, "loss_fn": setup.loss_fn}
    with pytest.raises(ValidationError) as info:
        LrFindComponents(**{**fields, name: value})
    assert info.value.errors()[0]["loc"][0] == name


def test_components_keep_a_re_iterable_data_loader_as_it_is():
    setup = RegressionSetup(prestep=0)
    assert setup.components().data is setup.data


def test_a_one_shot_iterator_that_runs_out_is_reported_and_state_restored():
    from trainloop.core.data import DataExhaustedError

    setup = RegressionSetup()
    before = setup.snapshot()
    with pytest.raises(DataExhaustedError):
        lr_find(LrFindComponents(setup.model, setup.optimizer, iter(list(setup.data)), setup.loss_fn))
    assert_same_state(before, setup.snapshot())


# -- the plot -----------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    result = lr_find(TinyTrainer(max_steps=1), end_lr=100.0)
    path = result.plot(tmp_path / "lr.png")
    assert path == tmp_path / "lr.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_plot_handles_a_non_finite_last_loss(tmp_path):
    pytest.importorskip("matplotlib")
    result = LrFindResult(lrs=(1e-3, 1e-2, 1e-1), losses=(1.0, 0.5, math.inf), suggestion=None,
                          diverged_at=1e-1, raw_losses=(1.0, 0.2, math.inf))
    assert result.plot(tmp_path / "inf.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what Python does for a missing package
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = LrFindResult(lrs=(1e-3, 1e-2), losses=(1.0, 0.5), suggestion=None, diverged_at=None, raw_losses=(1.0, 0.5))
    with pytest.raises(ImportError, match="pip install matplotlib"):
        result.plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# -- distributed --------------------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import trainloop.lr_find
    # A fresh interpreter just imported the module: matplotlib must wait for plot().
    assert "matplotlib" not in sys.modules, "importing trainloop.lr_find imported matplotlib"
    import torch, torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler
    from tiny_trainer import make_data
    from trainloop.distributed import destroy
    from trainloop.lr_find import LrFindComponents, lr_find

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
        data = DataLoader(make_data(), batch_size=4, sampler=DistributedSampler(make_data(), shuffle=False))
        loss_fn = lambda b: nn.functional.mse_loss(model(b[0]), b[1])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        result = lr_find(LrFindComponents(model, optimizer, data, loss_fn), start_lr=1e-3, end_lr=100.0,
                         num_iterations=40, smoothing=0.0)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump([result.lrs, result.raw_losses, result.suggestion, result.diverged_at], f)
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit
    """
)


def test_under_ddp_ranks_average_the_loss_and_stop_together_and_matplotlib_stays_unimported(tmp_path):
    from ddp_worker import free_port

    script = tmp_path / "ddp_lr_find.py"
    script.write_text(DDP_SCRIPT)
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'support'}", "PATH": "/usr/bin:/bin", **HIDDEN_GPUS}
    port = str(free_port())
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path)], env=env, stderr=subprocess.PIPE)
        for rank in range(2)
    ]
    try:
        for process in ranks:
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr.decode()
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]  # identical losses (averaged), so the same stop and suggestion
    lrs, raw, _suggestion, diverged_at = results[0]
    assert diverged_at is not None
    assert len(lrs) < 40
    # Averaged over the two shards: iteration 0 is the mean of both ranks' first batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = make_data().tensors
    # DistributedSampler without shuffling: rank r draws samples r, r + 2, r + 4, ...
    with torch.no_grad():
        per_rank = [nn.functional.mse_loss(model(x[r::2][:4]), y[r::2][:4]).item() for r in range(2)]
    assert raw[0] == pytest.approx(sum(per_rank) / 2, rel=1e-5)


def test_trainloop_lr_find_runs_the_search_after_its_package_was_imported():
    # Importing trainloop.lr_find (or a module of it) binds the package on trainloop under the function's
    # name: `from trainloop import lr_find` must still give something that runs the search.
    script = textwrap.dedent(
        """
        import trainloop.lr_find.search
        from tiny_trainer import TinyTrainer
        from trainloop import lr_find
        result = lr_find(TinyTrainer(max_steps=1), num_iterations=5)
        print(type(result).__name__, len(result.lrs))
        """
    )
    support = Path(__file__).resolve().parents[1] / "support"
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=support, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": f"{support}:{__import__('os').environ.get('PYTHONPATH', '')}"},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["LrFindResult", "5"]
