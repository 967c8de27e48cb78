"""ProfilerHook: a declared window of steps under torch.profiler, each machine state a range, read back from the trace.

The traces are the files a user opens in Perfetto: each test reads the JSON back and checks the
``trainloop/<state>`` ranges against the machine's own trace and the operators they enclose.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from cli_process import Cli, assert_one_clean_error, cli_env
from helper_hooks import ExitAt
from tiny_trainer import FlakyTrainer, TinyTrainer

import trainloop.hooks.profiler as profiler_module
from trainloop import BaseHook, TrainerSettings
from trainloop.hooks import ProfilerHook
from trainloop.hooks.profiler_table import states_of

EPS = 0.01  # µs: the trace's timestamps are rounded to ns


def spans(path: Path) -> list[dict]:
    """The complete events ("X") of a Chrome trace, by start."""
    return sorted((e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])


def named(events: list[dict], prefix: str) -> list[dict]:
    return [e for e in events if e["name"].startswith(prefix)]


def encloses(outer: dict, inner: dict) -> bool:
    return outer["ts"] - EPS <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPS


def state_of(event: dict, states: list[dict]) -> str | None:
    found = [s["name"] for s in states if encloses(s, event)]
    return found[0] if found else None


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def quiet_logger(name: str) -> tuple[logging.Logger, ListHandler]:
    logger = logging.getLogger(f"tests.profiler.{name}")
    handler = ListHandler()
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, handler


class Probe(BaseHook):
    """After each step: how many ranges the profiler hook had opened, and whether torch's profiler was on."""

    def __init__(self, opened: list[str]) -> None:
        self.opened = opened
        self.after_step: dict[int, tuple[int, bool]] = {}

    def on_after_step(self, trainer) -> None:
        self.after_step[trainer.step] = (len(self.opened), torch.autograd._profiler_enabled())


def declared_settings(tmp_path: Path, hooks: list[dict], **settings) -> TrainerSettings:
    """Settings read from a file, as a user declares them."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"workspace": str(tmp_path / "ws"), "hooks": hooks, **settings}))
    return TrainerSettings.from_file(path)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Six steps of two microsteps, a checkpoint every 2 steps, steps 3-4 profiled; the machine traced."""
    tmp_path = tmp_path_factory.mktemp("profiled")
    settings = declared_settings(
        tmp_path,
        [{"type": "profiler", "wait": 1, "warmup": 1, "active": 2}, {"type": "checkpointing", "interval": 2}],
        max_steps=6, gradient_accumulation_steps=2, trace=True,
    )
    opened: list[str] = []

    class CountedRange(profiler_module.record_function):  # the real range, counted
        def __init__(self, name: str, args: str | None = None) -> None:
            super().__init__(name, args)
            opened.append(name)

    logger, handler = quiet_logger("profiled")
    probe = Probe(opened)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler_module, "record_function", CountedRange)
        trainer = TinyTrainer(settings, hooks=[probe], logger=logger)
        trainer.train()
    hook = next(h for h in trainer.hooks if isinstance(h, ProfilerHook))
    return trainer, hook, probe, handler.messages


def test_the_window_is_written_once_into_the_workspace(profiled):
    trainer, hook, _, _ = profiled
    folder = trainer.workspace / "profiles"
    assert hook.traces == [folder / "rank0.4.pt.trace.json"]
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.4.pt.trace.json"]


def test_the_ranges_are_the_states_the_machine_entered_in_the_profiled_steps(profiled):
    trainer, hook, _, _ = profiled
    events = spans(hook.traces[0])
    steps = named(events, "ProfilerStep#")
    assert [s["name"] for s in steps] == ["ProfilerStep#2", "ProfilerStep#3"]  # steps 3 and 4: nothing after
    # The machine's trace: from the edge that begins step 3 to the one that begins step 5.
    entries = list(trainer.trace)
    begins = [i for i, e in enumerate(entries) if e.trigger == "begin_step"]
    entered = [e.dest.value for e in entries[begins[2] : begins[4]]]
    assert entered == ["accumulating", "accumulating", "stepping"] * 2 + ["checkpointing"]
    ranges = named(events, "trainloop/")
    assert [r["name"] for r in ranges] == [f"trainloop/{state}" for state in entered]
    # Well nested for the viewers: each range inside its profiler step, none overlapping the next.
    assert all(any(encloses(step, r) for step in steps) for r in ranges)
    assert all(a["ts"] + a["dur"] <= b["ts"] + EPS for a, b in zip(ranges, ranges[1:]))


