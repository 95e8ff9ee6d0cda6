"""Saved plans: JSON round trip, fingerprint checks, no re-solving."""

import dataclasses
import json
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_leaves

import planner
from planner import serialize
from planner.errors import PlanningError


def small_gpt(**overrides):
    config = dict(layers=2, d_model=64, seq=32, batch=2, vocab=128)
    config.update(overrides)
    return planner.zoo.gpt(**config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, inputs = small_gpt()
    base = planner.plan(model, inputs, budget_gb=1)
    lowest = planner.solvers.auto.lowest_peak(base.problem).peak_bytes
    plan = planner.plan(model, inputs, budget_bytes=(lowest + base.baseline_peak_bytes) // 2)
    assert plan.segments
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    serialize.save(plan, path, inputs)
    return plan, path, inputs


def test_file_is_plain_json_with_what_it_promises(saved):
    plan, path, _ = saved
    data = json.loads(path.read_text())
    assert data["format"] == "planner.plan" and data["version"] == serialize.FORMAT_VERSION
    assert data["solver"] == plan.solver
    assert data["budget_bytes"] == plan.budget_bytes
    assert data["predictions"]["peak_bytes"] == plan.predicted_peak_bytes
    assert data["predictions"]["baseline_peak_bytes"] == plan.baseline_peak_bytes
    assert [(s["start"], s["stop"]) for s in data["segments"]] == list(plan.segments)
    names = plan.problem.names
    assert [(s["first"], s["last"]) for s in data["segments"]] == [
        (names[a], names[b - 1]) for a, b in plan.segments
    ]
    assert data["graph"]["fingerprint"] == serialize.fingerprint(plan)
    assert data["graph"]["nodes"] == plan.problem.size
    assert data["inputs"]["args"][0] == {
        "kind": "tensor", "shape": [2, 32], "dtype": "int64", "requires_grad": False,
    }  # fmt: skip


def test_file_names_the_planner_version_that_wrote_it(saved):
    _, path, _ = saved
    assert json.loads(path.read_text())["planner_version"] == planner.__version__


def test_round_trip_gives_the_same_plan_without_solving(saved, monkeypatch):
    plan, path, inputs = saved
    model, _ = small_gpt(seed=3)  # same architecture, other weights

    def no_solving(*args, **kwargs):
        raise AssertionError("load must not solve")

    for name in list(planner.solvers.SOLVERS):
        monkeypatch.setitem(planner.solvers.SOLVERS, name, no_solving)
    loaded = planner.load(path, model)
    assert loaded.segments == plan.segments
    assert loaded.solver == plan.solver and loaded.budget_bytes == plan.budget_bytes
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.baseline_peak_bytes == plan.baseline_peak_bytes
    assert loaded.predicted_overhead == pytest.approx(plan.predicted_overhead)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)

    # The loaded module is the model's, checkpointed: same loss and gradients.
    torch.manual_seed(0)
    model(*inputs).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loaded.module(*inputs).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert "checkpoint" in loaded.module.code


def test_load_with_explicit_inputs(saved):
    plan, path, inputs = saved
    model, _ = small_gpt()
    assert planner.load(path, model, inputs).segments == plan.segments


@pytest.mark.parametrize(
    "other, expected",
    [
        (lambda: small_gpt(layers=3), r"another graph .* first difference at node \d+"),
        (lambda: small_gpt(d_model=32), r"first difference at node \d+"),
        (lambda: planner.zoo.mlp_chain(depth=3), r"this Sequential captures to"),
    ],
)
def test_load_into_another_model_is_a_clear_error(saved, other, expected):
    _, path, _ = saved
    model, inputs = other()
    with pytest.raises(PlanningError, match=expected):
        planner.load(path, model, inputs)


def test_load_with_other_input_shapes_is_an_error(saved):
    _, path, _ = saved
    model, inputs = small_gpt(batch=3)
    with pytest.raises(PlanningError, match="input shapes it was made for"):
        planner.load(path, model, inputs)


def test_load_into_the_model_in_another_dtype_says_the_sizes_differ(saved):
    """Found trying the library: after ``model.double()`` the message named a node and two byte
    counts, not why they differ."""
    _, path, inputs = saved
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match=r"same operation on tensors of other shapes or dtype"):
        planner.load(path, model.double(), inputs)


