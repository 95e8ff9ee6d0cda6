"""Per-stage planning time of the Hugging Face families (tests/hf_families.py), labels on.

Capture includes one eager forward without gradients where an SDPA call has a mask (exact
attention, ``planner.attention``); the "eager record" column times that forward alone."""

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402

from hf_families import FAMILIES  # noqa: E402
from planner.attention import eager_attention_calls  # noqa: E402
from planner.capture import capture  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from planner.profile import profile  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402


def main() -> None:
    transformers.logging.set_verbosity_error()
    print(
        "| family | nodes | capture s | of which eager record s | profile s | analyse s "
        "| solve s | capture s, dynamic |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in FAMILIES:
        torch.manual_seed(0)
        model, args, kwargs = FAMILIES[name](labels=True)
        t0 = time.perf_counter()
        captured = capture(model, args, kwargs)
        t1 = time.perf_counter()
        profiled = profile(captured.graph_module, *captured.inputs(args, kwargs))
        t2 = time.perf_counter()
        problem = build_problem(captured.graph_module, profiled)
        t3 = time.perf_counter()
        budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
        t4 = time.perf_counter()
        choose(problem, budget)
        t5 = time.perf_counter()
        call_args, call_kwargs = captured.inputs(args, kwargs)
        eager_attention_calls(model, call_args, call_kwargs)
        record = time.perf_counter() - t5
        start = time.perf_counter()
        try:
            capture(model, args, kwargs, dynamic_shapes=True)
            dynamic = f"{time.perf_counter() - start:.2f}"
        except Exception as error:  # noqa: BLE001 - a failure is a result: the table says which
            dynamic = f"fails ({type(error).__name__})"
        times = " | ".join(f"{t:.2f}" for t in (t1 - t0, record, t2 - t1, t3 - t2, t5 - t4))
        print(f"| {name} | {problem.size} | {times} | {dynamic} |", flush=True)


if __name__ == "__main__":
    main()
