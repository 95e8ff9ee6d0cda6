"""Per-stage planning time of the Hugging Face families (tests/hf_families.py), labels on, and
how each family's plan fits (the matrix of tests/test_huggingface.py, as figures).

Each family is built at the matrix's size (batch 3, length 16; ViT batch 3). Seconds are CPU
seconds of the process (``time.process_time``, steadier than wall time on a shared machine; run
it with ``OMP_NUM_THREADS=1``). ``--families gpt2 t5`` times some families only. Each family's
budget (halfway between its lowest peak and its baseline) comes from a capture of its own,
untimed, so that nothing it works out is at hand for the timed stages. Captures are timed twice
(the least is shown). "torch.export" is ``torch.export.export(...).module()`` alone, the same
call as planner's, as a user would make it: the floor PyTorch sets for capture. Capture includes
one eager forward without gradients where an SDPA call has a mask (exact attention,
``planner.attention``); the "eager record" column times that forward alone. Profile, analyse
and solve (``auto``) are timed on the static capture; "total, dynamic" adds them to the
``dynamic_shapes=True`` capture.
``--fit`` adds a second table: a plan made with ``dynamic_shapes=True`` at batch 3, length 16,
at the budget halfway between the lowest peak and the baseline; its predicted and measured peak
(CPU live-storage tracker), and the measured peak at the second shape of the tests.
``--leaf`` prints only a table of the decoder families planned with their decoder layers kept
whole (``leaf_modules``, as for FSDP2 per layer): the lowest peak against op by op, and the
predicted against the measured peak of a plan halfway between that lowest peak and the
baseline ("error bytes": predicted minus measured).
"""

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")

from torchvision_shim import define_torchvision_operators  # noqa: E402

define_torchvision_operators()  # transformers imports torchvision where it is installed

import torch  # noqa: E402
import transformers  # noqa: E402

from hf_families import FAMILIES  # noqa: E402
from planner.attention import eager_attention_calls  # noqa: E402
from planner.capture import _any_size, _without_cache, capture  # noqa: E402
from planner.options import CaptureOptions  # noqa: E402
from planner.pipeline import assemble, prepare  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from planner.profile import profile  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402
from planner.step import peak_memory  # noqa: E402

MIB = 2**20
PLANNED_SHAPE = {
    name: {"batch": 3} if name == "vit" else {"batch": 3, "length": 16} for name in FAMILIES
}


def _bare_export(model, args, kwargs, dynamic: bool):
    """``torch.export.export(...).module()`` alone, as a user would call it: the floor PyTorch
    sets for capture. The same call as planner's (``use_cache=False``, every dimension
    ``Dim.AUTO`` when dynamic), without planner's passes or settings."""
    fixed = _without_cache(model, args, kwargs)
    kwargs = {**kwargs, **fixed}
    dynamic_shapes = _any_size(model, args, kwargs) if dynamic else None
    program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    return program.module()


def _seconds(function, *args, repeat=1, **kwargs):
    """(result, least CPU seconds of this process over ``repeat`` calls): steadier than wall
    time on a shared machine."""
    least = math.inf
    for _ in range(repeat):
        start = time.process_time()
        result = function(*args, **kwargs)
        least = min(least, time.process_time() - start)
    return result, least