def test_load_into_the_model_with_a_parameter_no_node_reads_names_the_bytes(saved):
    """Found trying the library: an unused EMA head added to the same architecture was refused
    with "differ in FLOPs, bytes moved or parameters", naming nothing."""
    _, path, inputs = saved
    model, _ = small_gpt()
    model.ema = nn.Linear(64, 64)
    with pytest.raises(PlanningError, match=r"the nodes match, but the model's parameters.*EMA"):
        planner.load(path, model, inputs)


def test_load_into_the_model_in_another_dtype_without_inputs_says_they_were_recorded(tmp_path):
    """Found trying the library: the inputs made from the file's record were float32, and the
    error told the user to check example inputs they had not given."""
    model, inputs = planner.zoo.mlp_chain(depth=3)
    path = planner.plan(model, inputs, budget_gb=1).save(tmp_path / "mlp.json", inputs)
    with pytest.raises(PlanningError, match=r"inputs were made from the shapes and dtypes"):
        planner.load(path, model.double())


def test_plan_saved_without_inputs_needs_them(saved, tmp_path):
    plan, _, inputs = saved
    path = serialize.save(plan, tmp_path / "bare.json")
    model, _ = small_gpt()
    if getattr(plan, "input_spec", None) is None:
        with pytest.raises(PlanningError, match="pass them"):
            planner.load(path, model)
    assert planner.load(path, model, inputs).segments == plan.segments


@pytest.mark.parametrize(
    "content, expected",
    [
        ("not json", "not JSON"),
        ('{"hello": 1}', "not a saved plan"),
        ('{"format": "planner.plan", "version": 99}', "version 99"),
        ('{"format": "planner.plan", "version": 1}', "no 'segments' field"),
        # Found by a tester: versions no planner writes loaded.
        ('{"format": "planner.plan", "version": 0}', "version 0, which no planner writes"),
        ('{"format": "planner.plan", "version": -3}', "version -3, which no planner writes"),
        ('{"format": "planner.plan", "version": true}', "version True, which no planner"),
    ],
)
def test_bad_files(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    model, inputs = small_gpt()
    with pytest.raises(PlanningError, match=expected):
        planner.load(path, model, inputs)


def test_missing_file(tmp_path):
    model, inputs = small_gpt()
    with pytest.raises(PlanningError, match="no saved plan"):
        planner.load(tmp_path / "nothing.json", model, inputs)


def test_edited_segment_names_are_caught(saved, tmp_path):
    _, path, inputs = saved
    data = json.loads(path.read_text())
    data["segments"][0]["first"] = "somewhere_else"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match="does not name the nodes"):
        planner.load(edited, model, inputs)


def test_an_edited_solver_that_is_no_name_is_caught(saved, tmp_path):
    _, path, inputs = saved
    data = json.loads(path.read_text())
    data["solver"] = 12
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match=r"solver 12 .* is not a name"):
        planner.load(edited, model, inputs)


@pytest.mark.parametrize("budget", [-5, 0, "1e9", 1.5e9])
def test_an_edited_budget_that_is_no_positive_integer_is_caught(saved, tmp_path, budget):
    """Found trying the library: ``budget_bytes: -5`` loaded as a plan over its budget."""
    _, path, inputs = saved
    data = json.loads(path.read_text())
    data["budget_bytes"] = budget
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match=r"budget_bytes .* is not a positive integer"):
        planner.load(edited, model, inputs)


def _set(data: dict, path: str, value) -> None:
    """``data`` with the field at ``path`` ("inputs.args.0.dtype") set to ``value``."""
    *parents, last = path.split(".")
    for key in parents:
        data = data[int(key)] if isinstance(data, list) else data[key]
    data[int(last) if isinstance(data, list) else last] = value


@pytest.mark.parametrize(
    "field, value",
    [
        ("segments.0", [12, 24]),
        ("segments.0.start", "twelve"),
        ("inputs.args.0.dtype", "nonsense"),
        ("inputs.args.0.dtype", "manual_seed"),
        ("inputs.args.0.shape", "4x64"),
        ("inputs.args", {"0": 1}),
        ("capture", ["train"]),
        ("optimizer_state_bytes", "none"),
        ("graph", 7),
        ("timings", []),
    ],
)
def test_a_malformed_field_is_a_clear_error(saved, tmp_path, field, value):
    """Found trying the library: fields of the wrong type gave raw ``AttributeError`` and
    ``TypeError`` from deep inside ``load``."""
    _, path, _ = saved
    data = json.loads(path.read_text())
    _set(data, field, value)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match=r"not a well-formed saved plan.*edited or corrupted"):
        planner.load(edited, model)