def test_each_range_encloses_its_states_operators(profiled):
    _, hook, _, _ = profiled
    events = spans(hook.traces[0])
    ranges = named(events, "trainloop/")
    # Forward and backward run in accumulating: every matrix product of the model is there.
    products = [e for e in events if e["name"] in ("aten::addmm", "aten::mm")]
    assert len(named(products, "aten::addmm")) == 2 * 2 * 2  # 2 layers x 2 microsteps x 2 steps
    assert {state_of(e, ranges) for e in products} == {"trainloop/accumulating"}
    assert {state_of(e, ranges) for e in named(events, "aten::mse_loss")} == {"trainloop/accumulating"}
    # Each update's optimizer step and the non-finite check run in stepping, once per step.
    updates = [r for r in ranges if r["name"] == "trainloop/stepping"]
    for name in ("Optimizer.step#SGD.step", "aten::_amp_foreach_non_finite_check_and_unscale_"):
        assert [sum(encloses(u, e) for e in named(events, name)) for u in updates] == [1, 1], name
    # The save runs in checkpointing (torch.distributed.checkpoint writes the files from there).
    saving = next(r for r in ranges if r["name"] == "trainloop/checkpointing")
    assert saving["dur"] > 0
    assert any(encloses(saving, e) for e in events if e is not saving and e["name"].startswith("aten::"))


def recorded_extras(path: Path) -> tuple[bool, bool, bool]:
    """Whether a trace holds operators' input shapes, memory events, Python stacks."""
    events = json.loads(path.read_text())["traceEvents"]
    shapes = all("Input Dims" in e["args"] for e in events if e.get("name") == "aten::addmm")
    memory = any(e.get("name") == "[memory]" for e in events)
    stacks = any(e.get("cat") == "python_function" for e in events)
    return shapes, memory, stacks


def test_the_declared_options_reach_torchs_profiler(profiled, tmp_path):
    _, hook, _, _ = profiled
    assert recorded_extras(hook.traces[0]) == (False, False, False)  # the defaults
    declared = {"type": "profiler", "wait": 0, "active": 1, "record_shapes": True, "profile_memory": True,
                "with_stack": True}
    trainer = TinyTrainer(declared_settings(tmp_path, [declared], max_steps=3), logger=quiet_logger("options")[0])
    trainer.train()
    (hook,) = [h for h in trainer.hooks if isinstance(h, ProfilerHook)]
    assert recorded_extras(hook.traces[0]) == (True, True, True)


def test_after_the_window_no_range_is_opened_and_the_profiler_is_off(profiled):
    _, _, probe, _ = profiled
    counts = {step: n for step, (n, _) in probe.after_step.items()}
    enabled = {step: on for step, (_, on) in probe.after_step.items()}
    assert counts[3] > counts[2] > 0
    assert counts[4] > counts[3]
    assert counts[5] - counts[4] == 1  # step 4's checkpointing, opened after its on_after_step
    assert counts[6] == counts[5]  # step 6: nothing
    assert (enabled[3], enabled[4], enabled[5], enabled[6]) == (True, True, False, False)


def test_the_log_has_each_states_top_operators(profiled):
    _, hook, _, messages = profiled
    (message,) = [m for m in messages if m.startswith("Profiled")]
    head, *table = message.splitlines()
    assert head == f"Profiled steps 3-4 into {hook.traces[0]}; per state, its time and top operators:"
    assert table[0].split() == ["state", "operator", "calls", "self", "CPU", "ms"]
    sections: dict[str, list[str]] = {}
    for line in table[1:]:
        if not line.startswith(" "):
            state = line.split()[0]
            assert "(in state," in line
            sections[state] = []
        else:
            sections[state].append(line.split()[0])
    assert list(sections) == ["accumulating", "stepping", "checkpointing"]
    assert all(0 < len(ops) <= 5 for ops in sections.values())  # top=5 by default
    assert "aten::addmm" in sections["accumulating"]
    assert "Optimizer.step#SGD.step" in sections["stepping"]
    # The same numbers the table is made from, read from the profile: the entries per state.
    assert "(in state, 4 entries)" in next(line for line in table if line.startswith("accumulating"))


def test_a_retried_step_is_one_profiler_step_with_its_retrying_range(tmp_path):
    # The second forward call (step 2's, no accumulation) returns NaN: step 2 is retried once.
    settings = declared_settings(tmp_path, [{"type": "profiler", "wait": 0, "warmup": 1, "active": 2}], max_steps=4,
                                 max_non_finite_grad_retries=1)
    trainer = FlakyTrainer(settings, nan_at={2}, logger=quiet_logger("retry")[0])
    trainer.train()
    (hook,) = [h for h in trainer.hooks if isinstance(h, ProfilerHook)]
    events = spans(hook.traces[0])
    steps = named(events, "ProfilerStep#")
    assert [s["name"] for s in steps] == ["ProfilerStep#1", "ProfilerStep#2"]  # steps 2 and 3
    inside = [[r["name"].removeprefix("trainloop/") for r in named(events, "trainloop/") if encloses(s, r)] for s in steps]
    assert inside == [["accumulating", "stepping", "retrying", "accumulating", "stepping"], ["accumulating", "stepping"]]


