"""Per-stage planning time of the Hugging Face families (tests/hf_families.py), labels on."""
import sys, time, warnings
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")
import torch, transformers
transformers.logging.set_verbosity_error()
from hf_families import FAMILIES
from planner.capture import capture
from planner.profile import profile
from planner.graph import build_problem
from planner.pipeline import choose, lowest_peak
from planner.simulate import simulate
print("| family | nodes | capture s | profile s | analyse s | solve s | capture s, dynamic |")
print("|---|---|---|---|---|---|---|")
for name in FAMILIES:
    torch.manual_seed(0)
    m, a, k = FAMILIES[name](labels=True)
    t0 = time.perf_counter(); c = capture(m, a, k); t1 = time.perf_counter()
    pr = profile(c.graph_module, *c.inputs(a, k)); t2 = time.perf_counter()
    problem = build_problem(c.graph_module, pr); t3 = time.perf_counter()
    budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
    t4 = time.perf_counter(); choose(problem, budget); t5 = time.perf_counter()
    d0 = time.perf_counter()
    try:
        capture(m, a, k, dynamic_shapes=True); dyn = f"{time.perf_counter() - d0:.2f}"
    except Exception as e:
        dyn = f"fails ({type(e).__name__})"
    times = " | ".join(f"{t:.2f}" for t in (t1 - t0, t2 - t1, t3 - t2, t5 - t4))
    print(f"| {name} | {problem.size} | {times} | {dyn} |", flush=True)