def test_a_loaded_plan_over_the_budget_it_was_saved_with_warns(saved, tmp_path):
    """A plan loads as saved, but one whose peak no longer fits the budget it records (a model
    changed where the fingerprint does not look, found by a tester: a skip connection taken
    from another layer; an edited file, or a profile that changed with torch) says so and to
    plan again."""
    plan, path, inputs = saved
    data = json.loads(path.read_text())
    data["budget_bytes"] = plan.predicted_peak_bytes - 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    over = r"now predicts a peak of .* over the budget.*model changed since.*plan again"
    with pytest.warns(UserWarning, match=over):
        loaded = planner.load(edited, model, inputs)
    assert loaded.segments == plan.segments
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner.load(path, model, inputs)  # as saved: it fits


def test_fingerprint_depends_on_shapes_not_weights():
    _, first = planner.pipeline.prepare(*small_gpt(seed=0))
    _, second = planner.pipeline.prepare(*small_gpt(seed=1))
    _, wider = planner.pipeline.prepare(*small_gpt(batch=4))
    assert serialize.fingerprint(first) == serialize.fingerprint(second)
    assert serialize.fingerprint(first) != serialize.fingerprint(wider)
    assert serialize.fingerprint(first).startswith("sha256:")


# --------------------------------------------------------------------------------------------
# What the file records, so that load captures the model as plan did


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TwoInputs(torch.nn.Module):
    """``model(ids, labels=ids)``: the Hugging Face pattern of one tensor given twice."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Pair(), Pair()

    def forward(self, x, y=None, pair=()):
        h = self.second(self.first(x))
        for extra in pair:
            h = h + extra
        return (h * y).sum()


def _aliased_inputs(case):
    x = torch.randn(4, 8)
    wide = torch.randn(4, 24)  # two views of it, and 8 columns no input reads
    return {
        "same tensor as arg and kwarg": ((x,), {"y": x}),
        "same tensor three times": ((x,), {"y": x, "pair": [x]}),
        "views of one storage": ((wide[:, :8],), {"y": wide[:, 8:16]}),
        "an expanded view": ((x,), {"y": torch.randn(1, 8).expand(4, 8)}),
        "a slice of a larger tensor": ((torch.randn(6, 8)[1:5],), {"y": x}),
        "needs grad and aliased": ((x.requires_grad_(),), {"y": x, "pair": (x, x.detach()[1])}),
    }[case]


@pytest.mark.parametrize("case", [
    "same tensor as arg and kwarg", "same tensor three times", "views of one storage",
    "an expanded view", "a slice of a larger tensor", "needs grad and aliased",
])  # fmt: skip
def test_aliased_example_inputs_survive_save_and_load(case, tmp_path):
    """Regression: a tensor given twice was counted once by plan and twice by load."""
    model = TwoInputs()
    args, kwargs = _aliased_inputs(case)
    plan = planner.plan(model, args, example_kwargs=kwargs, budget_gb=1, solver="sqrt_n")
    loaded = planner.load(plan.save(tmp_path / "plan.json"), model)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)
    assert loaded.segments == plan.segments
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes


class Clipped(torch.nn.Module):
    """Takes a limit (``inf``: none, a common default) and a dtype to compute in."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Pair(), Pair()

    def forward(self, x, clip=float("inf"), dtype=torch.float32):
        return self.second(self.first(x.to(dtype)).clamp(max=clip)).sum()


@pytest.mark.parametrize("clip", [float("inf"), float("-inf"), 0.5])
def test_infinite_limits_and_dtypes_among_the_arguments_survive_save_and_load(clip, tmp_path):
    """Found by a tester: ``clip=float("inf")`` made ``save`` raise a bare ValueError (JSON
    has no inf), and a dtype argument saved the plan without its inputs, unsaid."""
    model, x = Clipped(), torch.randn(4, 8)
    kwargs = {"clip": clip, "dtype": torch.float32}
    plan = planner.plan(model, (x,), example_kwargs=kwargs, budget_gb=1, solver="sqrt_n")
    loaded = planner.load(plan.save(tmp_path / "plan.json"), model)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)
    assert loaded.segments == plan.segments