def test_the_table_gives_each_operator_to_the_enclosing_range():
    with torch.profiler.profile() as profile:
        with torch.profiler.record_function("trainloop/a"):
            torch.ones(3) + 1
        torch.ones(3) * 2  # between ranges: no state's
        with torch.profiler.record_function("trainloop/b"):
            torch.ones(3) * 2
    states = states_of(profile.events())
    assert list(states) == ["a", "b"]
    assert "aten::add" in states["a"].ops
    assert "aten::mul" not in states["a"].ops
    assert states["b"].ops["aten::mul"][0] == 1  # only the one inside b
    assert states["a"].entries == states["b"].entries == 1


def test_repeat_writes_each_window_and_a_run_ending_mid_window_writes_what_it_recorded(tmp_path):
    settings = declared_settings(
        tmp_path, [{"type": "profiler", "wait": 0, "warmup": 1, "active": 2, "repeat": 0}], max_steps=10
    )
    logger, handler = quiet_logger("repeat")
    trainer = TinyTrainer(settings, hooks=[ExitAt(8)], logger=logger)
    trainer.train()
    hook = next(h for h in trainer.hooks if isinstance(h, ProfilerHook))
    assert [p.name for p in hook.traces] == [f"rank0.{step}.pt.trace.json" for step in (3, 6, 8)]
    for path, profiled_steps in zip(hook.traces, (["#1", "#2"], ["#4", "#5"], ["#7"])):
        assert [s["name"] for s in named(spans(path), "ProfilerStep")] == [f"ProfilerStep{n}" for n in profiled_steps]
    last = named(spans(hook.traces[-1]), "trainloop/")
    assert [r["name"] for r in last] == ["trainloop/accumulating", "trainloop/stepping", "trainloop/exiting"]
    assert [m.split(" into ")[0] for m in handler.messages if m.startswith("Profiled")] == [
        "Profiled steps 2-3", "Profiled steps 5-6", "Profiled steps 8-8"
    ]


def test_a_run_that_ends_before_the_window_says_so(tmp_path):
    settings = declared_settings(tmp_path, [{"type": "profiler", "wait": 3}], max_steps=10)
    logger, handler = quiet_logger("early")
    TinyTrainer(settings, hooks=[ExitAt(2)], logger=logger).train()
    assert [m for m in handler.messages if "wrote no trace" in m] == [
        "ProfilerHook 'profiler_hook' wrote no trace: the run ended before its first active step (wait=3, warmup=1)"
    ]
    assert not (tmp_path / "ws" / "profiles").exists()


BAD = {
    "negative wait": (
        {"hooks": [{"type": "profiler", "wait": -1}]},
        "run.json: hooks[0].wait: Input should be greater than or equal to 0 (got -1)",
    ),
    "no active step": (
        {"hooks": [{"type": "profiler", "active": 0}]},
        "run.json: hooks[0].active: Input should be greater than 0 (got 0)",
    ),
    "a window past max_steps": (
        {"hooks": [{"type": "profiler", "wait": 2, "active": 2}]},
        "run.json: hooks[0]: its first window ends at step 5 (wait + warmup + active) but max_steps is 4: "
        "the run would end before the profile is complete",
    ),
    "two profilers": (
        {"hooks": [{"type": "profiler", "active": 1}, {"type": "profiler", "active": 1, "trace_dir": "p2"}]},
        "run.json: hooks[0] and hooks[1]: torch runs one profiler at a time; declare one profiler hook",
    ),
    "no workspace": (
        {"hooks": [{"type": "profiler", "active": 1}], "workspace": None},
        "run.json: hooks[0].trace_dir: traces go to <workspace>/profiles, but no workspace is set: "
        "set workspace or give an absolute path",
    ),
}


