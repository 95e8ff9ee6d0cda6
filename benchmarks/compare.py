"""Memory and time of one training step: planner against the alternatives users would pick.

    .venv/bin/python benchmarks/compare.py --mode short    # 10 min or more on 2 cores
    .venv/bin/python benchmarks/compare.py --mode full     # the run behind docs/benchmarks.md

On a CUDA machine whose ``python3`` has torch, transformers, networkx and scipy (no venv: the
venv's torch is the CPU build), one model per run keeps each run short:

    PYTHONPATH=. python3 benchmarks/compare.py --device cuda --backend inductor \
        --models hf-gpt2 --solvers auto --out benchmarks/results/cuda-hf-gpt2.json --no-page

For every model of ``planner.zoo`` and the small Hugging Face GPT-2, Llama and BERT of
``benchmarks/hf.py`` (configurations in ``CONFIGS``) and every method:

* ``none``: the model as it is;
* ``per-block``: Hugging Face style, every block under ``torch.utils.checkpoint`` (the Hugging
  Face models' own ``gradient_checkpointing_enable``);
* ``ckpt-seq``: ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(n) segments (zoo
  models only);
* ``compile b``: ``torch.compile(backend="aot_eager")`` with ``activation_memory_budget=b``
  (``--backend inductor`` on CUDA: the compiler as users run it, fused kernels included);
* ``planner``: ``solver="auto"`` and each registered solver, at budgets of 100/50/33/20 % of the
  baseline activation memory (on top of parameters, buffers, inputs and gradients), at each
  baseline's measured peak, and at the lowest peak the planner can reach, planning with node
  times and checkpoint-call costs measured on the device (``--roofline``: with the default
  roofline cost model);

it measures the peak memory of one step (the project's CPU live-storage tracker, CUDA allocator
statistics on CUDA), the step time (all methods interleaved in every repetition; median of the
per-repetition ratios to ``none``), the FLOPs (separate pass), the planning or compile time, the
saved-for-backward bytes (plain and compiled modules), and for planner the predicted peak. It
writes ``benchmarks/results/<mode>.json`` and regenerates ``docs/benchmarks.md`` with one
memory-vs-time plot per model in ``docs/img/``. ``--page-only`` re-renders the page from a JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as a script from a fresh clone, without installing
    sys.path.insert(0, str(ROOT))

from benchmarks import baselines, hf, instruments  # noqa: E402
from benchmarks.report import render_page  # noqa: E402
from planner import costs, overheads, step, zoo  # noqa: E402
from planner.costs import CostModel  # noqa: E402
from planner.nested import NestedChoice  # noqa: E402
from planner.pipeline import plan, prepare  # noqa: E402
from planner.rewrite import rewrite  # noqa: E402
from planner.simulate import as_choice, simulate  # noqa: E402
from planner.solvers import SOLVERS  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402

# The MILP is a checker for small graphs (minutes per budget beyond ~50 nodes), not a planner.
BENCHMARKED_SOLVERS = [name for name in sorted(SOLVERS) if name not in ("auto", "milp")]

# The models, identical in both modes: a 100+ layer MLP chain, a ResNet with BatchNorm, a
# 12-layer GPT decoder, a 12-layer BERT encoder, a U-Net with long skips, and Hugging Face
# GPT-2, Llama and BERT (4 layers, d 256, sequence 128, batch 4, random weights).
HF = dict(layers=4, d_model=256, heads=4, seq=128, batch=4)
CONFIGS = {
    "mlp": dict(depth=128, width=128, batch=256),
    "resnet": dict(blocks=8, channels=32, batch=16, image=32),
    "gpt": dict(layers=12, d_model=128, heads=4, seq=128, batch=4),
    "bert": dict(layers=12, d_model=128, heads=4, seq=128, batch=4),
    "unet": dict(depth=4, channels=16, batch=4, image=64),
    **{name: dict(HF) for name in hf.NAMES},
}
# The activation budgets the targets are stated for; full mode adds 0 (save only inputs).
TARGET_COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.1)
MODES = {
    "short": dict(reps=5, compile_budgets=TARGET_COMPILE_BUDGETS),
    "full": dict(reps=21, compile_budgets=(*TARGET_COMPILE_BUDGETS, 0.0)),
}
FRACTIONS = (("100%", 1.0), ("50%", 0.5), ("33%", 1 / 3), ("20%", 0.2))


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


class Variant:
    """One module to measure, and what is known about it before measuring."""

    def __init__(self, key, method, module, **info):
        self.key = key
        self.method = method
        self.module = module
        self.info = info
        self.measured: dict = {}
        self.times: list[float] = []


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_interleaved(variants, args, reps, device):
    """One warm-up round, then ``reps`` rounds; each round steps every variant once, in an order
    rotated from round to round so that no method always follows the same one."""
    order = list(variants)
    for r in range(reps + 1):
        shift = r % len(order)
        for v in order[shift:] + order[:shift]:
            step.clear_grads(v.module)
            _sync(device)
            begin = time.perf_counter()
            step.training_step(v.module, args)
            _sync(device)
            if r > 0:
                v.times.append(time.perf_counter() - begin)


def _parse_overrides(items):
    out: dict[str, dict] = {}
    for item in items or ():
        name, _, rest = item.partition(":")
        for pair in filter(None, rest.split(",")):
            k, _, v = pair.partition("=")
            out.setdefault(name, {})[k] = int(v) if v.lstrip("-").isdigit() else float(v)
    return out


def cost_model_for(model, args, roofline: bool) -> CostModel:
    """The planner's cost model: per-node times, and the time of a checkpoint call and of a
    kept node, measured on the benchmark's device (what its step times are measured on), or
    the default roofline, whose figures describe a GPU."""
    if roofline:
        return CostModel()
    return CostModel(
        measured_seconds=costs.node_seconds(model, args),
        **overheads.checkpoint_overheads(model, args),
    )


def _kind(model, label: str) -> str:
    """What a node runs: the module class for a module call, else its label (op name)."""
    try:
        return type(model.get_submodule(label)).__name__
    except AttributeError:
        return label


def pooled_seconds(problem, model) -> dict[str, float]:
    """Measured node times, each replaced by the median over the nodes that do the same work.

    Nodes of one kind (module class or op) with equal FLOPs, bytes moved and bytes created cost
    the same; their measured times on a shared CPU still spread up to 10x (identical
    ``Linear(256, 256)`` layers of a residual MLP read 1.4 to 14 ms), and a solver given those
    times recomputes the layers that happened to be timed fast: gains that are noise. The
    median of the group removes that noise.
    """
    groups: dict[tuple, list[int]] = {}
    for i, label in enumerate(problem.labels):
        key = (
            _kind(model, label),
            float(problem.flops[i]),
            float(problem.bytes_moved[i]),
            int(problem.created_bytes[i]),
        )
        groups.setdefault(key, []).append(i)
    pooled = {}
    for members in groups.values():
        median = float(np.median(problem.seconds[members]))
        pooled.update((problem.names[i], median) for i in members)
    return pooled


def build_model(name, config, device):
    """``(model, args)`` of a zoo model or of a Hugging Face one (``hf-*``)."""
    if name in hf.NAMES:
        return hf.build(name, **config, device=device)
    return zoo.build(name, **config, device=device)


def bench_model(
    name, config, mode, device, reps, roofline=False, solvers=None, pool=True, backend="aot_eager"
):
    """Measure every method on one model; return its JSON-ready record."""
    _log(f"== {name} {config}")
    t0 = time.perf_counter()
    model, args = build_model(name, config, device)
    variants: list[Variant] = []

    none = Variant("none", "none", model)
    variants.append(none)
    none.measured["memory"] = step.peak_memory(model, args)

    start = time.perf_counter()  # planning includes timing the nodes for the cost model
    cost_model = cost_model_for(model, args, roofline)
    captured, problem = prepare(model, args, cost_model=cost_model)
    if not roofline and pool:
        cost_model = dataclasses.replace(
            cost_model, measured_seconds=pooled_seconds(problem, model)
        )
        problem = dataclasses.replace(
            problem, seconds=cost_model.seconds(problem.flops, problem.bytes_moved, problem.names)
        )
    prepare_seconds = time.perf_counter() - start
    fixed = problem.fixed_bytes + problem.gradient_bytes
    baseline_sim = simulate(problem, ())
    lowest = lowest_peak(problem)

    n_blocks = baselines.block_count(name, model)
    variants.append(
        Variant("per-block", "per-block", baselines.per_block(name, model), blocks=n_blocks)
    )
    if baselines.has_checkpoint_sequential(name):
        variants.append(
            Variant(
                "ckpt-seq",
                "ckpt-seq",
                baselines.checkpoint_sequential(name, model),
                blocks=n_blocks,
                segments=baselines.sqrt_segments(n_blocks),
            )
        )
    for i, b in enumerate(MODES[mode]["compile_budgets"]):
        module = baselines.compiled(model, b, f"{name}_{i}", backend)
        begin = time.perf_counter()
        baselines.compile_now(module, b, lambda m: step.training_step(m, args))
        variants.append(
            Variant(
                f"compile {b:g}",
                "compile",
                module,
                activation_memory_budget=b,
                compile_seconds=time.perf_counter() - begin,
            )
        )
    for v in variants[1:]:
        v.measured["memory"] = step.peak_memory(v.module, args)
    none_peak = none.measured["memory"].peak_bytes

    _log(f"   baselines measured ({time.perf_counter() - t0:.0f} s)")
    budgets = [(label, fixed + round(f * (none_peak - fixed))) for label, f in FRACTIONS]
    budgets += [(f"= {v.key}", v.measured["memory"].peak_bytes) for v in variants[1:]]
    budgets.append(("lowest", lowest.peak_bytes))

    plans = []  # one row per (solver, budget)
    by_segments: dict = {}
    for solver in solvers or ["auto", *BENCHMARKED_SOLVERS]:
        for label, budget in budgets:
            begin = time.perf_counter()
            ran, chosen = choose(problem, budget, solver)
            solve_seconds = time.perf_counter() - begin
            if isinstance(chosen, NestedChoice) and chosen.flat() is not None:
                chosen = chosen.flat()
            nested = isinstance(chosen, NestedChoice)  # only where no flat plan fits
            choice = chosen if nested else as_choice(chosen)
            segments = (
                tuple((s.start, s.stop) for s in chosen.segments) if nested else choice.segments
            )
            kept = frozenset() if nested else choice.keep
            sim = simulate(problem, choice)
            row = dict(
                solver=solver,
                ran=ran,
                budget=label,
                budget_bytes=int(budget),
                solve_seconds=solve_seconds,
                segments=len(segments),
                kept=len(kept),
                predicted_peak_bytes=int(sim.peak_bytes),
                predicted_overhead=sim.recompute_seconds / problem.step_seconds,
            )
            if sim.peak_bytes > budget:
                row["status"] = "infeasible"
                plans.append(row)
                continue
            row["status"] = "ok"
            key = (segments, kept, nested and chosen)
            if key not in by_segments:
                begin = time.perf_counter()
                module = rewrite(captured.graph_module, model, choice, problem=problem)
                rewrite_seconds = time.perf_counter() - begin
                v = Variant(
                    f"planner#{len(by_segments)}",
                    "planner",
                    module,
                    segments=[list(s) for s in segments],
                    kept=sorted(kept),
                    predicted_peak_bytes=int(sim.peak_bytes),
                    predicted_overhead=row["predicted_overhead"],
                    rewrite_seconds=rewrite_seconds,
                )
                by_segments[key] = v
                variants.append(v)
                v.measured["memory"] = step.peak_memory(module, args)
            row["variant"] = by_segments[key].key
            plans.append(row)

    # End-to-end planning time of the public API, once, at the 50 % budget (or the lowest
    # reachable peak when 50 % cannot be met).
    plan_budget = max(budgets[1][1], lowest.peak_bytes)
    begin = time.perf_counter()
    plan(model, args, budget_bytes=plan_budget, cost_model=cost_model)
    plan_seconds = time.perf_counter() - begin

    _log(
        f"   {len(variants)} variants planned and measured ({time.perf_counter() - t0:.0f} s); "
        f"FLOPs, saved bytes, timing x{reps}"
    )
    flops_check = step.step_flops(model, args)
    exclude = step.state_tensors(model, args, {})
    for v in variants:
        v.measured["flops"] = instruments.step_flops(v.module, args)
        if v.method in ("none", "compile"):
            v.measured["saved_bytes"] = instruments.saved_bytes(v.module, args, exclude)
    gc.collect()
    _time_interleaved(variants, args, reps, torch.device(device or "cpu"))

    _log(f"   done ({time.perf_counter() - t0:.0f} s)")
    none_times = none.times
    record_variants = {}
    for v in variants:
        mem = v.measured["memory"]
        ratios = [t / t0 for t, t0 in zip(v.times, none_times)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        record_variants[v.key] = dict(
            method=v.method,
            **v.info,
            peak_bytes=mem.peak_bytes,
            start_bytes=mem.start_bytes,
            peak_ratio=mem.peak_bytes / none_peak,
            activation_bytes=mem.peak_bytes - fixed,
            activation_ratio=(mem.peak_bytes - fixed) / (none_peak - fixed),
            times=v.times,
            median_seconds=statistics.median(v.times),
            time_ratio=statistics.median(ratios),
            time_ratio_q1=q[0],
            time_ratio_q3=q[2],
            flops=v.measured["flops"],
            flops_ratio=v.measured["flops"] / none.measured["flops"],
            saved_bytes=v.measured.get("saved_bytes"),
        )
        if v.method == "planner":
            pred = v.info["predicted_peak_bytes"]
            record_variants[v.key]["prediction_error"] = (pred - mem.peak_bytes) / mem.peak_bytes
    return dict(
        config=config,
        nodes=problem.size,
        capture=captured.method,
        fixed_bytes=problem.fixed_bytes,
        gradient_bytes=problem.gradient_bytes,
        baseline_predicted_peak_bytes=int(baseline_sim.peak_bytes),
        lowest_predicted_peak_bytes=int(lowest.peak_bytes),
        prepare_seconds=prepare_seconds,
        plan_seconds=plan_seconds,
        flops_cross_check=dict(
            planner_measure_step_flops=flops_check, instruments_step_flops=none.measured["flops"]
        ),
        variants=record_variants,
        plans=plans,
    )


def _auto_row(model: dict, budget_label: str):
    """The ``auto`` plan row at one budget label, when it fits; else None."""
    return next(
        (
            p
            for p in model["plans"]
            if p["solver"] == "auto" and p["budget"] == budget_label and p["status"] == "ok"
        ),
        None,
    )


def _at_compile_peaks(m: dict) -> dict:
    """Planner (auto) at each peak torch.compile reached: fits it (measured), extra FLOPs at
    most compile's + 1 % of a step, median step time at most compile's."""
    v = m["variants"]
    rows = []
    for key, c in v.items():
        if c["method"] != "compile" or c["activation_memory_budget"] not in TARGET_COMPILE_BUDGETS:
            continue
        row = _auto_row(m, f"= {key}")
        if row is None:
            rows.append(
                dict(
                    compile=key,
                    planner=None,
                    fits=False,
                    flops_met=False,
                    time_met=False,
                    met=False,
                )
            )
            continue
        p = v[row["variant"]]
        fits = p["peak_bytes"] <= c["peak_bytes"]
        flops_met = p["flops_ratio"] <= c["flops_ratio"] + 0.01
        time_met = p["time_ratio"] <= c["time_ratio"]
        rows.append(
            dict(
                compile=key,
                planner=row["variant"],
                fits=fits,
                compile_peak_ratio=c["peak_ratio"],
                planner_peak_ratio=p["peak_ratio"],
                compile_extra_flops=c["flops_ratio"] - 1,
                planner_extra_flops=p["flops_ratio"] - 1,
                compile_time_ratio=c["time_ratio"],
                planner_time_ratio=p["time_ratio"],
                # the IQRs overlap: the time comparison is within this machine's noise
                time_within_noise=p["time_ratio_q1"] <= c["time_ratio_q3"],
                flops_met=flops_met,
                time_met=time_met,
                met=fits and flops_met and time_met,
            )
        )
    return dict(
        rows=rows,
        met=all(r["met"] for r in rows),
        flops_met=all(r["fits"] and r["flops_met"] for r in rows),
    )


def evaluate_targets(models: dict) -> dict:
    """The issues' targets, per model, computed from the measurements (reported, not asserted)."""
    out = {}
    for name, m in models.items():
        v = m["variants"]
        planner_keys = [k for k, r in v.items() if r["method"] == "planner"]
        baseline_keys = [k for k, r in v.items() if r["method"] != "planner"]
        t: dict = {}
        # 1. planner at per-block's peak: extra FLOPs (and overhead) <= half of per-block's.
        row = _auto_row(m, "= per-block")
        pb = v["per-block"]
        if row:
            pl = v[row["variant"]]
            t["at_per_block_peak"] = dict(
                per_block_overhead=pb["time_ratio"] - 1,
                planner_overhead=pl["time_ratio"] - 1,
                per_block_extra_flops=pb["flops_ratio"] - 1,
                planner_extra_flops=pl["flops_ratio"] - 1,
                planner_peak_ratio=pl["peak_ratio"],
                per_block_peak_ratio=pb["peak_ratio"],
                flops_met=(pl["flops_ratio"] - 1) <= 0.5 * (pb["flops_ratio"] - 1)
                and pl["peak_bytes"] <= pb["peak_bytes"],
                met=(pl["time_ratio"] - 1) <= 0.5 * (pb["time_ratio"] - 1)
                and pl["peak_bytes"] <= pb["peak_bytes"],
            )
        # 2. at per-block's overhead: planner's activation peak >= 5x below none's.
        within = [k for k in planner_keys if v[k]["time_ratio"] <= pb["time_ratio"]]
        if within:
            best = min(within, key=lambda k: v[k]["activation_bytes"])
            act_none = v["none"]["activation_bytes"]
            t["at_per_block_overhead"] = dict(
                variant=best,
                activation_reduction=act_none / max(v[best]["activation_bytes"], 1),
                per_block_activation_reduction=act_none / max(pb["activation_bytes"], 1),
                met=act_none / max(v[best]["activation_bytes"], 1) >= 5,
            )
        # 3. no planner point dominated by a baseline point.
        dominated = []
        for k in planner_keys:
            for b in baseline_keys:
                if (
                    v[b]["peak_bytes"] < v[k]["peak_bytes"]
                    and v[b]["time_ratio"] < v[k]["time_ratio"]
                ):
                    clear = (
                        v[b]["peak_bytes"] < 0.99 * v[k]["peak_bytes"]
                        and v[b]["time_ratio_q3"] < v[k]["time_ratio_q1"]
                    )
                    dominated.append(dict(planner=k, by=b, beyond_noise=clear))
        t["dominated"] = dict(
            points=dominated,
            met=not dominated,
            met_beyond_noise=not any(d["beyond_noise"] for d in dominated),
        )
        # 4. predicted peak within 2 % of measured.
        errors = {k: v[k]["prediction_error"] for k in planner_keys}
        worst = max(errors, key=lambda k: abs(errors[k])) if errors else None
        t["prediction"] = dict(
            worst_variant=worst,
            worst_error=errors[worst] if worst else None,
            met=all(abs(e) <= 0.02 for e in errors.values()),
        )
        # 5. at every peak torch.compile reached: fits, FLOPs <= compile's + 1 %, time <= its.
        t["at_compile_peaks"] = _at_compile_peaks(m)
        # 6. planner's lowest measured peak below every baseline's.
        lowest = _auto_row(m, "lowest")
        others = min(v[b]["peak_bytes"] for b in baseline_keys)
        compiled = [v[b]["peak_bytes"] for b in baseline_keys if v[b]["method"] == "compile"]
        if lowest:
            low = v[lowest["variant"]]
            t["lowest"] = dict(
                variant=lowest["variant"],
                peak_ratio=low["peak_ratio"],
                compile_lowest_ratio=min(compiled) / v["none"]["peak_bytes"],
                baselines_lowest_ratio=others / v["none"]["peak_bytes"],
                met=low["peak_bytes"] <= others,
            )
        out[name] = t
    return out


