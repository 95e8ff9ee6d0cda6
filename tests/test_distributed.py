"""Planned modules under real data parallelism: 2 processes, gloo, loopback, bounded time.

Each distributed run is one spawn of 2 ranks that does several checks and saves its results;
the tests then compare them with a single-process reference computed here. Every rank trains on
its half of one global batch of a small GPT (tied weights, no dropout, a mean cross-entropy
loss), so averaging the ranks' gradients must give the gradients of the whole batch.
"""

import datetime
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import planner
from planner import zoo
from planner.options import CaptureOptions
from planner.pipeline import prepare
from planner.rewrite import rewrite
from planner.simulate import Choice
from planner.training import micro_batches

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build",
)

WORLD = 2
GLOBAL_BATCH = 8
TINY_GPT = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, dropout=0.0, with_loss=True)
TIMEOUT_S = 90  # for the whole spawn; each run takes about 10 s on 2 cores


def tiny_gpt():
    """The same model and global batch ``(idx, targets)`` in every process."""
    return zoo.gpt(**TINY_GPT, batch=GLOBAL_BATCH, seed=0)


def rank_slice(batch, rank):
    per_rank = GLOBAL_BATCH // WORLD
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def planned(model, batch, **options):
    """A plan that really checkpoints (sqrt_n under a generous budget) for one rank's batch."""
    p = planner.plan(model, rank_slice(batch, 0), budget_bytes=2**30, solver="sqrt_n", **options)
    assert p.segments, "the test needs a plan with checkpointed segments"
    return p


def reference_gradients():
    model, batch = tiny_gpt()
    model(*batch).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_after_sgd_step(lr):
    model, batch = tiny_gpt()
    model(*batch).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------
# Spawning


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on loopback too
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30)
    )


def run_ranks(worker, tmp_path, timeout_s=TIMEOUT_S):
    """Spawn ``worker(rank, port, out_dir)`` on 2 ranks; return each rank's saved results."""
    context = mp.start_processes(
        worker,
        args=(_free_port(), str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{worker.__name__} did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _grads(module):
    return {name: _full(p.grad).clone() for name, p in module.named_parameters()}


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


# ------------------------------------------------------------------------------------------
# DDP


def _ddp_worker(rank, port, out):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, port)
    results = {}

    def counting_hook(counter, bucket):
        counter["allreduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    def fresh_ddp(**options):
        model, batch = tiny_gpt()  # a fresh model each time: DDP hooks stay on parameters
        ddp = DDP(planned(model, batch).module, **options)
        counter = {"allreduces": 0}
        ddp.register_comm_hook(counter, counting_hook)
        return ddp, rank_slice(batch, rank), counter

    for name, options in {
        "default": {},
        "static_graph": {"static_graph": True},
        "find_unused_parameters": {"find_unused_parameters": True},
    }.items():
        ddp, local, counter = fresh_ddp(**options)
        ddp(*local).backward()
        results[name] = {"grads": _grads(ddp.module), "allreduces": counter["allreduces"]}

    for micro_batch in (2, 3):  # 2 + 2, and 3 + 1 (a partial last micro-batch)
        ddp, local, counter = fresh_ddp()
        for micro in micro_batches(local, micro_batch, model=ddp):
            with micro:
                micro.backward(ddp(*micro.data))
        results[f"accumulate_{micro_batch}"] = {
            "grads": _grads(ddp.module),
            "allreduces": counter["allreduces"],
        }

    ddp, local, counter = fresh_ddp()
    for micro in micro_batches(local, 2):  # no model: synchronises every time
        micro.backward(ddp(*micro.data))
    results["accumulate_without_no_sync"] = {"allreduces": counter["allreduces"]}

    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return run_ranks(_ddp_worker, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("mode", ["default", "static_graph", "find_unused_parameters"])
def test_planned_module_under_ddp_gives_the_single_process_gradients(ddp_results, mode):
    expected = reference_gradients()
    for rank_results in ddp_results:
        grads = rank_results[mode]["grads"]
        assert grads.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], msg=name)


@pytest.mark.parametrize("micro_batch", [2, 3])
def test_accumulation_under_ddp_gives_the_single_process_gradients(ddp_results, micro_batch):
    expected = reference_gradients()
    for rank_results in ddp_results:
        grads = rank_results[f"accumulate_{micro_batch}"]["grads"]
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], msg=name)


def test_accumulation_all_reduces_once_per_global_batch(ddp_results):
    for rank_results in ddp_results:
        buckets = rank_results["default"]["allreduces"]  # one step, no accumulation
        assert buckets >= 1
        assert rank_results["accumulate_2"]["allreduces"] == buckets
        assert rank_results["accumulate_3"]["allreduces"] == buckets
        # the same loop without no_sync all-reduces after each of its 2 micro-batches
        assert rank_results["accumulate_without_no_sync"]["allreduces"] == 2 * buckets


# ------------------------------------------------------------------------------------------
# FSDP2

LR = 0.1