def test_the_cli_runs_a_declared_profiler_and_refuses_bad_windows_with_one_line(tmp_path):
    processes = {}
    for case, (declared, _) in {**BAD, "good": ({"hooks": [{"type": "profiler", "wait": 0, "active": 2, "top": 3}]}, "")}.items():
        root = tmp_path / case.replace(" ", "_")
        root.mkdir()
        settings = {"trainer": "tiny_trainer:TinyTrainer", "max_steps": 4, "workspace": "ws", **declared}
        (root / "run.json").write_text(json.dumps(settings))
        processes[case] = (root, Cli("run", "run.json", cwd=root, env=cli_env(PYTHONDONTWRITEBYTECODE="1")))
    for case, (_, line) in BAD.items():
        root, process = processes[case]
        result = process.result()
        assert result.returncode == 2, (case, result.stderr)
        assert result.stdout == ""
        assert result.stderr == f"trainloop run: error: {line}\n", case
        assert_one_clean_error(result.stderr)
        assert sorted(p.name for p in root.iterdir()) == ["run.json"], case  # nothing written
    root, process = processes["good"]
    result = process.result()
    assert result.returncode == 0, result.stderr
    trace = root / "ws" / "profiles" / "rank0.3.pt.trace.json"  # step 1 warms up, steps 2-3 recorded
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]
    assert [r["name"] for r in named(spans(trace), "trainloop/")] == ["trainloop/accumulating", "trainloop/stepping"] * 2
    lines = result.stderr.splitlines()
    at = next(i for i, text in enumerate(lines) if "Profiled steps 2-3 into " in text)
    assert lines[at].endswith("rank0.3.pt.trace.json; per state, its time and top operators:")
    assert lines[at + 2].startswith("accumulating")
    assert lines[at + 6].startswith("stepping")


def test_each_rank_writes_its_own_trace_under_gloo(tmp_path):
    import torch.multiprocessing as mp
    from ddp_worker import free_port
    from profiler_worker import profiled_ranks

    mp.spawn(profiled_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    folder = tmp_path / "ws" / "profiles"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.3.pt.trace.json", "rank1.3.pt.trace.json"]
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.txt").read_text() == str(folder / f"rank{r}.3.pt.trace.json")
        trace = json.loads((folder / f"rank{r}.3.pt.trace.json").read_text())
        assert trace["distributedInfo"]["rank"] == r  # written by the profiler of that rank
        assert trace["distributedInfo"]["world_size"] == 2
        events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
        ranges = named(events, "trainloop/")
        assert [s["name"] for s in ranges] == ["trainloop/accumulating", "trainloop/stepping"] * 2
        # DDP's gradient all-reduce is launched from backward, in accumulating (one bucket: a tiny
        # model); a stepping range holds at most the exit agreement's, which runs only now and then
        # (trainloop.distributed.agreement), and every all-reduce falls in one of the ranges.
        reduces = named(events, "c10d::allreduce_")
        counts = [sum(encloses(r, e) for e in reduces) for r in ranges]
        assert counts[0::2] == [1, 1]
        assert all(count <= 1 for count in counts[1::2])
        assert sum(counts) == len(reduces)


def test_a_trace_dir_that_is_a_file_is_refused_before_the_first_step(tmp_path):
    # Issue 29, defect 12: it failed with FileExistsError after its window, losing the steps since the last checkpoint.
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "profiles").write_text("")
    settings = {"trainer": "tiny_trainer:TinyTrainer", "max_steps": 5, "workspace": "ws", "hooks": [{"type": "profiler"}]}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    runs = {command: Cli(command, "run.json", cwd=tmp_path) for command in ("validate", "run")}
    for command, run in runs.items():
        result = run.result()
        assert result.returncode == 2
        assert result.stderr == f"trainloop {command}: error: run.json: hooks[0].trace_dir: ws/profiles: is a file, not a directory\n"
    assert [p.name for p in (tmp_path / "ws").iterdir()] == ["profiles"]
    built = TinyTrainer(max_steps=4, workspace=tmp_path / "ws", hooks=[ProfilerHook(trace_dir=tmp_path / "ws" / "profiles")])
    with pytest.raises(ValueError, match=r"ProfilerHook 'profiler_hook' trace_dir: .*ws/profiles: is a file, not a directory"):
        built.train()
    assert built.step == 0


def test_running_a_complete_run_again_says_one_line_and_nothing_about_the_profiler(tmp_path):
    # Issue 29, first-hour friction: "already complete", then a RuntimeWarning "wrote no trace" and a stray `fn(*args)`.
    hooks = [{"type": "profiler", "wait": 0, "warmup": 0, "active": 1, "top": 0}, {"type": "checkpointing", "interval": 2}]
    settings = {"trainer": "tiny_trainer:TinyTrainer", "max_steps": 2, "workspace": "ws", "hooks": hooks}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    first = Cli("run", "run.json", cwd=tmp_path).result()
    assert first.returncode == 0, first.stderr
    again = Cli("run", "run.json", "--log-level", "warning", cwd=tmp_path, env=cli_env(PYTHONWARNINGS="always")).result()
    assert again.returncode == 0, again.stderr
    assert again.stderr == ""  # at WARNING: nothing to say (the INFO line says it resumed complete)