def test_aliasing_is_recorded_only_where_there_is_some():
    x = torch.randn(4, 8)
    spec = serialize.input_spec((x,), {"y": x, "z": torch.randn(2)})
    assert spec["kwargs"]["y"] == {"kind": "same", "as": ["args", 0]}
    assert "storage" not in spec["args"][0] and "storage" not in spec["kwargs"]["z"]


@st.composite
def aliased_arguments(draw):
    """Up to five tensor arguments, each fresh, a tensor given before, or a view (slice,
    transpose, expand) of one, placed at random among args, kwargs and nested lists."""
    tensors = []
    for _ in range(draw(st.integers(1, 5))):
        how = draw(
            st.sampled_from(["fresh", "same", "slice", "transpose", "expand"])
            if tensors
            else st.just("fresh")
        )
        if how == "fresh":
            tensors.append(torch.randn(draw(st.integers(1, 4)), draw(st.integers(1, 4))))
            continue
        source = draw(st.sampled_from(tensors))
        if how == "same":
            tensors.append(source)
        elif how == "slice":
            tensors.append(source[draw(st.integers(0, source.shape[0] - 1)) :])
        elif how == "transpose":
            tensors.append(source.t())
        else:
            tensors.append(source[:1].expand(3, *source.shape[1:]))
    where = [draw(st.sampled_from(["arg", "kwarg", "nested"])) for _ in tensors]
    args = tuple(t for t, w in zip(tensors, where) if w == "arg")
    kwargs = {f"k{i}": t for i, (t, w) in enumerate(zip(tensors, where)) if w == "kwarg"}
    kwargs["nested"] = [[t] for t, w in zip(tensors, where) if w == "nested"]
    return args, kwargs


