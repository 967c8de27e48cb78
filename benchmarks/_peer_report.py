"""What ``benchmarks/peers.py`` reports: the markdown page (tables and plain statements) and the chart.

The measuring is in ``peers.py`` and the loops in ``_peer_loops.py``; this module only turns
their figures into prose, tables and bars, saying no more than the figures show.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
from pathlib import Path

from _peer_loops import IMPORTS, SKIP_STEPS

CONTENDERS = ("raw", "trainloop", "lightning", "accelerate", "ignite", "transformers")
LABELS = {
    "raw": "hand-written loop",
    "trainloop": "trainloop",
    "lightning": "PyTorch Lightning",
    "accelerate": "Accelerate",
    "ignite": "PyTorch Ignite",
    "transformers": "Hugging Face Trainer",
}
# (importable module(s), distribution(s)) per contender; the first one found wins.
TIE = 0.05  # ratio gap below which two contenders are reported as tied (run-to-run noise here)
IMPORT_TIE = 0.05  # seconds of import time below which two libraries are reported as tied
MODEL_DESCRIPTIONS = {"tiny": "32-64-64-10, batch 32", "medium": "256-1024-1024-10, batch 128"}
# Where a contender's host syncs come from, read in its source; said only when this run counted that many.
SYNC_SOURCES = {
    "raw": (0, "none"),
    "trainloop": (
        1,
        (
            "its non-finite-gradient check, which decides a retry before the optimizer steps "
            "(`detect_non_finite_grads=False` removes it)"
        ),
    ),
    "ignite": (1, "`create_supervised_trainer`'s default output transform, `loss.item()`"),
    "transformers": (
        2,
        "`torch.isnan(loss) or torch.isinf(loss)` after every backward, from `logging_nan_inf_filter`, on by default",
    ),
}


def _fmt_ratio(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def _fmt_syncs(syncs: float | None) -> str:
    return "–" if syncs is None else f"{syncs:g}" if syncs == int(syncs) else f"{syncs:.2f}"


def _syncs_sentence(steps: dict[str, dict[str, dict]]) -> str:
    counts: dict[str, set[float]] = {}
    for results in steps.values():
        for name, r in results.items():
            if r.get("syncs") is not None:
                counts.setdefault(name, set()).add(r["syncs"])
    if not counts:
        return ""
    same = all(len(c) == 1 for c in counts.values())
    opening = "Host syncs per step" + (
        ": " if len(steps) == 1 else ", the same on every model: " if same else " (differing between models): "
    )
    sentence = (
        opening
        + ", ".join(f"{LABELS[n]} {'/'.join(_fmt_syncs(c) for c in sorted(v))}" for n, v in counts.items())
        + "."
    )
    known = [
        f"{LABELS[n]}'s {'sync is' if expected == 1 else f'{expected} are'} {source}"
        for n, (expected, source) in SYNC_SOURCES.items()
        if expected and counts.get(n) == {expected}
    ]
    if known:
        sentence += " Where they come from: " + "; ".join(known) + "."
    return sentence


def summary(steps: dict[str, dict[str, dict]], imports: dict[str, dict]) -> list[str]:
    """Plain statements of what the figures show (who is closest to raw, who imports fastest)."""
    lines = []
    for model, results in steps.items():
        peers = {n: r["ratio"] for n, r in results.items() if n != "raw" and r["ratio"] is not None}
        if not peers:
            continue
        ranked = sorted(peers, key=peers.get)
        spread = max(peers.values()) - min(peers.values())
        lines.append(
            f"On the {model} model ({MODEL_DESCRIPTIONS[model]}), from closest to the hand-written loop: "
            + ", ".join(f"{LABELS[n]} {_fmt_ratio(peers[n])}" for n in ranked)
            + (
                f"; all within {spread:.2f}× of each other, so there the arithmetic dominates and the order is noise."
                if len(peers) > 1 and spread < 2 * TIE
                else "."
            )
        )
    syncs = _syncs_sentence(steps)
    if syncs:
        lines.append(syncs)
    libs = {n: r["beyond_torch"] for n, r in imports.items() if n != "raw"}
    if libs:
        ranked = sorted(libs, key=libs.get)
        lines.append(
            "Import time on top of `import torch`, fastest first: "
            + ", ".join(f"{LABELS[n]} {libs[n]:.2f} s" for n in ranked)
            + "."
        )
    # The project's stated goal, checked against this run's figures.
    tiny = {n: r["ratio"] for n, r in steps.get("tiny", {}).items() if n != "raw" and r["ratio"] is not None}
    if "trainloop" in tiny and len(tiny) > 1:
        closest = min(tiny, key=tiny.get)
        runner_up = min((n for n in tiny if n != closest), key=tiny.get)
        verdict = "met" if closest == "trainloop" else f"not met ({LABELS[closest]} is closer)"
        if tiny[runner_up] - tiny[closest] < TIE:
            # A gap this small flips from run to run on a shared machine: say so rather than claim it.
            other = runner_up if closest == "trainloop" else closest
            verdict += f", but {LABELS[other]} is within {TIE:.2f}× of trainloop: a tie within this machine's noise"
        lines.append(f'Goal "closest to the hand-written loop on the tiny model": {verdict}.')
    if "trainloop" in libs and len(libs) > 1:
        fastest = min(libs, key=libs.get)
        runner_up = min((n for n in libs if n != fastest), key=libs.get)
        verdict = "met" if fastest == "trainloop" else f"not met ({LABELS[fastest]} imports faster)"
        if libs[runner_up] - libs[fastest] < IMPORT_TIE:
            other = runner_up if fastest == "trainloop" else fastest
            verdict += (
                f", but {LABELS[other]} is within {IMPORT_TIE:.2f} s of trainloop: a tie within this machine's noise"
            )
        lines.append(f'Goal "fastest import": {verdict}.')
    return lines


def render_markdown(
    steps: dict[str, dict[str, dict]],
    imports: dict[str, dict],
    skipped: list[str],
    args: argparse.Namespace,
    plot: str | None,
    versions: dict[str, str],
    info: dict[str, str],
) -> str:
    """The report: machine, versions, per-model tables, import times, the Trainer's page, the chart.

    Args:
        steps: Per model, per contender: ``us_per_step``, ``ratio`` and (if counted) ``syncs``.
        imports: Per contender: ``total`` and ``beyond_torch`` seconds (empty: not measured).
        skipped: Contenders asked for but not installed.
        args: The command line (steps, rounds... are quoted in the report).
        plot: The chart's path relative to the report, or None.
        versions: Each contender's installed version (or "not installed").
        info: The machine (``cpu``, ``cores``, ``os``, ``python``, ``torch``).
    """
    out = [
        "# trainloop and its peers",
        "",
        (
            f"Generated by `python benchmarks/peers.py` on {datetime.date.today().isoformat()}; "
            f"{args.steps} timed steps (after {args.warmup} warm-up steps) per run, {args.rounds} rounds "
            f"(medium model: {args.medium_steps or args.steps} steps), imports: median of {args.import_rounds}."
        ),
        "",
        (
            f"Machine: {info['cpu']}, {info['cores']} cores (shared, noisy), {info['os']}, "
            f"Python {info['python']}, torch {info['torch']}, one thread, CPU."
        ),
        "",
        (
            "Each run is a separate process that warms up with a complete run, then times only its "
            "training loop (`time.process_time`). Contenders alternate within each round and each is "
            "divided by the hand-written loop of the same round; figures are medians over rounds. "
            "The ratio is the comparable figure; µs/step moves with the machine's load."
        ),
        "",
        (
            "Host syncs per step count the calls of the Tensor methods that hand a value to Python "
            "(`item`, `tolist`, `numpy`, `__bool__`, `__float__`, `__int__`, `__index__`), the count "
            "trainloop's own test makes: on a GPU each one stalls the host until the device has caught "
            f"up. They are counted in a separate, untimed run of {args.sync_steps} steps per contender, "
            f"from the end of step {SKIP_STEPS} to the end of the last one (start-up and shut-down left out)."
        )
        if args.sync_steps
        else "Host syncs were not counted (`--sync-steps 0`).",
        "",
        "| library | version |",
        "|---|---|",
    ]
    for name in CONTENDERS:
        out.append(f"| {LABELS[name]} | {versions[name]} |")
    for model, results in steps.items():
        out += [
            "",
            f"## {model} model ({MODEL_DESCRIPTIONS[model]})",
            "",
            "| contender | µs/step (median) | ratio to hand-written loop (median) | host syncs/step |",
            "|---|---:|---:|---:|",
        ]
        for name, r in results.items():
            out.append(
                f"| {LABELS[name]} | {r['us_per_step']:.0f} | {_fmt_ratio(r['ratio'])} | {_fmt_syncs(r.get('syncs'))} |"
            )
    if imports:
        out += [
            "",
            "## Import time",
            "",
            "Wall time in a fresh process (median); the library alone is measured with torch already imported.",
            "",
            "| contender | module | import torch + library (s) | library alone (s) |",
            "|---|---|---:|---:|",
        ]
        for name, r in imports.items():
            alone = "–" if name == "raw" else f"{r['beyond_torch']:.2f}"
            out.append(f"| {LABELS[name]} | `{IMPORTS[name]}` | {r['total']:.2f} | {alone} |")
    if skipped:
        out += ["", "Not installed (skipped): " + ", ".join(LABELS[n] for n in skipped) + "."]
    lines = summary(steps, imports)
    if lines:
        out += ["", "## What the figures show", ""] + [" ".join(lines)]
    out += ["", "## Hugging Face's Trainer", "", hf_trainer_paragraph(steps, imports, versions)]
    if plot:
        out += ["", f"![per-step time relative to the hand-written loop]({plot})"]
    return "\n".join(out) + "\n"


def render_plot(steps: dict[str, dict[str, dict]], imports: dict[str, dict], path: Path) -> None:
    """Bar charts: per-step ratio to the raw loop and host syncs per step, per model; import time beyond torch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = [n for n in CONTENDERS if any(n in r for r in steps.values())]
    counted = any(r.get("syncs") is not None for results in steps.values() for r in results.values())
    panels = 1 + bool(imports) + counted
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(steps))

    def grouped(ax, key: str, fmt: str) -> None:
        for i, (model, results) in enumerate(steps.items()):
            values = [(results[n].get(key) or 0.0) if n in results else 0.0 for n in names]
            xs = [j + (i - (len(steps) - 1) / 2) * width for j in range(len(names))]
            bars = ax.bar(xs, values, width, label=f"{model} ({MODEL_DESCRIPTIONS[model]})")
            ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_xticks(range(len(names)), [LABELS[n] for n in names], rotation=20, ha="right", fontsize=8)

    grouped(ax, "ratio", "%.2f")
    top = max((r["ratio"] or 0.0 for results in steps.values() for r in results.values()), default=1.0)
    ax.set_ylim(0, max(top, 1.0) * 1.3)  # headroom for the legend above the tallest bar
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("per-step CPU time / hand-written loop")
    ax.set_title("Per-step time (lower is better)")
    ax.legend(fontsize=7, loc="upper left")
    if counted:
        ax = axes[0][1]
        grouped(ax, "syncs", "%g")
        top = max((r.get("syncs") or 0.0 for results in steps.values() for r in results.values()), default=1.0)
        ax.set_ylim(0, max(top, 1.0) * 1.3)
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("Tensor calls that wait for the device")
        ax.set_title("Host syncs per step (lower is better)")
    if imports:
        ax = axes[0][-1]
        libs = [n for n in CONTENDERS if n in imports and n != "raw"]
        bars = ax.bar(range(len(libs)), [imports[n]["beyond_torch"] for n in libs], color="tab:green")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(libs)), [LABELS[n] for n in libs], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("seconds (wall), torch already imported")
        ax.set_title("Import time (lower is better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _training_arguments_fields() -> int | None:
    """How many fields ``transformers.TrainingArguments`` has here, or None if it is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import dataclasses

    from transformers import TrainingArguments

    return len(dataclasses.fields(TrainingArguments))


def hf_trainer_paragraph(steps: dict[str, dict[str, dict]], imports: dict[str, dict], versions: dict[str, str]) -> str:
    """A fair comparison with Hugging Face's ``Trainer``, with this run's figures where it has them."""
    fields = _training_arguments_fields()
    declared = (
        f"one `TrainingArguments` dataclass ({fields} fields in transformers {versions['transformers']})"
        if fields
        else "one `TrainingArguments` dataclass"
    )
    text = (
        "It is the loop most people would pick instead of trainloop, and it does much that trainloop does not "
        "try to: it is made for 🤗 Transformers models (`model(**batch)` returns the loss) and brings "
        "evaluation and prediction loops with metrics, reporting to many experiment trackers (`report_to`), "
        "checkpoint rotation and reloading of the best model, DDP, FSDP and DeepSpeed through Accelerate, "
        "mixed precision, pushing to the Hub and hyperparameter search, all declared in "
        f"{declared}. You change what it does by overriding its methods (`compute_loss`, `training_step`, ...) "
        "or with a `TrainerCallback`, whose levers are the flags of a `TrainerControl`. trainloop's job is "
        "narrower: any `nn.Module` and any iterable, built, placed and wrapped by you; a `forward` that "
        "returns the loss and records; pydantic-validated settings from keywords, a file or the environment; "
        "and the loop itself as a state machine you can print, trace and hook state by state. Two behaviours "
        "differ by default: trainloop checks every update's gradients for inf/NaN and never applies such an "
        "update (it stops with an error, or redoes the step on fresh batches if `max_non_finite_grad_retries` "
        "allows), while the Trainer (outside fp16's loss scaling) applies it and its "
        "`logging_nan_inf_filter` only keeps such losses out of the logged average. With logging, saving, "
        "reporting and the progress bar off, the Trainer still does work per step that the other loops here "
        "skip: it computes the gradient norm for its logs even with clipping off, steps a learning-rate "
        "scheduler (constant here), fires its callbacks' step events, tests the loss for inf/NaN, and draws "
        "batches through Accelerate's data loader wrapper."
    )
    figures = []
    for model, results in steps.items():
        hf, ours = results.get("transformers"), results.get("trainloop")
        if hf and hf["ratio"] is not None:
            figure = f"{_fmt_ratio(hf['ratio'])} the hand-written loop on the {model} model"
            if ours and ours["ratio"] is not None:
                figure += f" (trainloop {_fmt_ratio(ours['ratio'])})"
            figures.append(figure)
    counted = [results["transformers"].get("syncs") for results in steps.values() if "transformers" in results]
    if counted and counted[0] is not None and len(set(counted)) == 1:
        figures.append(f"{_fmt_syncs(counted[0])} host syncs per step")
    if "transformers" in imports:
        figure = f"{imports['transformers']['beyond_torch']:.2f} s of import on top of torch"
        if "trainloop" in imports:
            figure += f" (trainloop {imports['trainloop']['beyond_torch']:.2f} s)"
        figures.append(figure)
    if figures:
        text += " Measured here: " + ", ".join(figures) + "."
    else:
        text += " This run did not measure it."
    return text + (
        " If you train 🤗 Transformers models and want evaluation, the Hub and DeepSpeed ready-made, the Trainer "
        "is the shorter path; if you want to own the model and the data, see the sequencing, and pay little "
        "per step, that is what trainloop is for."
    )