def stages(families) -> None:
    print(
        "| family | nodes | torch.export s | capture s | of which eager record s | profile s "
        "| analyse s | solve s | total s | torch.export s, dynamic | capture s, dynamic "
        "| total s, dynamic |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in families:
        torch.manual_seed(0)
        model, args, kwargs = FAMILIES[name](labels=True, **PLANNED_SHAPE.get(name, {}))
        # The budget from a capture of its own: what it works out is not there for the timed one.
        _, problem = prepare(model, args, kwargs)
        budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
        _, export = _seconds(_bare_export, model, args, kwargs, dynamic=False, repeat=2)
        captured, capture_s = _seconds(capture, model, args, kwargs, repeat=2)
        call_args, call_kwargs = captured.inputs(args, kwargs)
        profiled, profile_s = _seconds(profile, captured.graph_module, call_args, call_kwargs)
        problem, analyse_s = _seconds(build_problem, captured.graph_module, profiled)
        _, solve_s = _seconds(choose, problem, budget)
        _, record = _seconds(eager_attention_calls, model, call_args, call_kwargs)
        total = capture_s + profile_s + analyse_s + solve_s
        try:
            _, export_dynamic = _seconds(_bare_export, model, args, kwargs, dynamic=True, repeat=2)
            _, dynamic = _seconds(capture, model, args, kwargs, dynamic_shapes=True, repeat=2)
            dynamic_columns = (
                f"{export_dynamic:.2f} | {dynamic:.2f} | "
                f"{dynamic + profile_s + analyse_s + solve_s:.2f}"
            )
        except Exception as error:  # noqa: BLE001 - a failure is a result: the table says which
            dynamic_columns = f"fails ({type(error).__name__}) | | "
        times = " | ".join(
            f"{t:.2f}" for t in (export, capture_s, record, profile_s, analyse_s, solve_s, total)
        )
        print(f"| {name} | {problem.size} | {times} | {dynamic_columns} |", flush=True)


def second_shape(name):
    """The second shape of tests/test_huggingface.py (labels on)."""
    if name == "vit":
        return {"batch": 2}
    return {"batch": 3 if name == "clip" else 2, "length": 11}


def fit() -> None:
    print(
        "| family | segments | budget MiB | predicted MiB | measured MiB | error "
        "| second shape | measured MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in FAMILIES:
        torch.manual_seed(0)
        planned = {"batch": 3} if name == "vit" else {"batch": 3, "length": 16}
        model, args, kwargs = FAMILIES[name](labels=True, **planned)
        dynamic = CaptureOptions(dynamic_shapes=True)
        captured, problem = prepare(model, args, kwargs, capture_options=dynamic)
        budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
        solver, segments = choose(problem, budget)
        p = assemble(
            model, captured, problem, segments, solver=solver, budget_bytes=budget,
            solve_seconds=0.0, started=0.0,
        )  # fmt: skip
        measured = peak_memory(p.module, args, kwargs).peak_bytes
        error = (p.predicted_peak_bytes - measured) / measured
        shape = second_shape(name)
        _, other_args, other_kwargs = FAMILIES[name](labels=True, **shape)
        other = peak_memory(p.module, other_args, other_kwargs).peak_bytes
        sizes = "x".join(str(v) for v in shape.values())
        print(
            f"| {name} | {len(p.segments)} | {budget / MIB:.2f} | "
            f"{p.predicted_peak_bytes / MIB:.2f} | {measured / MIB:.2f} | {error:+.2%} | "
            f"{sizes} | {other / MIB:.2f} |",
            flush=True,
        )


def leaf() -> None:
    """Decoder layers kept whole (``leaf_modules``, as for FSDP2 per layer) against op by op."""
    print(
        "| family | lowest peak MiB, op by op | lowest peak MiB, layers whole | segments "
        "| budget MiB | predicted MiB | measured MiB | error | error bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in FAMILIES:
        torch.manual_seed(0)
        model, args, kwargs = FAMILIES[name](labels=True)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            continue
        _, problem = prepare(model, args, kwargs)
        lowest = lowest_peak(problem).peak_bytes
        whole = CaptureOptions(leaf_modules=type(layers[0]))
        captured, problem = prepare(model, args, kwargs, capture_options=whole)
        low, high = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
        budget = (low + high) // 2
        solver, segments = choose(problem, budget)
        p = assemble(
            model, captured, problem, segments, solver=solver, budget_bytes=budget,
            solve_seconds=0.0, started=0.0, capture_options=whole,
        )  # fmt: skip
        measured = peak_memory(p.module, args, kwargs).peak_bytes
        error = (p.predicted_peak_bytes - measured) / measured
        print(
            f"| {name} | {lowest / MIB:.3f} | {low / MIB:.3f} | {len(p.segments)} | "
            f"{budget / MIB:.3f} | {p.predicted_peak_bytes / MIB:.3f} | {measured / MIB:.3f} "
            f"| {error:+.2%} | {p.predicted_peak_bytes - measured:+d} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="also the table of plans' fit")
    parser.add_argument(
        "--leaf", action="store_true", help="only the table of plans with decoder layers whole"
    )
    parser.add_argument(
        "--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), metavar="NAME"
    )
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if options.leaf:
        leaf()
        return
    stages(options.families)
    if options.fit:
        print()
        fit()


if __name__ == "__main__":
    main()