def _layout(args, kwargs):
    """Each tensor's shape, stride, offset and storage size, and which tensors are the same
    object or share a storage (as indices of first occurrence)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    same = [next(j for j, u in enumerate(tensors) if u is t) for t in tensors]
    keys = [t.untyped_storage()._cdata for t in tensors]
    shared = [keys.index(k) for k in keys]
    return same, shared, [(tuple(t.shape), t.stride(), t.storage_offset(),
                           t.untyped_storage().nbytes()) for t in tensors]  # fmt: skip


@given(aliased_arguments())
def test_rebuilt_inputs_alias_as_the_originals_did(arguments):
    args, kwargs = arguments
    spec = json.loads(json.dumps(serialize.input_spec(args, kwargs)))
    rebuilt = serialize.build_inputs(spec, torch.device("cpu"))
    assert _layout(*rebuilt) == _layout(args, kwargs)


def _without_capture_record(path):
    """The file as format version 1 wrote it: no "capture" field."""
    data = json.loads(path.read_text())
    del data["capture"]
    data["version"] = 1
    path.write_text(json.dumps(data))
    return path


def test_a_plan_made_with_leaf_modules_loads(tmp_path):
    """Regression: load captured the blocks inlined and refused the plan as another graph."""
    model, inputs = small_gpt()
    block = type(model.blocks[0])
    plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n", leaf_modules=(block,))
    path = plan.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["capture"]["leaf_modules"] == [
        f"{block.__module__}.{block.__qualname__}"
    ]
    loaded = planner.load(path, model)
    assert loaded.segments == plan.segments and loaded.capture_options.leaf_modules == (block,)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)

    old = _without_capture_record(path)  # a version 1 file: leaf_modules must be given
    with pytest.raises(PlanningError, match=r"pass the same to planner\.load"):
        planner.load(old, model)
    assert planner.load(old, model, leaf_modules=(block,)).segments == plan.segments


def test_a_recorded_leaf_class_the_model_lacks_is_named_when_the_graph_differs(tmp_path):
    """A class renamed or moved since saving: its blocks are traced through, so the graph
    differs, and the message says which recorded name matched nothing."""
    model, inputs = small_gpt()
    block = type(model.blocks[0])
    path = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n", leaf_modules=(block,)).save(
        tmp_path / "plan.json"
    )
    data = json.loads(path.read_text())
    data["capture"]["leaf_modules"] = ["somewhere.else.RenamedBlock"]
    path.write_text(json.dumps(data))
    with pytest.raises(
        PlanningError, match=r"leaf_modules somewhere\.else\.RenamedBlock, which no"
    ):
        planner.load(path, model)


def test_frontier_takes_leaf_modules():
    model, inputs = small_gpt()
    block = type(model.blocks[0])
    whole = planner.frontier(model, inputs, points=2, leaf_modules=(block,))
    _, problem = planner.pipeline.prepare(
        model, inputs, capture_options=planner.CaptureOptions(leaf_modules=(block,))
    )
    assert whole.lowest_peak_bytes == planner.solvers.auto.lowest_peak(problem).peak_bytes
    inlined = planner.frontier(model, inputs, points=2)
    assert whole.lowest_peak_bytes > inlined.lowest_peak_bytes  # blocks cannot be cut inside


GRAPH_OPTIONS = {
    "keyword tensor": lambda model, x: dict(example_kwargs={"y": torch.randn(4, 8)}),
    "aliased keyword": lambda model, x: dict(example_kwargs={"y": x}),
    "non-tensor keyword": lambda model, x: dict(example_kwargs={"y": 2.0}),
    "nested keyword": lambda model, x: dict(example_kwargs={"y": 1.0, "pair": [x, x * 2]}),
    "leaf_modules": lambda model, x: dict(example_kwargs={"y": 1.0}, leaf_modules=(Pair,)),
    "optimizer state": lambda model, x: dict(example_kwargs={"y": 1.0}, optimizer_state_bytes=1000),
}


@pytest.mark.parametrize("option", sorted(GRAPH_OPTIONS))
def test_every_option_that_changes_the_graph_survives_save_and_load(option, tmp_path):
    """``load(path, model)`` alone, without repeating any option, gives the same plan."""
    model, x = TwoInputs(), torch.randn(4, 8)
    options = GRAPH_OPTIONS[option](model, x)
    plan = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n", **options)
    loaded = planner.load(plan.save(tmp_path / "plan.json"), model)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)
    assert loaded.segments == plan.segments
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.capture_options == plan.capture_options


def test_eval_mode_is_recorded_and_a_mismatch_says_what_to_do(tmp_path):
    """Regression: loading onto an eval-mode model said "made for another graph"."""
    model, inputs = small_gpt()
    path = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n").save(tmp_path / "p.json")
    model.eval()
    with pytest.raises(
        PlanningError,
        match=r"in train mode, and this GPTWithLoss is in eval "
        r"mode: call model.train\(\)",
    ):
        planner.load(path, model)
    assert not model.training  # untouched
    with pytest.raises(PlanningError, match=r"model is in eval mode; .* call model.train\(\)"):
        with pytest.warns(UserWarning, match="eval mode"):  # prepare's, as for plan
            planner.load(_without_capture_record(path), model)
    model.train()
    assert planner.load(path, model).training


def test_a_plan_made_in_eval_mode_loads_in_eval_mode(tmp_path):
    model, inputs = small_gpt()
    model.eval()
    with pytest.warns(UserWarning, match="eval mode"):
        plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
    path = plan.save(tmp_path / "p.json")
    with pytest.warns(UserWarning, match="eval mode"):
        assert planner.load(path, model).segments == plan.segments
    model.train()
    with pytest.raises(PlanningError, match=r"call model.eval\(\)"):
        planner.load(path, model)


def test_a_plan_made_under_autocast_loaded_outside_it_says_so(tmp_path):
    """Found by a tester: loaded without the autocast it was made under, a plan was refused as
    made for tensors of other shapes or dtype, autocast unsaid."""
    model, inputs = small_gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
        path = plan.save(tmp_path / "plan.json")
        assert planner.load(path, model).segments == plan.segments  # where it runs: loads
    made = r"made under torch\.autocast\('cpu', dtype=torch\.bfloat16\)"
    with pytest.raises(PlanningError, match=made):
        planner.load(path, model)


def test_save_with_inputs_other_than_the_plans_is_refused(saved, tmp_path):
    """Found by a tester: a later batch given to ``save`` wrote a file that ``load`` then
    refused on the very same model, as made for another graph."""
    plan, _, _ = saved
    _, other = small_gpt(batch=4)
    with pytest.raises(ValueError, match="differ from those the plan was made with"):
        plan.save(tmp_path / "plan.json", other)
    assert not (tmp_path / "plan.json").exists()


def test_save_to_a_directory_or_a_missing_folder_is_a_clear_error(saved, tmp_path):
    plan, _, _ = saved
    with pytest.raises(ValueError, match="is a directory; save the plan to a file in it"):
        plan.save(tmp_path)
    with pytest.raises(ValueError, match="there is no directory"):
        plan.save(tmp_path / "missing" / "plan.json")
    assert list(tmp_path.iterdir()) == []


def _keep_every_keepable(plan):
    """A solver that returns ``plan``'s segments, keeping every node they allow."""
    from planner.simulate import Choice, last_recomputed

    def solve(problem, budget_bytes, **options):
        keep = {
            k
            for start, stop in plan.segments
            for k in range(start, last_recomputed(problem, start, stop))
            if problem.keepable[k] and not problem.random[k]
        }
        return Choice(plan.segments, frozenset(keep))

    return solve


