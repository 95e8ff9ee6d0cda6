"""The saved plan's file format: plans as JSON, without pickle (``planner.restore`` loads them).

A saved plan is a small JSON document (format ``"planner.plan"``, ``"version": 4``)::

    {
      "format": "planner.plan", "version": 4,
      "planner_version": "0.1.0", "torch_version": "2.13.0", "model": "GPTWithLoss",
      "solver": "auto:greedy", "capture_method": "symbolic_trace",
      "capture": {"training": true, "leaf_modules": ["planner.zoo.transformers._GPTBlock"],
                  "dynamic_shapes": false},
      "budget_bytes": 12582912, "optimizer_state_bytes": 0,
      "segments": [{"start": 12, "stop": 24, "first": "blocks_0_attn_qkv", "last": "softmax"}],
      "keep": [{"position": 12, "name": "blocks_0_attn_qkv"}],
      "predictions": {"peak_bytes": ..., "baseline_peak_bytes": ..., "overhead": 0.12,
                      "recompute_flops": ..., "fixed_bytes": ...},
      "timings": {"solve_seconds": 0.02, "planning_seconds": 1.4},
      "inputs": {"args": [{"kind": "tensor", "shape": [4, 64], "dtype": "int64",
                           "requires_grad": false}],
                 "kwargs": {"labels": {"kind": "same", "as": ["args", 0]}}},
      "graph": {"fingerprint": "sha256:...", "nodes": 161,
                "signature": [["size", ".size()", 0], ...]}
    }

Segments are half-open ``(start, stop)`` positions over the captured graph's compute nodes, and
also the names of their first and last nodes; ``keep`` lists the nodes kept inside segments
(selective checkpointing) by position and name; files of versions 1 and 2 (no ``keep``) still
load, as plans that keep nothing. A segment holding nested segments (``planner.nested``) lists
them under ``"inner"``, in the same form (version 4). The fingerprint hashes, for every compute
node in order, its name, its operation (``call_module`` target, method or function) and the
sizes the profile derived from its tensor shapes (bytes created, bytes moved, FLOPs), plus the
fixed and parameter bytes. ``capture`` records what else decides the captured graph: the model's
mode (train or eval) and the ``CaptureOptions``: ``leaf_modules`` (qualified class names) and
``dynamic_shapes`` (absent in older files: false). ``inputs`` records how the example inputs
alias: a tensor given again is ``"same"`` as its first occurrence, and a tensor that shares its
storage with another input, or does not fill its own (a slice, an expanded view), also records
``storage`` (a number shared by the tensors of one storage), ``storage_bytes``, ``offset`` and
``stride``. Version 1 files (no ``capture``, no aliasing) still load."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from planner.errors import PlanningError
from planner.version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "build_inputs",
    "fingerprint",
    "input_spec",
    "model_name",
    "qualified_name",
    "read",
    "save",
    "to_dict",
]

FORMAT = "planner.plan"
FORMAT_VERSION = 4  # 2 adds "capture" and input aliasing; 3 "keep", the nodes kept inside
# segments; 4 "inner", the segments nested in a segment; files of earlier versions still load


# --------------------------------------------------------------------------------------------
# Fingerprint


def _problem(plan_or_problem):
    return getattr(plan_or_problem, "problem", plan_or_problem)


def graph_signature(plan_or_problem) -> list[list]:
    """``[name, operation, bytes created]`` per compute node in order: the readable part of the
    fingerprint, used to say where two graphs differ."""
    problem = _problem(plan_or_problem)
    return [
        [name, label, int(created)]
        for name, label, created in zip(problem.names, problem.labels, problem.created_bytes)
    ]


def fingerprint(plan_or_problem) -> str:
    """A hash of the captured graph: ``"sha256:<hex>"``.

    Covers, for each compute node in order, its name, operation and the shape-derived sizes the
    profile measured (bytes created, bytes moved, FLOPs, whether autograd saves anything, whether
    a cut may follow it), and the model's fixed and parameter bytes. Two captures of the same
    model with inputs of the same shapes give the same fingerprint; another architecture, another
    width or another batch size do not. The cost model and the solver do not enter it.

    Parameters
    ----------
    plan_or_problem : planner.Plan or planner.Problem
    """
    problem = _problem(plan_or_problem)
    digest = hashlib.sha256()
    header = [
        problem.size,
        int(problem.fixed_bytes - problem.optimizer_state_bytes),
        int(problem.parameter_bytes),
        int(problem.gradient_bytes),
    ]
    digest.update(json.dumps(header).encode())
    for i in range(problem.size):
        row = [
            problem.names[i],
            problem.labels[i],
            int(problem.created_bytes[i]),
            int(problem.bytes_moved[i]),
            int(problem.flops[i]),
            bool(problem.saves[i]),
            bool(problem.cut_allowed[i]),
        ]
        digest.update(json.dumps(row).encode())
    return "sha256:" + digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Example inputs


def _storage_key(tensor: torch.Tensor) -> int:
    if tensor.layout is not torch.strided:
        raise TypeError(f"a {tensor.layout} tensor")
    return tensor.untyped_storage()._cdata


class _Describer:
    """Describes example inputs as JSON, aliasing included: a tensor given again is ``"same"``
    as its first occurrence (``labels=ids``), and tensors that share a storage with another
    input, or do not fill their own, record the storage and their place in it."""

    def __init__(self, tensors: list[torch.Tensor]):
        owners: dict[int, set[int]] = {}
        for t in tensors:
            owners.setdefault(_storage_key(t), set()).add(id(t))
        self.shared = {key for key, ids in owners.items() if len(ids) > 1}
        self.first_path: dict[int, list] = {}  # id(tensor) -> path of its first occurrence
        self.storages: dict[int, int] = {}  # storage key -> its number in the file

    def spec(self, value, path: list):
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, float) and not math.isfinite(value):  # JSON has no inf (clip=inf)
            return {"kind": "float", "value": repr(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"kind": "value", "value": value}
        if isinstance(value, torch.dtype):
            return {"kind": "dtype", "value": str(value).removeprefix("torch.")}
        if isinstance(value, (list, tuple)):
            items = [self.spec(v, [*path, i]) for i, v in enumerate(value)]
            return {"kind": type(value).__name__, "items": items}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {
                "kind": "dict",
                "items": {k: self.spec(v, [*path, k]) for k, v in value.items()},
            }
        raise TypeError(type(value).__name__)

    def _tensor(self, tensor: torch.Tensor, path: list) -> dict:
        if id(tensor) in self.first_path:
            return {"kind": "same", "as": self.first_path[id(tensor)]}
        self.first_path[id(tensor)] = path
        spec = {
            "kind": "tensor",
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "requires_grad": bool(tensor.requires_grad),
        }
        key = _storage_key(tensor)
        storage_bytes = tensor.untyped_storage().nbytes()
        owns_storage = (
            tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and storage_bytes == tensor.numel() * tensor.element_size()
        )
        if key in self.shared or not owns_storage:
            spec |= {
                "storage": self.storages.setdefault(key, len(self.storages)),
                "storage_bytes": storage_bytes,
                "offset": tensor.storage_offset(),
                "stride": list(tensor.stride()),
            }
        return spec


def input_spec(example_inputs, example_kwargs=None) -> dict | None:
    """Shapes and dtypes of example inputs (values of non-tensor arguments) and how they alias
    each other, JSON-ready; ``None`` when some argument cannot be described (then ``load``
    needs the inputs themselves)."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = example_kwargs or {}
    try:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        describe = _Describer(tensors)
        return {
            "args": [describe.spec(a, ["args", i]) for i, a in enumerate(args)],
            "kwargs": {k: describe.spec(v, ["kwargs", k]) for k, v in kwargs.items()},
        }
    except TypeError:
        return None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no dtype {name!r}")
    return dtype


