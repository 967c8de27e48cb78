"""trainloop.distributed: the process group from torchrun's environment, wrap_model, gradient_sync,
and the trainer with an FSDP2 model, for real: two gloo processes on 127.0.0.1.

The multi-process scenarios run in two spawns (module fixtures; each worker plays a torchrun
process and runs several scenarios), because starting processes that import torch dominates
the cost on this machine. Each test asserts on its own part of the results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_worker import free_port
from dist_workers import (
    context_and_wrapping,
    fsdp_trainer,
    loss_token_reference,
    reference_trainer,
)
from pydantic import ValidationError
from tiny_trainer import TinyTrainer
from torch import nn

from trainloop.checkpoint import read_checkpoint
from trainloop.distributed import (
    DistributedContext,
    FSDPOptions,
    destroy,
    get_device,
    gradient_sync,
    init_distributed,
    is_main,
    local_rank,
    rank,
    world_size,
    wrap_model,
)
from trainloop.distributed.process_group import gpus_for_ranks_problem

WORLD = 2
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def spawn(fn, out):
    mp.spawn(fn, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def wrapping(tmp_path_factory):
    return spawn(context_and_wrapping, tmp_path_factory.mktemp("wrapping"))


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_trainer")
    return spawn(fsdp_trainer, out), out


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b)


# -- alone: no process group ---------------------------------------------------------------------


def test_init_distributed_alone_is_a_single_process_no_op(no_torchrun_env):
    with init_distributed() as ctx:
        assert ctx == DistributedContext(rank=0, world_size=1, local_rank=0, device=get_device())
        assert (ctx.is_main, ctx.is_distributed, ctx.owns_group) == (True, False, False)
        assert not dist.is_initialized()
        assert (rank(), world_size(), local_rank(), is_main()) == (0, 1, 0, True)
    destroy()  # nothing to destroy: a no-op
    assert init_distributed(device="cpu").device == torch.device("cpu")
    with pytest.raises(AttributeError):
        ctx.rank = 1  # frozen


def test_get_device_is_the_cpu_without_an_accelerator(monkeypatch):
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_device() == get_device(1) == torch.device("cpu")
    assert local_rank() == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT not set"),
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not set"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, r"RANK=2 is not in \[0, WORLD_SIZE=2\)"),
        ({"RANK": "0", "WORLD_SIZE": "-2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "WORLD_SIZE='-2' is negative"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "LOCAL_RANK='a' is not an integer",
        ),
    ],
)
def test_a_broken_torchrun_env_is_an_error_naming_the_variable(no_torchrun_env, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=message):
        init_distributed()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"timeout": 30}, "timeout"), ({"backend": 1}, "backend"), ({"device": 0}, "device")]
)
def test_init_distributed_rejects_bad_arguments(no_torchrun_env, kwargs, name):
    with pytest.raises(ValidationError, match=name):
        init_distributed(**kwargs)


def test_wrap_model_alone(no_torchrun_env):
    model = nn.Linear(2, 2)
    assert wrap_model(model) is model  # auto: one process, nothing to wrap
    assert wrap_model(model, "auto", static_graph=True) is model  # DDP options still accepted
    assert wrap_model(model, "none") is model
    for strategy in ("ddp", "fsdp"):
        with pytest.raises(RuntimeError, match=rf"strategy='{strategy}'.*init_distributed\(\)"):
            wrap_model(model, strategy)


@pytest.mark.parametrize(
    ("strategy", "options", "named"),
    [
        ("fsdp", {"shard_modules": 3}, "shard_modules"),
        ("fsdp", {"shard_modules": [int]}, "shard_modules"),
        ("fsdp", {"shard_modules": ()}, "shard_modules"),
        ("fsdp", {"reshard_after_forward": 1}, "reshard_after_forward"),
        ("fsdp", {"reshard_after_forward": "yes"}, "reshard_after_forward"),
        ("fsdp", {"mesh": "cpu"}, "mesh"),
        ("fsdp", {"mp_policy": torch.bfloat16}, "mp_policy"),
        ("fsdp", {"find_unused_parameters": True}, "find_unused_parameters"),  # a DDP option
        ("ddp", {"shard_modules": (nn.Linear,)}, "shard_modules"),  # an FSDP option
        ("ddp", {"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ("ddp", {"static_graph": 1}, "static_graph"),
        ("auto", {"reshard_after_forward": True}, "reshard_after_forward"),
        ("none", {"static_graph": True}, "static_graph"),
        ("bogus", {}, "strategy"),
    ],
)
def test_bad_wrap_options_are_validation_errors_naming_the_option(no_torchrun_env, strategy, options, named):
    with pytest.raises(ValidationError, match=named) as caught:
        wrap_model(nn.Linear(2, 2), strategy, **options)
    assert any(named in map(str, error["loc"]) for error in caught.value.errors())


def test_wrap_model_rejects_a_non_module(no_torchrun_env):
    with pytest.raises(ValidationError, match=r"model\n  Input should be an instance of Module"):
        wrap_model("model")


def test_fsdp_options_take_one_class_a_list_or_a_predicate():
    assert FSDPOptions(shard_modules=nn.Linear).shard_modules == (nn.Linear,)
    assert FSDPOptions(shard_modules=[nn.Linear, nn.Tanh]).shard_modules == (nn.Linear, nn.Tanh)
    by_class = FSDPOptions(shard_modules=nn.Linear)
    assert by_class.matches(nn.Linear(1, 1))
    assert not by_class.matches(nn.Tanh())
    wide = FSDPOptions(shard_modules=lambda m: getattr(m, "out_features", 0) > 4)
    assert wide.matches(nn.Linear(1, 8))
    assert not wide.matches(nn.Linear(1, 2))
    assert not FSDPOptions().matches(nn.Linear(1, 1))
    assert FSDPOptions(reshard_after_forward=False).fully_shard_kwargs() == {"reshard_after_forward": False}


def test_gradient_sync_on_a_plain_model_does_nothing():
    model = nn.Linear(2, 1)
    off = gradient_sync(model, enabled=False)
    assert not off.controls_sync
    x = torch.ones(1, 2)
    for _ in range(2):  # one object, entered again and again
        with off:
            model(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, 2 * x)


# -- more ranks than GPUs under NCCL: one line before anything starts --------------------------------


def test_more_local_ranks_than_gpus_is_one_line_saying_how_many_and_what_to_do(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    problem = gpus_for_ranks_problem(local_ranks=2, gpus=1)
    assert problem == (
        "2 ranks were started on this machine, which has 1 visible GPU: NCCL needs a GPU per rank; "
        "start at most 1 per machine (torchrun --nproc_per_node=1), or run on the CPU with "
        'init_distributed(backend="gloo", device="cpu")'
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert gpus_for_ranks_problem(local_ranks=8, gpus=2).startswith(
        "8 ranks were started on this machine, which has 2 visible GPUs (CUDA_VISIBLE_DEVICES=0,3): "
    )


@pytest.mark.parametrize(("local_ranks", "gpus"), [(1, 1), (2, 2), (4, 8), (None, 1)])
def test_as_many_gpus_as_local_ranks_or_an_unknown_count_is_no_problem(local_ranks, gpus):
    # None: no LOCAL_WORLD_SIZE (not torchrun), where a launcher may give each process its own GPU.
    assert gpus_for_ranks_problem(local_ranks, gpus) is None


@pytest.mark.cuda
def test_init_distributed_refuses_more_local_ranks_than_gpus_before_joining(no_torchrun_env, monkeypatch):
    ranks = torch.cuda.device_count() + 1
    env = {"RANK": "0", "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(ranks),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=f"^{ranks} ranks were started on this machine, which has "):
        init_distributed()
    assert not dist.is_initialized()  # refused before the rendezvous, which would wait for the others


# -- two processes under torchrun's environment ----------------------------------------------------


def test_init_distributed_joins_the_group_from_torchrun_env_and_destroys_it(wrapping):
    for r, result in enumerate(wrapping):
        assert result["ctx"] == (r, WORLD, r, "cpu", "gloo", True)
        assert result["ctx_flags"] == (r == 0, True)
        assert result["functions"] == (r, WORLD, r, r == 0)
        assert result["again"] == (r, WORLD, "gloo", False)  # described, not joined twice
        assert result["all_reduce"] == 1 + 2
        assert result["initialized_after"] is False  # the context destroyed the group


def test_wrap_model_strategies_under_two_ranks(wrapping):
    for r, result in enumerate(wrapping):
        assert result["types"] == {"ddp": "DistributedDataParallel", "auto": "DistributedDataParallel", "none_is_same": True}
        # mlp(): Linear "0", Tanh, Sequential "2" (Linear "2.0", Tanh), Linear "3"
        assert result["fsdp_groups"] == {
            "by_class": ["", "0", "2.0", "3"],
            "by_predicate": ["", "2"],
            "root_only": [""],
        }
        assert result["fsdp_param_types"] == ["DTensor"]
        # Rows split over 2 ranks: 8 -> 4 + 4, and the last layer's 1 row -> 1 + 0.
        assert result["fsdp_local_rows"] == [4, 4, 4, 4, 1, 1] if r == 0 else [4, 4, 4, 4, 0, 0]
        assert "shard_modules=(<class 'torch.nn.modules.conv.Conv2d'>,) matched no submodule" in result["no_match"]
        # Activation checkpointing applied before DDP or FSDP2: the same gradients, the same keys.
        assert result["activation_checkpointing"] == {"ddp": True, "fsdp": True}


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_gradient_sync_accumulates_locally_then_synchronises(wrapping, wrapper):
    for result in wrapping:
        accumulation = result[f"{wrapper}_accumulation"]
        assert accumulation["first"]["controls_sync"]
        if wrapper == "fsdp":
            # No reduce-scatter: the sharded parameters have no gradient yet.
            assert all(accumulation["first"]["grad_is_none"])
        # The synchronised second microstep: the mean over ranks of both microsteps' gradients.
        assert_all_close(accumulation["grads"], result["reference"])
    first = wrapping[0]["ddp_first_gathered"]
    assert not torch.allclose(first[0], first[1])  # under no_sync each rank kept its own


def test_fsdp2_trainer_with_accumulation_matches_one_process_on_the_global_batches(trainer_runs):
    results, _ = trainer_runs
    reference = reference_trainer(max_steps=4)
    reference.train()
    for result in results:
        assert_all_close(result["accumulated"], [p.detach() for p in reference.model.parameters()])


def test_fsdp2_trainer_clips_by_the_global_norm(trainer_runs):
    results, _ = trainer_runs
    reference = reference_trainer(max_steps=4, grad_clip=0.5)
    reference.train()
    unclipped = reference_trainer(max_steps=4)
    unclipped.train()
    for result in results:
        assert_all_close(result["clipped"], [p.detach() for p in reference.model.parameters()])
        assert not torch.allclose(result["clipped"][0], result["accumulated"][0])  # clipping did act
        # clip_grad_norm_ over DTensor gradients returns a replicated DTensor; the trainer
        # reports it as a plain tensor, so hooks can read it.
        assert result["grad_norm_types"] == ["Tensor"] * 4


def test_fsdp2_trainer_normalises_loss_sum_count_over_all_ranks_tokens(trainer_runs):
    results, _ = trainer_runs
    expected = loss_token_reference()
    for result in results:
        assert_all_close(result["tokens"], expected)


class NaNOnceReference(TinyTrainer):
    """One process: the whole global batch of step 2's first try is thrown away, as with 2 ranks."""

    def forward(self, batch):
        loss, records = super().forward(batch)
        if self.step == 2 and self.step_info.non_finite_grad_retries == 0:
            loss = loss * float("nan")
        return loss, records


