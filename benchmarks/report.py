"""Render ``docs/benchmarks.md`` and its plots from the results of ``benchmarks/compare.py``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

MIB = 2**20


def _mib(n) -> str:
    return f"{n / MIB:.1f}"


def _pct(x) -> str:
    return f"{x:+.0%}"


def plot_model(name: str, model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = model["variants"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        "none": ("k", "o"),
        "per-block": ("tab:red", "s"),
        "ckpt-seq": ("tab:orange", "D"),
        "compile": ("tab:purple", "^"),
    }
    for key, r in v.items():
        if r["method"] in styles:
            color, marker = styles[r["method"]]
            ax.errorbar(
                r["peak_ratio"],
                r["time_ratio"],
                yerr=[
                    [r["time_ratio"] - r["time_ratio_q1"]],
                    [r["time_ratio_q3"] - r["time_ratio"]],
                ],
                color=color,
                marker=marker,
                ms=7,
                ls="none",
                capsize=2,
            )
            ax.annotate(
                key,
                (r["peak_ratio"], r["time_ratio"]),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
                color=color,
            )
    colors = ["tab:blue", "tab:green", "tab:cyan", "tab:olive", "tab:brown"]
    solvers = sorted({p["solver"] for p in model["plans"]}, key=lambda s: (s != "auto", s))
    for i, solver in enumerate(solvers):
        keys = sorted(
            {p["variant"] for p in model["plans"] if p["solver"] == solver and p["status"] == "ok"},
            key=lambda k: v[k]["peak_ratio"],
        )
        if not keys:
            continue
        xs = [v[k]["peak_ratio"] for k in keys]
        ys = [v[k]["time_ratio"] for k in keys]
        ax.plot(
            xs,
            ys,
            marker="o" if solver == "auto" else ".",
            ls="-" if solver == "auto" else ":",
            color=colors[i % len(colors)],
            label=f"planner {solver}",
            ms=6 if solver == "auto" else 5,
            zorder=3 if solver == "auto" else 2,
        )
    for method, (color, marker) in styles.items():
        ax.plot([], [], color=color, marker=marker, ls="none", label=method)
    ax.set_xlabel("peak memory of a training step / no checkpointing")
    ax.set_ylabel("step time / no checkpointing (median, IQR)")
    ax.set_title(f"{name}: memory vs time (lower left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _dominated_text(d, auto) -> str:
    pairs = ", ".join(
        sorted(
            {
                f"{x['planner']}{' (auto)' if x['planner'] in auto else ''} by "
                f"{x['by']}" + ("" if x["beyond_noise"] else " (within noise)")
                for x in d["points"]
            }
        )
    )
    return f"dominated: {pairs}"


def _cost_model_line(results) -> str:
    model = results.get("cost_model", "roofline")
    if model.startswith("measured"):
        pooled = (
            " Each time is then replaced by the median over the nodes doing the same "
            "work (same module class or op, FLOPs, bytes moved and created: "
            "`benchmarks/compare.py` `pooled_seconds`), since single timings on this "
            "shared machine spread up to 10x between identical layers; `--unpooled` "
            "plans with the raw times."
            if "pooled" in model
            else ""
        )
        calls = (
            " The time of a checkpoint call and of a kept node are measured too "
            "(`planner.overheads.checkpoint_overheads`) and charged per segment and per kept node."
            if "with calls" in model
            else ""
        )
        return (
            "- **Planner's cost model**: each node's time measured on the benchmark's device "
            "(`CostModel(measured_seconds=planner.costs.node_seconds(model, inputs))`, "
            "counted in the planning times), so plans weigh recompute as this machine runs "
            "it; `--roofline` plans with the default roofline, whose figures describe a GPU."
            + pooled
            + calls
        )
    return (
        "- **Planner's cost model**: the default roofline (GPU figures); the step times are "
        "measured on this machine, so the planner's idea of what is cheap to recompute may "
        "differ from what is."
    )


def _target_lines(results) -> list[str]:
    t = results["targets"]
    lines = []
    g = t.get("gpt", {})
    a = g.get("at_per_block_peak")
    if a:
        lines.append(
            f"- **GPT, at per-block's peak** ({a['per_block_peak_ratio']:.2f}x of none): planner "
            f"(auto) overhead {_pct(a['planner_overhead'])} "
            f"vs per-block {_pct(a['per_block_overhead'])}"
            f" at {a['planner_peak_ratio']:.2f}x peak; target (at most half, at no higher peak): "
            f"**{'met' if a['met'] else 'missed'}**."
        )
    b = g.get("at_per_block_overhead")
    if b:
        lines.append(
            f"- **GPT, at per-block's overhead**: planner's activation peak is "
            f"{b['activation_reduction']:.1f}x below none (per-block: "
            f"{b['per_block_activation_reduction']:.1f}x); target (5x): "
            f"**{'met' if b['met'] else 'missed'}**."
        )
    elif g:
        lines.append(
            "- **GPT, at per-block's overhead**: no planner point was as fast as "
            "per-block: **missed**."
        )
    for name, m in t.items():
        model = results["models"][name]
        v = model["variants"]
        auto = {
            p["variant"] for p in model["plans"] if p["solver"] == "auto" and p["status"] == "ok"
        }
        d = m["dominated"]
        p = m["prediction"]
        at = m.get("at_per_block_peak")
        parts = []
        if at:
            row = next(
                p
                for p in model["plans"]
                if p["solver"] == "auto" and p["budget"] == "= per-block" and p["status"] == "ok"
            )
            text = (
                f"at per-block's peak: planner overhead {_pct(at['planner_overhead'])} vs "
                f"{_pct(at['per_block_overhead'])} ({'met' if at['met'] else 'missed'}"
            )
            if not at["met"]:
                act = (
                    model["lowest_predicted_peak_bytes"]
                    - model["fixed_bytes"]
                    - model["gradient_bytes"]
                ) / max(v["none"]["activation_bytes"], 1)
                extra_pl = v[row["variant"]]["flops_ratio"] - 1
                extra_pb = v["per-block"]["flops_ratio"] - 1
                if extra_pl <= 0.55 * extra_pb:  # at (or within rounding of) half
                    text += (
                        f": extra FLOPs {extra_pl:+.0%} vs {extra_pb:+.0%} are about half; "
                        f"the time does not, as recomputed elementwise/norm ops cost more "
                        f"than their FLOPs, and the IQRs overlap"
                    )
                else:
                    text += (
                        f": per-block already keeps only "
                        f"{v['per-block']['activation_ratio']:.0%} of the activations and "
                        f"the lowest plan {act:.0%}, so at that memory planner must "
                        f"recompute almost as much: extra FLOPs {extra_pl:+.0%} vs "
                        f"{extra_pb:+.0%}"
                    )
            parts.append(text + ")")
        if d["met"]:
            parts.append("never dominated")
        elif not any(x["planner"] in auto and x["beyond_noise"] for x in d["points"]):
            parts.append("planner auto never dominated beyond noise; " + _dominated_text(d, auto))
        else:
            parts.append(_dominated_text(d, auto))
        if p["worst_variant"]:
            parts.append(
                f"worst prediction error {p['worst_error']:+.1%} ({p['worst_variant']}; "
                f"{'met' if p['met'] else 'missed'})"
            )
        lines.append(f"- {name}: " + "; ".join(parts) + ".")
    return lines


def _yes(flag) -> str:
    return "met" if flag else "**missed**"


def _target_tables(results) -> list[str]:
    """The issue-12 targets as tables: planner (auto) at every peak torch.compile reached, at
    per-block checkpointing's peak, and the lowest peaks."""
    t = results["targets"]
    out = [
        "Planner (`auto`) given each peak that `torch.compile` reached as its budget. Targets: "
        "measured peak no higher, extra FLOPs at most compile's + 1 % of a step, median step "
        "time at most compile's (`~` marks times whose IQRs overlap: within this machine's "
        "noise).",
        "",
        "| model | compile budget | compile peak / none | compile extra FLOPs | compile time "
        "| planner peak / none | planner extra FLOPs | planner time | FLOPs target | time target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, m in t.items():
        v = results["models"][name]["variants"]
        for r in m.get("at_compile_peaks", {}).get("rows", []):
            c = v[r["compile"]]
            budget = f"{c['activation_memory_budget']:g}"
            if r["planner"] is None:
                out.append(
                    f"| {name} | {budget} | {c['peak_ratio']:.2f} | "
                    f"{c['flops_ratio'] - 1:+.1%} | {c['time_ratio']:.2f} | no plan fits "
                    f"| | | **missed** | **missed** |"
                )
                continue
            noise = " ~" if r["time_within_noise"] and not r["time_met"] else ""
            out.append(
                f"| {name} | {budget} | {r['compile_peak_ratio']:.2f} | "
                f"{r['compile_extra_flops']:+.1%} | {r['compile_time_ratio']:.2f} | "
                f"{r['planner_peak_ratio']:.2f}{'' if r['fits'] else ' (over)'} | "
                f"{r['planner_extra_flops']:+.1%} | {r['planner_time_ratio']:.2f}{noise} | "
                f"{_yes(r['fits'] and r['flops_met'])} | {_yes(r['time_met'])} |"
            )
    out += [
        "",
        "At per-block checkpointing's peak (target: planner's extra FLOPs at most half of "
        "per-block's) and the lowest peaks (target: planner reaches lower than any baseline).",
        "",
        "| model | per-block peak / none | per-block extra FLOPs | planner extra FLOPs at that "
        "peak | target | compile's lowest peak / none | planner's lowest peak / none | target |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for name, m in t.items():
        a, low = m.get("at_per_block_peak"), m.get("lowest")
        pb = results["models"][name]["variants"]["per-block"]
        left = (
            f"{a['per_block_peak_ratio']:.2f} | {a['per_block_extra_flops']:+.1%} | "
            f"{a['planner_extra_flops']:+.1%} | {_yes(a['flops_met'])}"
            if a and "per_block_extra_flops" in a
            else f"{pb['peak_ratio']:.2f} | {pb['flops_ratio'] - 1:+.1%} | no plan fits | "
            f"**missed**"
        )
        right = (
            f"{low['compile_lowest_ratio']:.2f} | {low['peak_ratio']:.2f} | {_yes(low['met'])}"
            if low
            else " | | "
        )
        out.append(f"| {name} | {left} | {right} |")
    return out


COST_MODEL_RESULTS = Path(__file__).resolve().parent / "results" / "cost_model.json"
FLOOR_RESULTS = Path(__file__).resolve().parent / "results" / "floors.json"
SEGMENTS_ONLY_RESULTS = Path(__file__).resolve().parent / "results" / "segments-only.json"


def _saved_results(path: Path) -> dict | None:
    """The results another benchmark wrote at ``path``, or None when it has not run."""
    return json.loads(path.read_text()) if path.exists() else None


def _before_section(results) -> list[str]:
    """Planner (auto) at compile's peaks before kept nodes (segments only) and now."""
    before = _saved_results(SEGMENTS_ONLY_RESULTS)
    if before is None:
        return []
    out = [
        "### Segments only (before kept nodes) and now",
        "",
        f"Before: `{before['command']}` ({before['date'][:10]}, segments only, raw measured "
        "node times); now: this page's run. Extra FLOPs and median step time / none of "
        "planner (`auto`) at each peak torch.compile reached (both runs measured their own "
        "compile peaks: the budgets differ slightly).",
        "",
        "| model | compile budget | before: extra FLOPs | now: extra FLOPs | before: time | "
        "now: time | now: kept nodes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = 0
    for name, t in results["targets"].items():
        old = before.get("targets", {}).get(name)
        if not old:
            continue
        old_rows = {r["compile"]: r for r in old["at_compile_peaks"]["rows"]}
        v = results["models"][name]["variants"]
        for r in t["at_compile_peaks"]["rows"]:
            o = old_rows.get(r["compile"])
            if not o or o["planner"] is None or r["planner"] is None:
                continue
            rows += 1
            out.append(
                f"| {name} | {r['compile'].split()[-1]} | {o['planner_extra_flops']:+.1%} | "
                f"{r['planner_extra_flops']:+.1%} | {o['planner_time_ratio']:.2f} | "
                f"{r['planner_time_ratio']:.2f} | {len(v[r['planner']].get('kept') or ())} |"
            )
    return out + [""] if rows else []


OBJECTIVE_RESULTS = Path(__file__).resolve().parent / "results" / "objective.json"


def _objective_section() -> list[str]:
    """Planner at compile's peaks planned for time and for FLOPs first (benchmarks/objective.py)."""
    r = _saved_results(OBJECTIVE_RESULTS)
    if r is None:
        return []
    out = [
        "### Time or FLOPs: which objective is faster here",
        "",
        f"`{r['command']}` ({r['date'][:10]}, {r['reps']} interleaved repetitions). At each "
        "peak `torch.compile` reached, `auto` planned twice: for time (measured, pooled node "
        "times: what every other row of this page uses) and FLOPs first (the roofline with "
        "memory traffic 1,000x cheaper, so pointwise recompute is nearly free, as fusion makes "
        "it for the compiler). Extra FLOPs are matmuls, measured; time is the median step time "
        "/ none [IQR].",
        "",
        "| model | compile budget | compile peak / none | compile: extra FLOPs, time | "
        "planner for time: extra FLOPs, time (predicted), peak / none | "
        "planner FLOPs first: the same |",
        "|---|---:|---:|---|---|---|",
    ]

    def cell(v, predicted=None) -> str:
        text = (
            f"{v['extra_flops']:+.1%}, {v['time_ratio']:.3f} "
            f"[{v['time_ratio_q1']:.3f}-{v['time_ratio_q3']:.3f}]"
        )
        if predicted is None:
            return text
        return f"{text} ({1 + predicted:.3f}), peak {v['peak_ratio']:.2f}"

    for name, m in r["models"].items():
        v = m["variants"]
        for row in m["rows"]:
            plans = [
                cell(v[row[k]["variant"]], row[k]["predicted_overhead"]) for k in ("time", "flops")
            ]
            out.append(
                f"| {name} | {row['budget']:g} | {v[row['compile']]['peak_ratio']:.2f} | "
                f"{cell(v[row['compile']])} | {plans[0]} | {plans[1]} |"
            )
    rows = [(m["variants"], row) for m in r["models"].values() for row in m["rows"]]

    def meets(v, row, k) -> bool:  # issue 12's FLOPs target: compile's extra FLOPs + 1 point
        return v[row[k]["variant"]]["extra_flops"] <= v[row["compile"]]["extra_flops"] + 0.01

    def faster(v, row) -> bool:
        return v[row["time"]["variant"]]["time_ratio"] < v[row["flops"]["variant"]]["time_ratio"]

    out += [
        "",
        f"Of {len(rows)} peaks, the FLOPs target (compile's extra FLOPs + 1 point) is met at "
        f"{sum(meets(v, row, 'flops') for v, row in rows)} planning FLOPs first and at "
        f"{sum(meets(v, row, 'time') for v, row in rows)} planning for time; the plan for "
        f"time has the faster median step at {sum(faster(v, row) for v, row in rows)}.",
    ]
    compile_1 = {name: m["variants"].get("compile 1") for name, m in r["models"].items()}
    out += [
        "",
        "Compile without recompute (`compile 1`) runs at "
        + ", ".join(
            f"{v['time_ratio']:.3f} ({name})" for name, v in compile_1.items() if v is not None
        )
        + " of none: the part of compile's times that is not recompute (`aot_eager` runs "
        "its own graph, without the modules' calls).",
        "",
    ]
    return out


def _floor_section() -> list[str]:
    """Lowest peaks against the physical floor, 20% plans (rendered by benchmarks/floors.py)."""
    from benchmarks.floors import render

    r = _saved_results(FLOOR_RESULTS)
    return [] if r is None else render(r)


def _cost_model_section() -> list[str]:
    """Predicted against measured step-time overhead per cost model (benchmarks/cost_model.py)."""
    r = _saved_results(COST_MODEL_RESULTS)
    if r is None:
        return []
    spread = r["linear_seconds"]
    out = [
        "## Does the cost model rank plans as step time does?",
        "",
        f"`{r['command']}`: a residual MLP of {r['blocks']} blocks (`x + Linear(relu(Linear(x)))`, "
        f"d {r['width']}, batch {r['batch']}) planned by `optimal` at half its activation memory "
        f"with each cost model; {r['reps']} interleaved timed steps. The raw measured times of "
        f"the {r['blocks']} identical first Linear layers spread from "
        f"{spread['min'] * 1e3:.2f} to {spread['max'] * 1e3:.2f} ms (median "
        f"{spread['median'] * 1e3:.2f} ms): noise the solver exploits, recomputing the layers "
        "that happened to be timed fast. Pooling (the median over nodes doing the same work) "
        "removes it.",
        "",
    ]
    if "checkpoint_seconds" not in r:  # a run from before call costs were modelled
        out += [
            "| cost model | segments | predicted time / none | measured time / none |",
            "|---|---:|---:|---:|",
        ]
        for name, p in r["plans"].items():
            out.append(
                f"| {name} | {p['segments']} | {1 + p['predicted_overhead']:.3f} | "
                f"{p['measured_time_ratio']:.3f} |"
            )
        return out + [""]
    out += [
        "The last cost model adds what checkpointing costs besides recompute, measured on this "
        "machine by `planner.overheads.checkpoint_overheads`: "
        f"{r['checkpoint_seconds'] * 1e6:.0f} us per checkpoint call and "
        f"{r['keep_seconds'] * 1e6:.0f} us per kept node. Each plan's predicted time is given "
        "under the cost model that made it and under that last model (pooled node times and "
        "calls), beside the measured time.",
        "",
        "| cost model | segments | kept | predicted time / none | predicted with calls | "
        "measured time / none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, p in r["plans"].items():
        out.append(
            f"| {name} | {p['segments']} | {p['kept']} | {1 + p['predicted_overhead']:.3f} | "
            f"{1 + p['predicted_overhead_with_calls']:.3f} | {p['measured_time_ratio']:.3f} |"
        )

    def order(key: str) -> str:
        """Plans from least to most time; ``=`` joins equal predictions (the same plan)."""
        ranked = sorted(r["plans"], key=lambda name: r["plans"][name][key])
        out = ranked[:1]
        for before, name in zip(ranked, ranked[1:]):
            same = math.isclose(r["plans"][before][key], r["plans"][name][key], rel_tol=1e-9)
            out += [" = " if same else " < ", name]
        return "".join(out)

    out += [
        "",
        f"- Ordered by measured time: {order('measured_time_ratio')}.",
        f"- Ordered by the prediction with calls: {order('predicted_overhead_with_calls')}.",
    ]
    return out + [""]


def _model_call(name: str, config: dict) -> str:
    arguments = ", ".join(f"{k}={x}" for k, x in config.items())
    if name.startswith("hf-"):
        return f"benchmarks.hf.build({name!r}, {arguments})"
    return f"zoo.{name}({arguments})"


def render_page(results: dict, page: Path, img_dir: Path) -> None:
    page = Path(page)
    img_dir = Path(img_dir)
    mach = results["machine"]
    backend = results.get("compile_backend", "aot_eager")
    load = mach.get("load_average")
    load_text = f", load average {load[0]:.1f} at the start" if load else ""
    out = [
        "# Benchmarks: planner against the alternatives",
        "",
        "<!-- generated by benchmarks/compare.py; do not edit by hand -->",
        "",
        f"- **Command:** `{results['command']}` (mode `{results['mode']}`, {results['reps']} "
        f"timed repetitions per method, interleaved; run took {results['seconds'] / 60:.1f} min)",
        f"- **Machine:** {mach['cpu']}, {mach['cores']} cores shared with other jobs{load_text}; "
        f"torch threads {mach['threads']}; {mach['platform']}"
        + (f"; GPU {mach['cuda']}" if mach.get("cuda") else ""),
        f"- **torch** {mach['torch']}, Python {mach['python']}; **date** {results['date']}",
        *([f"- **Note:** {results['note']}"] if results.get("note") else []),
        f"- **Solvers:** {', '.join(results['solvers'])}; torch.compile budgets "
        f"{', '.join(f'{b:g}' for b in results['compile_budgets'])}",
        "",
        "Regenerate: `.venv/bin/python benchmarks/compare.py --mode full` (writes "
        "`benchmarks/results/full.json`, this page and `docs/img/benchmarks_*.png`); "
        "`--mode short` took 9.3 min on a 2-core CPU for the four models of the command above; "
        "its eight default models take longer.",
        "",
        "## Targets",
        "",
        *_target_tables(results),
        "",
        *_target_lines(results),
        "",
        *_before_section(results),
        *_objective_section(),
        *_cost_model_section(),
        *_floor_section(),
        "## How it is measured",
        "",
        "- **One training step** = forward, `planner.step.training_loss`, backward "
        "(no optimizer), from `.grad = None`.",
        "- **Peak**: the project's CPU live-storage tracker (`planner.step.peak_memory`); "
        "CUDA allocator statistics on CUDA. Dynamo runs compiled frames eagerly whenever a "
        "`TorchDispatchMode` is active unless the mode declares `ignore_compile_internals()`; "
        "the tracker does, so for `torch.compile` it sees the compiled graph's operators "
        "(checked against `torch.profiler` memory events: equal to the byte).",
        _cost_model_line(results),
        "- **Activations** = peak minus parameters, buffers, inputs and gradients "
        "(`problem.fixed_bytes + problem.gradient_bytes`). Planner budgets of X % are "
        "fixed + gradients + X % of no checkpointing's measured activation peak; `= m` is method "
        "m's measured peak; `lowest` the lowest peak the planner predicts it can reach.",
        "- **Time**: each repetition steps every method once (order rotated), after one warm-up "
        "round; the ratio to `none` is taken per repetition, then the median (IQR in brackets). "
        "The machine is shared: read differences of a few percent as noise.",
        "- **FLOPs**: separate pass, `torch.utils.flop_counter` formulas (matmul/conv only; "
        "elementwise ops count 0), also inside compiled graphs.",
        "- **Saved**: bytes autograd saves for backward during forward (saved-tensors hook), for "
        "`none` and `torch.compile` (inside `checkpoint` regions the checkpoint's own hooks "
        "take over, so it is not comparable for checkpointed modules).",
        "- **per-block**: every block under `checkpoint(use_reentrant=False)`: mlp (Linear, ReLU) "
        "pairs, resnet `blocks.*`, gpt `blocks.*`, bert `layers.*`, unet `down.*`, "
        "`bottleneck`, `dec.*`; the Hugging Face models (`hf-*`) use their own "
        '`gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": '
        "False})`. As in Hugging Face models, BatchNorm running statistics are updated twice per "
        "step under recompute (planner restores them).",
        "- **hf-\\***: Hugging Face `transformers` GPT-2 (`GPT2LMHeadModel`), Llama "
        "(`LlamaForCausalLM`) and BERT (`BertModel`) built from small configurations "
        "(`benchmarks/hf.py`: random weights, vocabulary 1024, `use_cache=False`, eager "
        "attention so that attention matmuls count as FLOPs, default dropout), token ids as "
        "input; captured by `torch.export`.",
        "- **predicted time / none**: 1 + the planner's predicted recompute time as a fraction "
        "of a step (its cost model; a step taken as three forwards), beside the measured ratio.",
        "- **ckpt-seq**: `checkpoint_sequential(blocks, round(sqrt(n)))` over the same blocks "
        "(stem/embeddings and head outside; not for `hf-*`). bert's layers take `(x, mask)` "
        "and unet has long skips, so for them an adapter chunks the blocks exactly as "
        "`checkpoint_sequential` does (last chunk not checkpointed); a unet chunk takes and "
        "returns the pending skips.",
        f'- **compile b**: `torch.compile(model, backend="{backend}", fullgraph=True)` with '
        "`torch._functorch.config.activation_memory_budget = b` while compiling; each budget "
        "gets its own wrapper code object, else dynamo reuses the first budget's graph. Time "
        "column `plan/compile s` is the first (compiling) step. "
        + (
            "aot_eager runs the graph without fusion, so its time reflects recompute, not "
            "inductor speed."
            if backend == "aot_eager"
            else "inductor fuses the pointwise work (planner's plans run eagerly), so its time "
            "includes fusion's gain, not only recompute's cost."
        ),
        "",
    ]
    for name, m in results["models"].items():
        v = m["variants"]
        img = img_dir / f"benchmarks_{name}.png"
        plot_model(name, m, img)
        rel = os.path.relpath(img, page.parent)
        none = v["none"]
        out += [
            f"## {name}",
            "",
            f"`{_model_call(name, m['config'])}`: "
            f"{m['nodes']} graph nodes (captured by {m['capture']}); fixed "
            f"{_mib(m['fixed_bytes'])} MiB + gradients {_mib(m['gradient_bytes'])} MiB; "
            f"no checkpointing: peak {_mib(none['peak_bytes'])} MiB (predicted "
            f"{_mib(m['baseline_predicted_peak_bytes'])}), activations "
            f"{_mib(none['activation_bytes'])} MiB, step {none['median_seconds'] * 1e3:.0f} ms. "
            f"Planning: prepare {m['prepare_seconds']:.2f} s, `planner.plan(...)` end to end "
            f"{m['plan_seconds']:.2f} s.",
            "",
            f"![{name}: memory vs time]({rel})",
            "",
            "| method | peak MiB | peak / none | activations / none | time / none "
            "| predicted time / none | FLOPs / none | predicted peak (error) | plan/compile s "
            "| saved MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, r in v.items():
            if r["method"] == "planner":
                budgets = sorted(
                    {f"{p['solver']}@{p['budget']}" for p in m["plans"] if p.get("variant") == key}
                )
                kept = f", {len(r['kept'])} kept" if r.get("kept") else ""
                label = f"{key} ({len(r['segments'])} seg{kept}; " + ", ".join(budgets) + ")"
                pred = f"{_mib(r['predicted_peak_bytes'])} ({r['prediction_error']:+.1%})"
                secs = min(p["solve_seconds"] for p in m["plans"] if p.get("variant") == key)
                secs_text = f"{secs + r['rewrite_seconds']:.3f}"
                predicted_time = f"{1 + r['predicted_overhead']:.2f}"
            else:
                label = key
                pred = predicted_time = ""
                secs_text = f"{r['compile_seconds']:.1f}" if "compile_seconds" in r else ""
            saved = _mib(r["saved_bytes"]) if r.get("saved_bytes") is not None else ""
            out.append(
                f"| {label} | {_mib(r['peak_bytes'])} | {r['peak_ratio']:.2f} | "
                f"{r['activation_ratio']:.2f} | {r['time_ratio']:.2f} "
                f"[{r['time_ratio_q1']:.2f}-{r['time_ratio_q3']:.2f}] | {predicted_time} | "
                f"{r['flops_ratio']:.2f} | "
                f"{pred} | {secs_text} | {saved} |"
            )
        infeasible = [p for p in m["plans"] if p["status"] != "ok"]
        if infeasible:
            by_budget: dict = {}
            for p in infeasible:
                by_budget.setdefault((p["budget"], p["budget_bytes"]), []).append(p)
            out += [
                "",
                "Budgets a solver could not meet (its predicted peak in brackets): "
                + "; ".join(
                    f"{label} = {_mib(nbytes)} MiB: "
                    + ", ".join(f"{p['solver']} ({_mib(p['predicted_peak_bytes'])})" for p in ps)
                    for (label, nbytes), ps in by_budget.items()
                )
                + ".",
            ]
        out.append("")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(out) + "\n")