def _fsdp2_available():
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _fsdp_worker(rank, port, out):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}

    def shard_leaves(model):
        # The planned graph calls leaf modules, so those are the ones FSDP2 can wrap (its hooks
        # on a block the graph traced through would never run). Tied weights share one group.
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and name != "lm_head":
                fully_shard(module, mesh=mesh)
        fully_shard([model.wte, model.lm_head], mesh=mesh)

    def shard_blocks(model):
        # The usual transformer recipe; the plan keeps blocks whole (leaf_modules), so the
        # planned graph calls them and their FSDP2 hooks run, in recompute too.
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard([model.wte, model.lm_head], mesh=mesh)

    for name in ("root", "leaves", "blocks"):
        model, batch = tiny_gpt()
        options = {"leaf_modules": (type(model.blocks[0]),)} if name == "blocks" else {}
        module = planned(model, batch, **options).module
        if name == "leaves":
            shard_leaves(model)
        if name == "blocks":
            shard_blocks(model)
        fully_shard(module, mesh=mesh)
        optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        module(*rank_slice(batch, rank)).backward()
        grads = _grads(module)
        optimizer.step()
        results[name] = {
            "grads": grads,
            "params": {n: _full(p).clone() for n, p in module.named_parameters()},
        }

    model, batch = tiny_gpt()
    module = planned(model, batch).module
    fully_shard(module, mesh=mesh)
    for micro in micro_batches(rank_slice(batch, rank), 3, model=module):
        with micro:
            micro.backward(module(*micro.data))
    results["accumulate"] = {"grads": _grads(module)}

    # A block kept inside a segment: the selective cache must not serve FSDP2's all-gathers
    # (found by a tester: NaN gradients after accumulating micro-batches of one).
    model, batch = tiny_gpt()
    block = type(model.blocks[0])
    options = CaptureOptions(leaf_modules=(block,))
    captured, problem = prepare(model, rank_slice(batch, 0), capture_options=options)
    first = problem.names.index("blocks_0")
    choice = Choice(((0, problem.size),), frozenset({first}))
    module = rewrite(captured.graph_module, model, choice, problem=problem)
    shard_blocks(model)
    fully_shard(module, mesh=mesh)
    for micro in micro_batches(rank_slice(batch, rank), 1, model=module):
        with micro:
            micro.backward(module(*micro.data))
    results["kept block, accumulate"] = {"grads": _grads(module)}

    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    if not _fsdp2_available():
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    return run_ranks(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("sharding", ["root", "leaves", "blocks"])
def test_planned_module_under_fsdp2_trains_a_step_like_the_reference(fsdp_results, sharding):
    expected_grads = reference_gradients()
    expected_params = reference_after_sgd_step(LR)
    for rank_results in fsdp_results:
        result = rank_results[sharding]
        assert result["params"].keys() == expected_params.keys()
        for name in expected_params:
            torch.testing.assert_close(result["grads"][name], expected_grads[name], msg=name)
            torch.testing.assert_close(result["params"][name], expected_params[name], msg=name)


@pytest.mark.parametrize("case", ["accumulate", "kept block, accumulate"])
def test_accumulation_under_fsdp2_gives_the_single_process_gradients(fsdp_results, case):
    expected = reference_gradients()
    for rank_results in fsdp_results:
        for name in expected:
            torch.testing.assert_close(rank_results[case]["grads"][name], expected[name])


# ------------------------------------------------------------------------------------------
# FSDP2 per decoder layer of a Hugging Face Llama (captured by torch.export)


def tiny_llama():
    """The same small Llama (no dropout) and global batch ``(ids,)`` in every process."""
    from torchvision_shim import define_torchvision_operators

    define_torchvision_operators()  # a spawned rank runs no conftest (torchvision installed)
    from hf_families import FAMILIES

    torch.manual_seed(0)
    model, (ids,), _ = FAMILIES["llama"](batch=GLOBAL_BATCH, length=12)
    model.config.use_cache = False  # planned for training: no key/value cache, no warning
    return model, (ids,)


def llama_reference():
    """Gradients of the unsharded, unplanned model on the whole batch, and its parameters
    after one SGD step."""
    model, (ids,) = tiny_llama()
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _llama_fsdp_worker(rank, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    model, batch = tiny_llama()
    (ids,) = rank_slice(batch, rank)
    layer = type(model.model.layers[0])
    p = planner.plan(
        model, (ids,), budget_bytes=2**30, solver="sqrt_n",
        example_kwargs={"labels": ids}, leaf_modules=layer,
    )  # fmt: skip
    for block in model.model.layers:  # the usual recipe: one FSDP2 group per decoder layer
        fully_shard(block, mesh=mesh)
    fully_shard(p.module, mesh=mesh)  # the rest (embeddings, final norm, head)
    calls = []
    for block in model.model.layers:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    optimizer = torch.optim.SGD(p.module.parameters(), lr=LR)
    p.module(ids, labels=ids).loss.backward()
    grads = _grads(p.module)
    optimizer.step()
    results = {
        "segments": p.segments,
        "capture_method": p.capture_method,
        "layer_calls": len(calls),
        "sharded": all(hasattr(b, "unshard") for b in model.model.layers),
        "grads": grads,
        "params": {n: _full(t).clone() for n, t in p.module.named_parameters()},
    }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_fsdp_results(tmp_path_factory):
    pytest.importorskip("transformers")
    if not _fsdp2_available():
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    return run_ranks(_llama_fsdp_worker, tmp_path_factory.mktemp("llama_fsdp"), timeout_s=180)


def test_an_exported_llama_planned_per_layer_trains_under_fsdp2_like_the_unsharded_model(
    llama_fsdp_results,
):
    expected_grads, expected_params = llama_reference()
    for result in llama_fsdp_results:
        assert result["capture_method"] == "export" and result["segments"]
        assert result["sharded"]
        # both layers ran in forward, and the checkpointed ones again in backward's recompute
        assert result["layer_calls"] > 2
        assert result["params"].keys() == expected_params.keys()
        for name in expected_params:
            torch.testing.assert_close(result["grads"][name], expected_grads[name], msg=name)
            torch.testing.assert_close(result["params"][name], expected_params[name], msg=name)