@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_fsdp2_trainer_retries_a_step_whose_gradients_are_non_finite_on_one_rank(trainer_runs, grad_clip):
    from tiny_trainer import make_data
    from torch.utils.data import DataLoader

    results, _ = trainer_runs
    # NaN on rank 1 alone: the sharded check (or the global clip norm) makes both ranks retry.
    reference = NaNOnceReference(
        max_steps=3, max_non_finite_grad_retries=1, grad_clip=grad_clip, data=DataLoader(make_data(64), batch_size=8)
    )
    reference.train()
    for result in results:
        assert result[f"retries_clip_{grad_clip}"] == [0, 1, 0]
        assert_all_close(result[f"retried_params_clip_{grad_clip}"], [p.detach() for p in reference.model.parameters()])


def test_fsdp2_trainer_checkpoint_holds_full_tensors_and_resumes(trainer_runs):
    results, out = trainer_runs
    saved = read_checkpoint(out / "workspace" / "checkpoints" / "2")
    # Written by rank 0 from a full state dict: whole tensors, not one rank's shards.
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == {
        "0.weight": (8, 4), "0.bias": (8,), "2.weight": (1, 8), "2.bias": (1,),
    }
    assert_all_close(list(saved["model"].values()), results[0]["saved_params"])
    for result in results:
        assert_all_close(result["loaded_params"], result["saved_params"])
        assert_all_close(result["loaded_momentum"], result["saved_momentum"])  # each rank's shard
        assert result["resumed_step"] == 4
    assert_all_close(results[0]["resumed_final"], results[1]["resumed_final"])


def test_fsdp2_trainer_reports_progress_with_clipping(trainer_runs):
    results, _ = trainer_runs
    assert [result["progress_with_clip"] for result in results] == ["ok", "ok"]