def test_kept_nodes_round_trip_by_position_and_name(saved, tmp_path):
    plan, _, inputs = saved
    model, _ = small_gpt()
    selective = planner.plan(model, inputs, budget_gb=1, solver=_keep_every_keepable(plan))
    assert selective.keep
    path = serialize.save(selective, tmp_path / "selective.json")
    data = json.loads(path.read_text())
    assert data["keep"] == [
        {"position": k, "name": selective.problem.names[k]} for k in sorted(selective.keep)
    ]
    loaded = planner.load(path, small_gpt(seed=3)[0])
    assert (loaded.segments, loaded.keep) == (selective.segments, selective.keep)
    assert loaded.predicted_peak_bytes == selective.predicted_peak_bytes


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_file_loads_as_a_plan_that_keeps_nothing(saved, tmp_path, version):
    plan, path, _ = saved
    data = json.loads(path.read_text())
    data["version"] = version
    del data["keep"]
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(data))
    loaded = planner.load(old, small_gpt(seed=3)[0])
    assert loaded.segments == plan.segments and loaded.keep == frozenset()


def test_a_kept_node_that_does_not_match_the_graph_is_refused(saved, tmp_path):
    plan, path, _ = saved
    data = json.loads(path.read_text())
    start = plan.segments[0][0]
    data["keep"] = [{"position": start, "name": "not_a_node"}]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match=r"kept node .* does not name the node"):
        planner.load(edited, small_gpt(seed=3)[0])


CAPTURE_OPTIONS = {
    "leaf_modules": lambda model: planner.CaptureOptions(leaf_modules=(type(model.blocks[0]),)),
    "dynamic_shapes": lambda model: planner.CaptureOptions(dynamic_shapes=True),
}
CAPTURE_MODELS = {
    "leaf_modules": lambda: small_gpt(),
    "dynamic_shapes": lambda: planner.zoo.untraceable_mlp(),  # captured by torch.export
}


def test_every_capture_option_has_a_save_and_load_test():
    assert {f.name for f in dataclasses.fields(planner.CaptureOptions)} == set(CAPTURE_OPTIONS)


@pytest.mark.parametrize("option", sorted(CAPTURE_OPTIONS))
def test_every_capture_option_changes_the_graph_and_survives_save_and_load(option, tmp_path):
    model, inputs = CAPTURE_MODELS[option]()
    options = CAPTURE_OPTIONS[option](model)
    plain = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
    plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n", **dataclasses.asdict(options))
    assert serialize.fingerprint(plan) != serialize.fingerprint(plain)  # the option matters
    assert plan.capture_options == options
    loaded = planner.load(plan.save(tmp_path / "plan.json"), model)  # no option repeated
    assert loaded.capture_options == options
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)
    assert loaded.segments == plan.segments


def test_a_file_from_before_dynamic_shapes_was_recorded_loads(saved, tmp_path):
    plan, path, _ = saved
    data = json.loads(path.read_text())
    del data["capture"]["dynamic_shapes"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    loaded = planner.load(old, small_gpt(seed=3)[0])
    assert loaded.segments == plan.segments
    assert loaded.capture_options == planner.CaptureOptions()