def machine() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        load_average=load,
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="short")
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument(
        "--set",
        action="append",
        metavar="MODEL:K=V,...",
        help="override a model's configuration, e.g. mlp:depth=8,width=32",
    )
    parser.add_argument("--reps", type=int, help="timed repetitions (default: by mode)")
    parser.add_argument(
        "--solvers",
        nargs="+",
        choices=["auto", *BENCHMARKED_SOLVERS],
        help="planner solvers to run (default: auto and every registered one)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    parser.add_argument(
        "--backend",
        choices=["aot_eager", "inductor"],
        default="aot_eager",
        help="torch.compile backend of the compile baselines (inductor: CUDA only, whose "
        "allocator statistics see every buffer; the CPU tracker was checked on aot_eager only)",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="plan with the default roofline cost model, not measured node times",
    )
    parser.add_argument(
        "--unpooled",
        action="store_true",
        help="plan with each node's own measured time, not the median of the "
        "nodes doing the same work (pooled_seconds)",
    )
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/MODE.json)")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--no-page", action="store_true", help="write the JSON only")
    parser.add_argument(
        "--page-only",
        type=Path,
        metavar="JSON",
        help="re-render the page from a results JSON, measuring nothing",
    )
    opts = parser.parse_args(argv)

    if opts.page_only:
        results = json.loads(opts.page_only.read_text())
        render_page(results, opts.page, opts.img_dir)
        return results

    if opts.backend == "inductor" and (opts.device or "cpu") == "cpu":
        parser.error(
            "--backend inductor needs --device cuda: the CPU tracker's reading of inductor's "
            "kernels is unchecked (CUDA's allocator statistics see every buffer)"
        )
    torch.set_num_threads(opts.threads)
    torch._dynamo.config.recompile_limit = 64
    reps = opts.reps or MODES[opts.mode]["reps"]
    overrides = _parse_overrides(opts.set)
    command = "python benchmarks/compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    results = dict(
        command=command.strip(),
        mode=opts.mode,
        reps=reps,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=machine(),
        solvers=opts.solvers or ["auto", *BENCHMARKED_SOLVERS],
        cost_model="roofline"
        if opts.roofline
        else "measured" + ("" if opts.unpooled else ", pooled") + ", with calls",
        compile_budgets=list(MODES[opts.mode]["compile_budgets"]),
        compile_backend=opts.backend,
        models={},
    )
    out = opts.out or ROOT / "benchmarks" / "results" / f"{opts.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in opts.models:
        config = {**CONFIGS[name], **overrides.get(name, {})}
        results["models"][name] = bench_model(
            name,
            config,
            opts.mode,
            opts.device,
            reps,
            opts.roofline,
            results["solvers"],
            not opts.unpooled,
            opts.backend,
        )
        gc.collect()
        # written after every model, so that an interrupted run keeps what it measured
        results["targets"] = evaluate_targets(results["models"])
        results["seconds"] = time.perf_counter() - started
        out.write_text(json.dumps(results, indent=1))
    _log(f"wrote {out} ({results['seconds']:.0f} s)")
    if not opts.no_page:
        render_page(results, opts.page, opts.img_dir)
        _log(f"wrote {opts.page}")
    return results


if __name__ == "__main__":
    main()