class _Builder:
    """Inputs from an ``input_spec``, filled with ones (valid token ids, an attend-everywhere
    mask; only shapes matter to the planner), aliasing as the spec records."""

    def __init__(self, device: torch.device):
        self.device = device
        self.built: dict[tuple, torch.Tensor] = {}  # path -> tensor, for "same"
        self.storages: dict[int, torch.Tensor] = {}  # storage number -> the tensor owning it

    def build(self, spec, path: list):
        kind = spec["kind"]
        if kind == "tensor":
            tensor = self._tensor(spec)
            self.built[tuple(path)] = tensor
            return tensor
        if kind == "same":
            try:
                return self.built[tuple(spec["as"])]
            except KeyError:
                raise PlanningError(
                    f"input {path} of the saved plan is the same as {spec['as']}, which comes "
                    "later or does not exist; the file was edited or corrupted"
                ) from None
        if kind == "value":
            return spec["value"]
        if kind == "float":
            return float(spec["value"])
        if kind == "dtype":
            return _dtype(spec["value"])
        if kind in ("list", "tuple"):
            items = [self.build(s, [*path, i]) for i, s in enumerate(spec["items"])]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict":
            return {k: self.build(s, [*path, k]) for k, s in spec["items"].items()}
        raise PlanningError(f"unknown input kind {kind!r} in the saved plan")

    def _tensor(self, spec) -> torch.Tensor:
        dtype = _dtype(spec["dtype"])
        if "storage" in spec:
            base = self._base(spec["storage"], spec["storage_bytes"], dtype)
            tensor = base.as_strided(spec["shape"], spec["stride"], spec["offset"])
        else:
            tensor = torch.ones(spec["shape"], dtype=dtype, device=self.device)
        return tensor.requires_grad_(True) if spec.get("requires_grad") else tensor

    def _base(self, storage: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The tensor that owns recorded storage ``storage``, seen as ``dtype``; its inputs are
        views of it, as the originals were of theirs (a storage made by hand, not by a view,
        would look smaller to the profile's fake tensors: only as large as its views reach)."""
        if storage not in self.storages:
            itemsize = torch.empty((), dtype=dtype).element_size()
            self.storages[storage] = torch.ones(nbytes // itemsize, dtype=dtype, device=self.device)
        base = self.storages[storage]
        return base if base.dtype == dtype else base.view(dtype)


def build_inputs(spec: dict, device: torch.device) -> tuple[tuple, dict]:
    """``(example_inputs, example_kwargs)`` of the shapes, dtypes and aliasing ``spec`` (from
    ``input_spec``) records, filled with ones, on ``device``."""
    build = _Builder(device).build
    args = tuple(build(s, ["args", i]) for i, s in enumerate(spec["args"]))
    kwargs = {k: build(s, ["kwargs", k]) for k, s in spec.get("kwargs", {}).items()}
    return args, kwargs


def model_device(model) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Save


def model_name(plan) -> str:
    name = type(plan.module).__name__
    return name[len("Planned") :] if name.startswith("Planned") and len(name) > 7 else name


def _autocast_of(plan) -> list[list[str]]:
    """``[device, dtype]`` of each autocast the plan was made under (none: ``[]``)."""
    snapshot = getattr(plan.module, "_planner", None)
    state = getattr(snapshot, "autocast", ())
    return [[d, str(t).removeprefix("torch.")] for d, t in state if t is not None]


def to_dict(plan, example_inputs=None, example_kwargs=None) -> dict:
    """The JSON-ready description of ``plan`` that ``save`` writes."""
    problem = plan.problem
    recorded = getattr(plan, "input_spec", None)
    if example_inputs is not None:
        inputs = input_spec(example_inputs, example_kwargs)
        if recorded is not None and inputs != recorded:  # found by a tester: a later batch
            raise ValueError(
                "the example inputs given differ from those the plan was made with (shapes, "
                "dtypes, requires_grad or arguments): a load would capture another graph and "
                "refuse the plan. Save without them, plan.save(path): the plan recorded its own"
            )
    else:
        inputs = recorded

    def entry(start: int, stop: int, inner=()) -> dict:
        described = {
            "start": int(start),
            "stop": int(stop),
            "first": problem.names[start],
            "last": problem.names[stop - 1],
        }
        if inner:  # nested segments (version 4)
            described["inner"] = [entry(s.start, s.stop, s.inner) for s in inner]
        return described

    nesting = getattr(plan, "nesting", None)
    if nesting is not None:
        segments = [entry(s.start, s.stop, s.inner) for s in nesting.segments]
    else:
        segments = [entry(start, stop) for start, stop in plan.segments]
    keep = [
        {"position": int(k), "name": problem.names[k]} for k in sorted(getattr(plan, "keep", ()))
    ]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "planner_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "model": model_name(plan),
        "solver": str(plan.solver),
        "capture_method": plan.capture_method,
        "capture": {
            "training": bool(plan.training),
            "leaf_modules": [qualified_name(c) for c in plan.capture_options.leaf_modules],
            "dynamic_shapes": plan.capture_options.dynamic_shapes,
            "autocast": _autocast_of(plan),
        },
        "budget_bytes": int(plan.budget_bytes),
        "optimizer_state_bytes": int(problem.optimizer_state_bytes),
        "optimizer_step_bytes": int(problem.optimizer_step_bytes),
        "accumulation_bytes": getattr(plan, "accumulation_bytes", None),  # plan_batch's
        "loss_fn": bool(problem.has_loss),
        "segments": segments,
        "keep": keep,
        "predictions": {
            "peak_bytes": int(plan.predicted_peak_bytes),
            "baseline_peak_bytes": int(plan.baseline_peak_bytes),
            "overhead": float(plan.predicted_overhead),
            "recompute_flops": float(plan.recompute_flops),
            "fixed_bytes": int(problem.fixed_bytes),
        },
        "timings": {
            "solve_seconds": float(plan.solve_seconds),
            "planning_seconds": float(plan.planning_seconds),
        },
        "inputs": inputs,
        "graph": {
            "fingerprint": fingerprint(problem),
            "nodes": problem.size,
            "signature": graph_signature(problem),
        },
    }


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def save(plan, path, example_inputs=None, example_kwargs=None) -> Path:
    """Write ``plan`` to ``path`` as JSON (see the module docstring); returns the path.

    Parameters
    ----------
    plan : planner.Plan
    path : str or path-like
    example_inputs, example_kwargs : optional
        The inputs the plan was made with. Their shapes and dtypes are recorded so that
        ``load(path, model)`` can re-capture the model without them; without them (and without a
        record of them in the plan) ``load`` must be given the inputs.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory; save the plan to a file in it, e.g. {path / 'plan.json'}"
        )
    if not path.parent.is_dir():
        raise ValueError(f"cannot save the plan to {path}: there is no directory {path.parent}")
    data = to_dict(plan, example_inputs, example_kwargs)
    rows = {
        "segments": data["segments"],
        "keep": data["keep"],
        "signature": data["graph"]["signature"],
    }
    data["segments"], data["keep"] = "@segments@", "@keep@"
    data["graph"]["signature"] = "@signature@"
    text = json.dumps(data, indent=1, allow_nan=False)
    for key, items in rows.items():  # one row per line: readable and diffable
        lines = ",\n  ".join(json.dumps(item, allow_nan=False) for item in items)
        text = text.replace(f'"@{key}@"', f"[\n  {lines}\n ]" if items else "[]")
    path.write_text(text + "\n", encoding="utf-8")
    return path


def read(path) -> dict:
    """The JSON of a saved plan, checked to be one this planner reads (format, version, fields)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanningError(f"no saved plan at {path}") from None
    except IsADirectoryError:
        raise PlanningError(f"{path} is a folder, not a saved plan (a .json file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanningError(f"{path} is not a saved plan (not JSON: {error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanningError(f'{path} is not a saved plan (no "format": "{FORMAT}" field)')
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version:
        raise PlanningError(
            f"{path} has plan format version {version!r}, which no planner writes (1 to "
            f"{FORMAT_VERSION}); the file was edited or corrupted"
        )
    if version > FORMAT_VERSION:
        raise PlanningError(
            f"{path} has plan format version {version!r}; this planner reads versions up to "
            f"{FORMAT_VERSION}. Upgrade planner, or re-plan with planner.plan(...)."
        )
    for key in ("segments", "budget_bytes", "graph", "solver"):
        if key not in data:
            raise PlanningError(f"{path} is not a complete saved plan: no {key!r} field")
    if not isinstance(data["solver"], str):
        raise PlanningError(
            f"solver {data['solver']!r} of {path} is not a name; the file was edited or corrupted"
        )
    return data
