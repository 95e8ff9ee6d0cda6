"""Analyse: turn a profiled graph into the immutable ``Problem`` every solver reads.

Positions ``0..n-1`` are the compute nodes in topological (graph) order. The cut at position
``c`` lies between nodes ``c-1`` and ``c``; a checkpointed *segment* ``(start, stop)`` is the
half-open interval of positions between two cuts. A storage *crosses* cut ``c`` when it is created
before ``c`` and read at or after it; the sum of those is the cut's boundary bytes.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np
import torch
from torch import fx

from planner.costs import CostModel
from planner.export_leaves import LEAF_CALL
from planner.gcpause import paused_collection
from planner.in_place import BufferReads
from planner.profile import COMPUTE_OPS, Profile, require_meta
from planner.regions import enter_autocast, enter_inference_mode, region_spans

SOURCE, SINK = "planner.source", "planner.sink"
# A phase of a node's backward beyond all it has: what ends there is not gone within it.
NEVER = 1 << 40


@dataclass(frozen=True)
class Storage:
    """One block of activation memory: who creates it, who reads and who saves it."""

    nbytes: int
    producer: int
    readers: tuple[int, ...]
    savers: tuple[int, ...]
    is_output: bool
    requires_grad: bool
    # Made before its producer's last save: a recompute that stops at the producer re-creates it.
    before_last_save: bool = True
    # A weight cast autocast's cache holds (inside forward: to the region's exit; recomputed:
    # to the end of the recompute, whose autocast region clears the cache).
    cast_cache: bool = False
    # Kept by a saver's autograd context (``ctx.offs = offs``), not through saved-tensor hooks:
    # the forward's copy lives as long as the forward's graph, to the end of backward,
    # checkpointed or not; a recompute's copy until the recompute ends (its graph goes then).
    held_by_context: bool = False
    # Per saver (as ``savers``): the phases of its backward (``BackwardPhases``) from which a
    # recomputed copy handed to its functions, and the graph's own copy, are gone (each function
    # drops what it unpacked as it returns, and what it saved as autograd releases it). Left
    # out: NEVER, both.
    saver_ends: tuple[tuple[int, int], ...] = ()

    @property
    def last_reader(self) -> int:
        return max(self.readers, default=self.producer)


@dataclass(frozen=True)
class StorageArrays:
    """Per-storage facts as arrays, and every read and save as a (storage, node) pair."""

    nbytes: np.ndarray
    producer: np.ndarray
    last_use: np.ndarray  # last reader; the last node for graph outputs (the loss reads them)
    is_output: np.ndarray
    before_last_save: np.ndarray
    cast_cache: np.ndarray
    held_by_context: np.ndarray
    read_storage: np.ndarray
    read_node: np.ndarray
    save_storage: np.ndarray
    save_node: np.ndarray
    save_returned: np.ndarray  # per save pair: Storage.saver_ends
    save_released: np.ndarray

    @classmethod
    def of(cls, storages: tuple[Storage, ...], n: int) -> StorageArrays:
        def pairs(attribute: str) -> tuple[np.ndarray, np.ndarray]:
            lists = [getattr(s, attribute) for s in storages]
            owners = np.repeat(np.arange(len(storages)), [len(nodes) for nodes in lists])
            return owners, np.fromiter((j for nodes in lists for j in nodes), np.int64)

        read_storage, read_node = pairs("readers")
        save_storage, save_node = pairs("savers")
        ends = [s.saver_ends or ((NEVER, NEVER),) * len(s.savers) for s in storages]
        flat = np.array([e for saver in ends for e in saver], np.int64).reshape(-1, 2)
        return cls(
            nbytes=np.array([s.nbytes for s in storages], dtype=np.int64),
            producer=np.array([s.producer for s in storages], dtype=np.int64),
            last_use=np.array(
                [n - 1 if s.is_output else s.last_reader for s in storages], dtype=np.int64
            ),
            is_output=np.array([s.is_output for s in storages], dtype=bool),
            before_last_save=np.array([s.before_last_save for s in storages], dtype=bool),
            cast_cache=np.array([s.cast_cache for s in storages], dtype=bool),
            held_by_context=np.array([s.held_by_context for s in storages], dtype=bool),
            read_storage=read_storage,
            read_node=read_node,
            save_storage=save_storage,
            save_node=save_node,
            save_returned=flat[:, 0],
            save_released=flat[:, 1],
        )


@dataclass(frozen=True, eq=False)
class BackwardPhases:
    """Each node's backward in phases (``planner.profile``: one more each time one of its
    functions returns or is released), as flat arrays: node ``i``'s phases are
    ``high[start[i]:start[i + 1]]``, the most its backward has allocated in each (bytes since
    it began), and ``released[i]`` the phase from which all its functions were released
    (NEVER if not seen): what a checkpoint's frame holds for a segment whose first saving
    node it is goes then."""

    start: np.ndarray
    high: np.ndarray
    released: np.ndarray

    def __eq__(self, other) -> bool:  # arrays compare element by element
        return isinstance(other, BackwardPhases) and all(
            np.array_equal(getattr(self, name), getattr(other, name))
            for name in ("start", "high", "released")
        )

    @classmethod
    def single(cls, n: int) -> BackwardPhases:
        """One phase per node: nothing it holds is gone before its backward ends."""
        return cls(np.arange(n + 1), np.zeros(n, np.int64), np.full(n, NEVER, np.int64))

    @classmethod
    def of(cls, phases: list[tuple[int, ...]], released: list[int | None]) -> BackwardPhases:
        counts = [max(len(p), 1) for p in phases]
        return cls(
            start=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
            high=np.array([h for p in phases for h in (p or (0,))], np.int64),
            released=np.array([NEVER if r is None else r for r in released], np.int64),
        )

    @cached_property
    def count(self) -> np.ndarray:
        return np.diff(self.start)

    @cached_property
    def node_high(self) -> np.ndarray:
        """Per node, the highest of its phases."""
        return np.maximum.reduceat(self.high, self.start[:-1]) if self.high.size else self.high

    def credit(self, node: np.ndarray, phase: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Per node, the bytes its backward's high point does not hold of ``nbytes`` freed at
        its step, each gone from ``phase`` of ``node``'s backward on: the highest of
        ``phase high + bytes not yet gone`` is the node's high point plus all it frees, less
        ``min over phases (node high - phase high + bytes gone by then)``."""
        n = self.count.size
        if not n:
            return np.zeros(0, np.int64)
        within = phase < self.count[node]
        gone = np.zeros(self.high.size, np.int64)
        np.add.at(gone, self.start[node[within]] + phase[within], nbytes[within])
        gone = np.cumsum(gone)
        before = np.concatenate(([0], gone))[self.start[:-1]]  # gone in earlier nodes
        gone -= np.repeat(before, self.count)
        value = np.repeat(self.node_high, self.count) - self.high + gone
        return np.minimum.reduceat(value, self.start[:-1])


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything a solver may use; built once per model by ``build_problem``."""

    names: tuple[str, ...]
    labels: tuple[str, ...]  # short description of each node's operation
    flops: np.ndarray
    bytes_moved: np.ndarray
    seconds: np.ndarray  # cost-model time of each node: what recomputing it costs
    workspace: np.ndarray
    created_bytes: np.ndarray  # bytes of the storages each node creates
    saves: np.ndarray  # bool per node: autograd saves something while it runs
    # bool per node: it creates a storage before its last save (e.g. an output it saves): the
    # recompute of a segment that stops at it re-creates that (``Storage.before_last_save``)
    saves_own: np.ndarray
    # Backward step i allocates activation_grad_alloc[i] + grad_bytes_at[i] (parameter
    # gradients, kept), reaches its high point, then frees activation_grad_free[i].
    grad_bytes_at: np.ndarray
    activation_grad_alloc: np.ndarray
    activation_grad_free: np.ndarray
    checkpointable: np.ndarray  # bool per node: may be inside a checkpointed segment
    cut_allowed: np.ndarray  # bool per cut position 0..n
    cut_bytes: np.ndarray  # boundary bytes per cut position 0..n
    articulation_cuts: tuple[int, ...]  # cuts crossed by the output of one articulation node
    storages: tuple[Storage, ...]
    fixed_bytes: int  # parameters + buffers + inputs + constants + optimizer state
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int = 0
    # Per-node keeps (``Choice.keep``): bytes the selective-checkpoint cache holds for a kept
    # node, whether the node draws random numbers, and whether it may be kept at all. Left out,
    # they read: every storage the node creates (created_bytes + workspace), no randomness, and
    # keepable where the node creates memory.
    # None only until __post_init__ fills in the defaults, hence the ignores.
    kept_bytes: np.ndarray = None  # type: ignore[assignment]
    random: np.ndarray = None  # type: ignore[assignment]
    keepable: np.ndarray = None  # type: ignore[assignment]
    # Per node, whether a recompute may replay it where nothing needs its values
    # (``planner.choice.replayed_nodes``): keepable, drawing no random numbers, making no
    # weight cast autocast caches and nothing an autograd context holds, with ops a replay
    # fakes (profile key ``planner.replay_ops``); what a replay still computes (copies the
    # node saves for its own backward) costs replay_share of the node's seconds (so a problem
    # given other seconds, ``dataclasses.replace(problem, seconds=...)``, charges its replays
    # in them too: ``replay_seconds``) and replay_flops, and reads the node's inputs where
    # replay_reads. Left out: none replayable.
    replayable: np.ndarray = None  # type: ignore[assignment]
    replay_share: np.ndarray = None  # type: ignore[assignment]
    replay_flops: np.ndarray = None  # type: ignore[assignment]
    replay_reads: np.ndarray = None  # type: ignore[assignment]
    # Per node, whether it dispatches one op (profile key ``planner.one_op``): only such kept
    # or replayed nodes may read a replay's stand-ins. Left out: all.
    one_op: np.ndarray = None  # type: ignore[assignment]
    # The FLOPs a recompute stopping inside a node (at its last save, ``recompute_stop``) runs
    # of it. Left out: the whole node's.
    stop_flops: np.ndarray = None  # type: ignore[assignment]
    # Parameter gradient bytes complete at backward step i: its parameter's first reader in
    # forward, whose backward brings the last contribution (AccumulateGrad runs there). The
    # same as grad_bytes_at but for a parameter several nodes read (tied embeddings), whose
    # gradient is summed from its last reader's backward to its first's.
    grad_complete_at: np.ndarray = None  # type: ignore[assignment]
    # Each node's backward in phases, and where its saved tensors go (Storage.saver_ends).
    # Left out: one phase per node, nothing gone before its backward ends.
    backward_phases: BackwardPhases = None  # type: ignore[assignment]
    # What backward step i has allocated when it first unpacks a saved tensor: a recompute it
    # triggers runs on top of it. Left out: none.
    grad_before_unpack: np.ndarray = None  # type: ignore[assignment]
    # A node's transient when a recompute stops inside it, at its last save: the most its
    # forward held until then beyond what it had made and keeps. Left out: workspace.
    stop_workspace: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self):
        defaults = {
            "kept_bytes": lambda: self.created_bytes + self.workspace,
            "random": lambda: np.zeros(self.size, dtype=bool),
            "keepable": lambda: self.kept_bytes > 0,
            "replayable": lambda: np.zeros(self.size, dtype=bool),
            "replay_share": lambda: np.zeros(self.size),
            "replay_flops": lambda: np.zeros(self.size),
            "replay_reads": lambda: np.zeros(self.size, dtype=bool),
            "one_op": lambda: np.ones(self.size, dtype=bool),
            "stop_flops": lambda: self.flops,
            "grad_complete_at": lambda: self.grad_bytes_at,
            "backward_phases": lambda: BackwardPhases.single(self.size),
            "grad_before_unpack": lambda: np.zeros(self.size, dtype=np.int64),
            "stop_workspace": lambda: self.workspace,
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default())

    @property
    def replay_seconds(self) -> np.ndarray:
        """Per node, the seconds its replay costs: its share of the node's ``seconds``."""
        return self.seconds * self.replay_share

    # What optimizer.step() holds at once beyond parameters, gradients and state (temporaries).
    optimizer_step_bytes: int = 0
    has_loss: bool = False  # the last position is the user's loss_fn, outside the module
    # The module (``"blocks.3.attn"``) each node belongs to, for drawings; () when not known.
    module_paths: tuple[str, ...] = ()
    # Low-precision copies of weights that autocast's cache holds all step (part of fixed_bytes:
    # an autocast region around the step; see planner.profile).
    autocast_cache_bytes: int = 0
    # Per node, the buffers a checkpointed segment holding it copies to restore them after its
    # recompute (``planner.rewrite.Segment``), as (buffer, bytes, position of the node that
    # passes it in, or -1): a segment copies it unless that node is one of its own. () when no
    # node has any (solvers then skip a scan of every segment's nodes).
    buffer_copies: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    # Seconds one checkpoint call and one kept node add to a step beyond the nodes recomputed
    # (``CostModel.checkpoint_seconds`` and ``keep_seconds``; ``planner.simulate`` charges them).
    checkpoint_seconds: float = 0.0
    keep_seconds: float = 0.0
    # The loss and backward's seed: live from the end of forward, counted in the first backward
    # step's allocation; a recompute that runs before that step holds them too (simulate).
    loss_bytes: int = 0
    # The default loss (no loss_fn node): what its sums hold at once, right after the last node
    # while the graph's outputs are still live (simulate).
    default_loss_high: int = 0
    # Bytes of the outputs the default loss sums when the model returns no 0-dim loss and no
    # loss_fn was given: a loss the user computes from them (a cross-entropy over logits) holds
    # memory of its own that no plan of this problem counts (``planner.pipeline.plan`` warns).
    summed_output_bytes: int = 0

    @property
    def size(self) -> int:
        return len(self.names)

    @cached_property
    def grad_after_saved(self) -> np.ndarray:
        """Per backward step, the bytes of its high point reached only after the first of the
        node's saved tensors may be gone (a function that unpacked it returned): what the
        node holds beside all it saved is at least the high point less this."""
        phases, a = self.backward_phases, self.storage_arrays
        first_end = np.full(self.size, NEVER, np.int64)
        np.minimum.at(first_end, a.save_node, a.save_returned)
        local = np.arange(phases.high.size) - np.repeat(phases.start[:-1], phases.count)
        while_saved = np.where(local < np.repeat(first_end, phases.count), phases.high, 0)
        if not while_saved.size:
            return np.zeros(self.size, np.int64)
        return phases.node_high - np.maximum.reduceat(while_saved, phases.start[:-1])

    def buffer_copy_bytes(self, start: int, stop: int) -> int:
        """Bytes of the copies of buffers that segment ``(start, stop)`` makes: once when its
        forward starts (held until its recompute ends), once more while its recompute runs."""
        copies = {}
        for node in self.buffer_copies[start:stop]:
            for buffer, nbytes, passed_by in node:
                if not start <= passed_by < stop:
                    copies[buffer] = nbytes
        return sum(copies.values())

    @property
    def step_seconds(self) -> float:
        """A training step without checkpointing under the cost model: forward + backward,
        taken as three forwards. Recompute overheads are fractions of it."""
        return 3 * float(self.seconds.sum())

    @cached_property
    def storage_arrays(self) -> StorageArrays:
        """The storages as flat arrays, for vectorised passes (``simulate``)."""
        return StorageArrays.of(self.storages, self.size)

    @cached_property
    def last_saving(self) -> np.ndarray:
        """Per position ``x``, the last position at or before ``x`` whose node saves, or -1:
        where the recompute of a segment ending at ``x + 1`` stops, for any segment at once."""
        return np.maximum.accumulate(np.where(self.saves, np.arange(self.size), -1))

    def saved_bytes_per_node(self) -> np.ndarray:
        """Bytes each node creates that autograd saves for backward: what checkpointing drops."""
        return self._saved_bytes_per_node.copy()

    @cached_property
    def _saved_bytes_per_node(self) -> np.ndarray:
        a = self.storage_arrays
        saved = np.zeros(self.size, dtype=np.int64)
        has_savers = np.zeros(a.nbytes.size, dtype=bool)
        has_savers[a.save_storage] = True
        np.add.at(saved, a.producer[has_savers], a.nbytes[has_savers])
        return saved

    def is_valid_segment(self, start: int, stop: int) -> bool:
        return (
            0 <= start < stop <= self.size
            and bool(self.cut_allowed[start])
            and bool(self.cut_allowed[stop])
            and bool(self.checkpointable[start:stop].all())
        )


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def _label(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}"
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def articulation_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Compute nodes that alone connect what comes before them to what comes after.

    Parameters and buffers (``get_attr``) are left out: they live anyway; so are edges from
    nodes that return no tensor (``x.size(1)``), once profiled. A virtual source feeds
    the placeholders and a virtual sink drains the output, so a node counts only if every path
    from inputs to outputs passes through it.

    Examples
    --------
    >>> import torch
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> sorted(n.name for n in articulation_nodes(gm))
    ['_0', '_1']
    """
    graph = nx.Graph([(SOURCE, SINK)] if not gm.graph.find_nodes(op="placeholder") else [])
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        graph.add_node(node)
        if node.op == "placeholder":
            graph.add_edge(SOURCE, node)
        if node.op == "output":
            graph.add_edge(node, SINK)
        for used in node.all_input_nodes:
            # Sizes and other plain values cost no memory: they do not tie the graph together.
            if used.op != "get_attr" and used.meta.get("planner.tensor_output", True):
                graph.add_edge(used, node)
    return {
        n for n in nx.articulation_points(graph) if isinstance(n, fx.Node) and n.op in COMPUTE_OPS
    }


def _keepable(created: list[dict], writes: list[frozenset], kept_bytes: np.ndarray) -> np.ndarray:
    """Nodes a selective-checkpoint cache may keep: they create memory, mutate nothing, and
    nothing later mutates what they create (the cache hands the forward's tensors to the
    recompute, and torch refuses cached tensors that changed since)."""
    keepable = (kept_bytes > 0) & np.array([not w for w in writes], dtype=bool)
    producer = {key: i for i, c in enumerate(created) for key in c}
    for written in writes:
        for key in written:
            if key in producer:
                keepable[producer[key]] = False
    return keepable


def _mutation_pins(
    storages: dict,
    reads: list,
    writes: list[frozenset],
    restored: list[bool],
    fixed: Mapping[int, str],
):
    """Cuts and nodes that in-place writes forbid.

    A checkpointed segment must not see an input that was changed after it ran (its recompute
    would read the new value), so no cut may fall between a storage's creation and a write to it.
    Writes to parameters or inputs are never recomputed, and neither is what reads them before
    the write (``x.mul_(0.5)`` after ``exp(x)``: torch's checkpoint refused the changed input in
    backward). Writes to buffers are allowed where the rewritten segment restores the buffer
    after recomputing (``restored``: a module's own, BatchNorm statistics; one the node writes
    directly); one written through a view (``self.buf[:4].mul_(2)``) is pinned as a parameter.
    """
    n = len(writes)
    forbidden_cuts = np.zeros(n + 1, dtype=bool)
    pinned = np.zeros(n, dtype=bool)
    last_write: dict[int, int] = {}
    for position, written in enumerate(writes):
        for key in written:
            kind = fixed.get(key)
            if key in storages:
                forbidden_cuts[storages[key].producer + 1 : position + 1] = True
            elif kind in ("parameter", "input", "constant") or (
                kind == "buffer" and not restored[position]
            ):
                pinned[position] = True
                last_write[key] = position
    for position, read in enumerate(reads):
        pinned[position] |= any(last_write.get(key, -1) > position for key in read)
    return forbidden_cuts, pinned


def _inference_spans(nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """``(entry, exit)`` of each ``torch.inference_mode()`` region of forward (not
    ``inference_mode(False)``)."""
    return [
        (entry, exit_)
        for entry, exit_ in region_spans(nodes)
        if nodes[entry].target is enter_inference_mode and nodes[entry].args[:1] != (False,)
    ]


def _inference_crossings(
    spans: list[tuple[int, int]], storages: dict[int, Storage], reads: list, fixed: frozenset
) -> np.ndarray:
    """Per cut: whether an inference tensor (made in one of the ``_inference_spans``, or one of
    ``fixed``: inputs, which a segment takes as arguments) crosses it to a reader. A segment
    starting there would take it as an argument, which checkpoint saves and autograd refuses
    to ("Inference tensors cannot be saved for backward", found by a tester); one holding its
    producer recomputes it under the mode, as forward made it."""
    crossed = np.zeros(len(reads) + 1, bool)
    for entry, exit_ in spans:
        for s in storages.values():
            if entry < s.producer < exit_:
                crossed[s.producer + 1 : s.last_reader + 1] = True
    if fixed:
        readers = [i for i, read in enumerate(reads) if not fixed.isdisjoint(read)]
        crossed[: max(readers, default=-1) + 1] = True
    return crossed


def _container_readers(nodes: list[fx.Node]) -> np.ndarray:
    """The nodes given a Python container that forward writes into (``batch["x"] = h`` on a
    dict argument, ``hs.append(h)``, through any alias: ``batch.get("inner")``), by identity
    (profile key ``planner.containers``): a recompute would read it as the whole forward left
    it, not as it was (found by review: gradients 3.65 off, 1996 through ``update``). They are
    never recomputed, nor are the writers (``planner.profile.CONTAINER_WRITE``)."""
    seen = [n.meta.get("planner.containers", (set(), set())) for n in nodes]
    written = set().union(*(writes for _, writes in seen))
    return np.array([bool(written & reads) for reads, _ in seen], bool)


def _buffer_copies(gm: fx.GraphModule, nodes: list[fx.Node], reads_buffer: BufferReads) -> tuple:
    """``Problem.buffer_copies``: per node, the buffers of the module it calls, and those it
    reads (``BufferReads.restored``: directly, through a view or alias, or after in-place
    updates by the node that passes them in); () if none."""
    position = {node: i for i, node in enumerate(nodes)}
    keys: dict[int, int] = {}  # id of a buffer tensor -> its key

    def entry(tensor: torch.Tensor, passed_by: int) -> tuple[int, int, int]:
        key = keys.setdefault(id(tensor), len(keys))
        return key, tensor.numel() * tensor.element_size(), passed_by

    result = []
    for node in nodes:
        copies = []
        if node.op == "call_module" and node.graph is gm.graph:
            copies += [entry(b, -1) for b in gm.get_submodule(str(node.target)).buffers()]
        for source in node.all_input_nodes if node.graph is gm.graph else ():
            target = reads_buffer.restored(source)
            if target is not None:
                tensor = operator.attrgetter(target)(gm)
                copies.append(entry(tensor, position.get(source, -1)))
        result.append(tuple(copies))
    return tuple(result) if any(result) else ()


def _cast_cache_exits(nodes: list[fx.Node]) -> dict[int, int]:
    """Storage -> position of the exit that frees it, for the weight casts that autocast's
    cache holds (``planner.cast_cache``): the exit of the outermost autocast region around
    the cast, which clears the cache. (Casts under a region entered before the step are fixed
    memory: the profile made them so.)"""
    spans = [(e, x) for e, x in region_spans(nodes) if nodes[e].target is enter_autocast]
    outermost = [(e, x) for e, x in spans if not any(a < e and x < b for a, b in spans)]
    exits = {}
    for entry, exit_ in outermost:
        for node in nodes[entry + 1 : exit_]:
            exits.update(dict.fromkeys(require_meta(node, "planner.cast_cache"), exit_))
    return exits


def _ends(ends: tuple[int | None, int | None]) -> tuple[int, int]:
    returned, released = ends
    return (NEVER if returned is None else returned, NEVER if released is None else released)


@paused_collection()
def build_problem(
    gm: fx.GraphModule,
    profile: Profile,
    *,
    cost_model: CostModel | None = None,
    optimizer_state_bytes: int = 0,
    optimizer_step_bytes: int = 0,
) -> Problem:
    """Read the profile annotations of ``gm`` into a ``Problem``.

    A loss the profile recorded (``Profile.loss``) becomes the last position, after the graph's
    nodes: it reads the graph's outputs, and it is never checkpointed (it runs outside the
    planned module), so positions ``0..n-1`` stay those of ``compute_nodes(gm)``.
    """
    cost_model = cost_model or CostModel()
    nodes = compute_nodes(gm) + ([profile.loss] if profile.loss is not None else [])
    n = len(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    created = [require_meta(node, "planner.created") for node in nodes]
    reads = [require_meta(node, "planner.reads") for node in nodes]
    saved = [require_meta(node, "planner.saved") for node in nodes]
    writes = [require_meta(node, "planner.writes") for node in nodes]
    made_before_last_save = [require_meta(nd, "planner.made_before_last_save") for nd in nodes]
    made_before = [{k: c[k] for k in made} for c, made in zip(created, made_before_last_save)]
    context_saved = set().union(*(require_meta(nd, "planner.context_saved") for nd in nodes))

    producer = {key: i for i, c in enumerate(created) for key in c}
    readers: dict[int, list[int]] = {key: [] for key in producer}
    savers: dict[int, list[int]] = {key: [] for key in producer}
    grad_bytes_at, grad_complete_at = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    first_trainable_use: dict[int, int] = {}
    last_trainable_use: dict[int, int] = {}
    for i in range(n):
        for key in reads[i]:
            if key in readers and producer[key] < i:
                readers[key].append(i)
            if key in profile.trainable:
                first_trainable_use.setdefault(key, i)
                last_trainable_use[key] = i
        for key in saved[i]:
            if key in savers:
                savers[key].append(i)
    for key, i in last_trainable_use.items():
        grad_bytes_at[i] += profile.storage_bytes[key]
        grad_complete_at[first_trainable_use[key]] += profile.storage_bytes[key]
    cast_exits = _cast_cache_exits(nodes)
    for key, exit_ in cast_exits.items():
        readers[key].append(exit_)

    ends = [require_meta(node, "planner.backward_ends") for node in nodes]
    never = (None, None)
    storages = {
        key: Storage(
            nbytes=profile.storage_bytes[key],
            producer=producer[key],
            readers=tuple(readers[key]),
            savers=tuple(savers[key]),
            is_output=key in profile.output_storages,
            requires_grad=bool(nodes[producer[key]].meta["planner.requires_grad"]),
            before_last_save=key in made_before_last_save[producer[key]],
            cast_cache=key in cast_exits,
            held_by_context=key in context_saved,
            saver_ends=tuple(_ends(ends[i].get(key, never)) for i in savers[key]),
        )
        for key in sorted(producer)
    }

    # What each node's backward allocates was measured in the profile's fake backward: at its
    # high point it holds backward_high bytes more than before, of which backward_net remain.
    # Parameter gradients are part of both; they are reported apart in grad_bytes_at.
    high = np.array([require_meta(node, "planner.backward_high") for node in nodes], np.int64)
    net = np.array([require_meta(node, "planner.backward_net") for node in nodes], np.int64)
    phases = BackwardPhases.of(
        [require_meta(node, "planner.backward_phases") for node in nodes],
        [node.meta.get("planner.backward_released") for node in nodes],
    )
    before_unpack = np.array(
        [require_meta(node, "planner.backward_before_unpack") for node in nodes], np.int64
    )
    grad_alloc = high - grad_bytes_at
    grad_free = high - net
    if n:
        # The step holds its loss from the loss's forward to its end: re-made at the first
        # backward step, never freed there (the loss node's own copy goes after its forward).
        grad_alloc[n - 1] += profile.loss_bytes

    cut_delta = np.zeros(n + 2, dtype=np.int64)
    for s in storages.values():
        end = n if s.is_output else s.last_reader
        if end > s.producer:
            cut_delta[s.producer + 1] += s.nbytes
            cut_delta[end + 1] -= s.nbytes
    cut_bytes = np.cumsum(cut_delta)[: n + 1]

    reads_buffer = BufferReads(gm, gm.meta.get("planner.buffer_storages"))
    restored = [
        reads_buffer(node) is not None
        or (node.op == "call_module" and reads_buffer.holds_buffers(str(node.target)))
        for node in nodes
    ]
    forbidden_cuts, pinned = _mutation_pins(storages, reads, writes, restored, profile.fixed_kind)
    cut_allowed = ~forbidden_cuts
    # A grad-mode region of forward (``with torch.no_grad():``, recorded by capture as entry
    # and exit nodes) lies whole inside a segment or outside all: a segment that began or ended
    # inside one would be recomputed without the switch its forward ran under, and would pass
    # the region across the checkpoint boundary to exit it twice. An autocast region may hold
    # segments instead (a forward run wholly under autocast must): checkpoint recomputes under
    # the autocast state its forward ran in, so only the entry and exit stay out of segments.
    for entry, exit_ in region_spans(nodes):
        if nodes[entry].target is enter_autocast:
            pinned[[entry, exit_]] = True
        else:
            cut_allowed[entry + 1 : exit_ + 1] = False
    inference_spans = _inference_spans(nodes)
    cut_allowed &= ~_inference_crossings(
        inference_spans, storages, reads, profile.inference_storages
    )
    # The selective cache cannot hold what a node makes in inference mode ("Inference tensors
    # do not track version counter", found by review): such nodes are recomputed, not kept.
    in_inference = np.zeros(n, bool)
    for entry, exit_ in inference_spans:
        in_inference[entry + 1 : exit_] = True
    # A module kept whole under torch.export (planner.export_leaves) is profiled op by op but
    # runs as one call: no cut and no keep inside it.
    inside_call = np.array([LEAF_CALL in n.meta for n in nodes], bool)
    cut_allowed[1:n][_same_call(nodes)] = False
    # torch.export's input guards: cheap assertions, never worth recomputing.
    pinned |= np.array([n.op == "call_module" and n.target == "_guards_fn" for n in nodes], bool)
    # What a recompute would do twice (``planner.repeated_effects``): a draw from a generator
    # the model passes an op itself (checkpoint restores only the default generators' state),
    # and a kept-whole module's attribute updates and Python draws. Such nodes run once.
    pinned |= np.array([bool(require_meta(n, "planner.repeated_effects")) for n in nodes], bool)
    pinned |= _container_readers(nodes)
    pinned |= np.array([n is profile.loss for n in nodes], bool)

    articulation = articulation_nodes(gm)
    articulation_cuts = tuple(sorted(position[a] + 1 for a in articulation if a in position))

    flops = np.array([require_meta(node, "planner.flops") for node in nodes], dtype=np.float64)
    moved = np.array([require_meta(node, "planner.bytes_moved") for node in nodes], np.float64)
    fixed_bytes = sum(profile.storage_bytes[k] for k in profile.fixed_kind)
    kept_bytes = np.array([require_meta(nd, "planner.kept_bytes") for nd in nodes], np.int64)
    keepable = _keepable(created, writes, kept_bytes) & ~pinned & ~inside_call & ~in_inference
    random = np.array([bool(require_meta(nd, "planner.random")) for nd in nodes], dtype=bool)
    replays = [require_meta(nd, "planner.replay_ops") for nd in nodes]
    unusual = set(cast_exits) | context_saved  # storages autocast's cache or a context holds
    replayable = (
        keepable
        & ~random
        & np.array([bool(ops) for ops in replays], dtype=bool)
        & np.array([unusual.isdisjoint(c) for c in created], dtype=bool)
    )
    computed = np.array(
        [[sum(op[k] for op in ops if not op[1]) for k in (2, 3)] for ops in replays], np.float64
    ).reshape(n, 2)
    seconds = cost_model.seconds(flops, moved, [node.name for node in nodes])
    # What a replay still computes, as a share of its node's time: the roofline's share.
    roofline = cost_model.seconds(flops, moved)

    def share(part: np.ndarray) -> np.ndarray:
        fraction = np.divide(part, roofline, out=np.ones(n), where=roofline > 0)
        return np.minimum(fraction, 1.0)

    stopped = np.array(
        [require_meta(nd, "planner.cost_before_last_save") for nd in nodes], np.float64
    ).reshape(n, 2)
    return Problem(
        names=tuple(node.name for node in nodes),
        labels=tuple("loss_fn" if node is profile.loss else _label(node) for node in nodes),
        flops=flops,
        bytes_moved=moved,
        seconds=seconds,
        workspace=np.array([require_meta(nd, "planner.workspace") for nd in nodes], np.int64),
        stop_workspace=np.array(
            [
                max(require_meta(nd, "planner.high_before_last_save") - sum(made.values()), 0)
                for nd, made in zip(nodes, made_before)
            ],
            np.int64,
        ),
        created_bytes=np.array([sum(c.values()) for c in created], dtype=np.int64),
        saves=np.array([bool(s) for s in saved], dtype=bool),
        saves_own=np.array([bool(made) for made in made_before_last_save], dtype=bool),
        grad_bytes_at=grad_bytes_at,
        grad_complete_at=grad_complete_at,
        activation_grad_alloc=grad_alloc,
        activation_grad_free=grad_free,
        backward_phases=phases,
        grad_before_unpack=before_unpack,
        checkpointable=~pinned,
        cut_allowed=cut_allowed,
        cut_bytes=cut_bytes,
        articulation_cuts=articulation_cuts,
        storages=tuple(storages.values()),
        fixed_bytes=fixed_bytes + optimizer_state_bytes,
        parameter_bytes=profile.fixed_bytes("parameter"),
        gradient_bytes=profile.gradient_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        kept_bytes=kept_bytes,
        random=random,
        keepable=keepable,
        replayable=replayable,
        replay_share=np.where(replayable, share(cost_model.seconds(*computed.T)), 0.0),
        replay_flops=np.where(replayable, computed[:, 0], 0.0),
        replay_reads=replayable & np.array([not all(op[1] for op in ops) for ops in replays], bool),
        one_op=np.array([bool(require_meta(nd, "planner.one_op")) for nd in nodes], bool),
        stop_flops=np.minimum(stopped[:, 0], flops),
        optimizer_step_bytes=optimizer_step_bytes,
        has_loss=profile.loss is not None,
        module_paths=module_paths(nodes),
        autocast_cache_bytes=profile.fixed_bytes("autocast cache"),
        checkpoint_seconds=cost_model.checkpoint_seconds,
        keep_seconds=cost_model.keep_seconds,
        buffer_copies=_buffer_copies(gm, nodes, reads_buffer),
        loss_bytes=profile.loss_bytes + profile.seed_bytes,
        default_loss_high=profile.default_loss_high if profile.loss is None else 0,
        summed_output_bytes=profile.summed_output_bytes,
    )


def _same_call(nodes: list[fx.Node]) -> np.ndarray:
    """For each pair of neighbours, whether both belong to the same kept call."""
    calls = [n.meta.get(LEAF_CALL) for n in nodes]
    return np.array([a is not None and a == b for a, b in zip(calls, calls[1:])], bool)


# --------------------------------------------------------------------------------------------
# Module paths, recorded for the drawings


def _normalise_path(path: str) -> str:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^L__self___?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _own_path(node) -> str | None:
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if stack:
        entry = list(stack.values())[-1]
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        return _normalise_path(str(path))
    if node is not None and node.op == "call_module":
        return str(node.target)
    return None


def _common_prefix(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def module_paths(nodes: list[fx.Node]) -> tuple[str, ...]:
    """The module path (``"blocks.3.attn"``; ``""`` for the top level) of every node.

    Read from ``node.meta["nn_module_stack"]`` (``torch.export`` records it for every node,
    ``symbolic_trace`` for calls of leaf modules) or a ``call_module`` target. A function node
    without one (``symbolic_trace``) gets the common prefix of the modules called just before and
    just after it: the ``matmul`` between ``attn.qkv`` and ``attn.proj`` belongs to ``attn``.
    """
    own = [_own_path(node) for node in nodes]
    n = len(own)
    before: list[str | None] = [None] * n
    after: list[str | None] = [None] * n
    last = None
    for i in range(n):
        last = own[i] if own[i] is not None else last
        before[i] = last
    last = None
    for i in range(n - 1, -1, -1):
        last = own[i] if own[i] is not None else last
        after[i] = last
    paths: list[str] = []
    for i, path in enumerate(own):
        if path is None:
            a, b = before[i], after[i]
            if a is not None and b is not None:
                path = _common_prefix(a, b)
            else:
                path = ""
        paths.append(path)
    return tuple(paths)
