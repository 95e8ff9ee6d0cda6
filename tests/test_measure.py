"""Specifications of planner.step: the real measurements that check the planner's predictions.

Most tests compute the same number two ways: by hand, from tensor shapes (the arithmetic is in
the comments), and by measuring a real training step. All sizes are float32 (4 bytes).
"""

import collections
import dataclasses
import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from planner.step import (
    peak_memory,
    step_flops,
    step_time,
    training_loss,
    training_step,
)
from planner.tracker import MemoryReport

F32 = 4  # bytes per float32 element


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def param_bytes(module):
    return nbytes(*module.parameters())


def dispatch_modes_active():
    return torch._C._len_torch_dispatch_stack()


# --------------------------------------------------------------------------------------------
# training_loss and training_step: what "one training step" means
# --------------------------------------------------------------------------------------------


def test_loss_of_a_tensor_is_its_sum():
    w = torch.arange(6.0, requires_grad=True)
    assert training_loss(w * 2).item() == 30.0


def test_loss_sums_every_grad_tensor_in_tuples_lists_dicts_and_nests():
    w = torch.ones(3, requires_grad=True)
    output = (w, [2 * w, {"a": 3 * w}], {"b": (4 * w,)})
    assert training_loss(output).item() == (1 + 2 + 3 + 4) * 3


def test_loss_ignores_tensors_that_do_not_require_grad_or_are_not_floating_point():
    w = torch.ones(3, requires_grad=True)
    output = {"logits": w, "ids": torch.arange(3), "mask": torch.ones(3), "n": 7}
    assert training_loss(output).item() == 3.0


def test_a_scalar_output_is_used_as_is():
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    assert training_loss(loss) is loss


def test_loss_reads_dict_subclasses_like_model_output_and_dataclasses():
    class ModelOutputLike(collections.OrderedDict):  # what Hugging Face's ModelOutput is
        pass

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        extra: tuple

    w = torch.ones(2, requires_grad=True)
    assert training_loss(ModelOutputLike(logits=w, hidden=2 * w)).item() == 6.0
    assert training_loss(Out(hidden=w, extra=(3 * w,))).item() == 8.0


def test_loss_reads_a_hugging_face_model_output():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    w = torch.ones(2, requires_grad=True)
    out = outputs.CausalLMOutput(loss=w.sum(), logits=3 * w)
    # Every tensor counts, the model's own loss included: 2 + 6.
    assert training_loss(out).item() == 8.0


@pytest.mark.parametrize(
    "output",
    [torch.ones(3), (torch.ones(3), torch.arange(3)), {}, None, "text"],
)
def test_loss_raises_when_nothing_requires_grad(output):
    with pytest.raises(ValueError, match="requires grad"):
        training_loss(output)


def test_training_step_fills_gradients_and_returns_the_detached_loss():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    loss = training_step(lin, (x,))
    assert not loss.requires_grad
    assert torch.allclose(loss, lin(x).sum())
    # d(sum(x W^T + b))/dW = column sums of x, for every output row.
    assert torch.allclose(lin.weight.grad, x.sum(0).expand(2, 3))
    assert torch.equal(lin.bias.grad, torch.full((2,), 4.0))


def test_training_step_passes_keyword_arguments():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x, *, scale):
            return self.w * x * scale

    loss = training_step(Scaled(), (torch.ones(2),), {"scale": 5.0})
    assert loss.item() == 10.0


# --------------------------------------------------------------------------------------------
# Facts about PyTorch that the CPU tracker relies on
# --------------------------------------------------------------------------------------------


def test_fact_a_storage_finalizer_fires_when_the_storage_dies_not_when_its_wrapper_does():
    # PyTorch keeps a storage's Python object alive for as long as the storage lives, so a
    # finalizer on it measures the lifetime of the memory, not of one Python reference.
    fired = []
    t = torch.empty(1000)
    storage = t.untyped_storage()
    weakref.finalize(storage, fired.append, "freed")
    view = t[10:20]
    del storage, t
    gc.collect()
    assert fired == []  # the view still holds the storage
    del view
    assert fired == ["freed"]


def test_fact_a_dispatch_mode_sees_backward_and_checkpoint_recomputation_on_cpu():
    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.threads = [], set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            self.threads.add(threading.get_ident())
            return func(*args, **(kwargs or {}))

    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with Recorder() as rec:
        checkpoint(lambda x: lin(x).relu(), x, use_reentrant=False).sum().backward()
    # Forward runs addmm and relu once; recomputation in backward runs them again, and the
    # backward kernels (threshold_backward, mm) run too, all on this thread.
    assert rec.ops.count("addmm.default") == 2
    assert rec.ops.count("relu.default") == 2
    assert "threshold_backward.default" in rec.ops
    assert "mm.default" in rec.ops
    assert rec.threads == {threading.get_ident()}


# --------------------------------------------------------------------------------------------
# peak_memory on CPU: hand arithmetic versus measurement
# --------------------------------------------------------------------------------------------


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 1000))


def test_two_linear_layers_peak_matches_hand_arithmetic_to_the_byte():
    model = two_linears()
    x = torch.randn(100, 1000)  # does not require grad
    W = 1000 * 1000 * F32  # 4,000,000: one weight matrix (or its gradient)
    b = 1000 * F32  # 4,000: one bias
    act = 100 * 1000 * F32  # 400,000: one (100, 1000) activation
    scalars = 2 * F32  # the 0-dim loss and the ones tensor that seeds backward

    report = peak_memory(model, (x,))

    # Start: both layers' weights and biases, and the input.
    assert report.start_bytes == 2 * (W + b) + act == 8_408_000
    # The peak comes in the backward of the first layer: all four gradients exist, the gradient
    # flowing into that layer is still alive, and so are the two scalars. Nothing else: the
    # forward activations were freed as backward consumed them, the output was freed once the
    # loss was taken, and F.linear's W.t() is a view of the weight, not new memory.
    assert report.peak_bytes == report.start_bytes + 2 * (W + b) + act + scalars == 16_816_008
    # End: start plus the gradients (the loss is dropped by peak_memory).
    assert report.end_bytes == report.start_bytes + 2 * (W + b)
    assert report.activation_peak_bytes == report.peak_bytes - report.start_bytes
    assert report.device == "cpu"
    assert report.timeline is None


def eight_layer_chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)])


class CheckpointEvery(nn.Module):
    """Runs `chain` with every `k` consecutive layers under one non-reentrant checkpoint."""

    def __init__(self, chain, k):
        super().__init__()
        self.chain, self.k = chain, k

    def forward(self, x):
        for i in range(0, len(self.chain), self.k):
            x = checkpoint(self.chain[i : i + self.k], x, use_reentrant=False)
        return x


CHAIN_INPUT_SHAPE = (2048, 256)
ACT = 2048 * 256 * F32  # 2 MiB: one activation of the chain
LAYER = 256 * 256 * F32 + 256 * F32  # one layer's weight and bias (or their gradients)


def test_eight_layer_chain_peak_matches_hand_arithmetic():
    chain = eight_layer_chain()
    x = torch.randn(*CHAIN_INPUT_SHAPE)
    report = peak_memory(chain, (x,))
    assert report.start_bytes == 8 * LAYER + ACT
    # Each ReLU output is saved (ReLU's backward and the next Linear's backward both use it);
    # the Linear outputs are freed after the ReLU. The peak comes in the last layer's backward:
    # seven saved ReLU outputs, the incoming gradient, the gradient it computes for the layer
    # below, its weight and bias gradients, and the two scalars (loss and backward seed).
    assert report.activation_peak_bytes == 9 * ACT + LAYER + 2 * F32
    assert report.end_bytes == report.start_bytes + 8 * LAYER


def test_checkpointing_every_two_layers_lowers_the_peak():
    chain = eight_layer_chain()
    x = torch.randn(*CHAIN_INPUT_SHAPE)
    plain = peak_memory(chain, (x,))
    planned = peak_memory(CheckpointEvery(chain, 2), (x,))
    # Forward keeps 4 segment inputs instead of 8 ReLU outputs; backward recomputes 2 layers
    # at a time. Measured: about 12.5 MiB above start instead of 18.3 MiB.
    assert planned.peak_bytes < plain.peak_bytes - 2 * ACT
    assert planned.start_bytes == plain.start_bytes
    assert planned.end_bytes == plain.end_bytes  # the same gradients


def test_recomputation_is_counted_checkpointing_everything_saves_nothing_at_the_peak():
    # One checkpoint around the whole chain keeps only its input in forward, but backward
    # recomputes every activation before using them, so the peak is the same as without it.
    # A tracker blind to recomputation would report a far lower peak here.
    chain = eight_layer_chain()
    x = torch.randn(*CHAIN_INPUT_SHAPE)
    plain = peak_memory(chain, (x,))
    whole = peak_memory(CheckpointEvery(chain, 8), (x,))
    assert whole.peak_bytes == plain.peak_bytes


def test_start_bytes_counts_parameters_buffers_inputs_and_constants_exactly():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.bn = nn.BatchNorm1d(10)  # buffers: running mean, var, num_batches_tracked
            self.mask = torch.ones(10)  # a plain attribute, not registered as a buffer

        def forward(self, x, *, bias):
            return self.bn(self.lin(x)) * self.mask + bias

    net = Net()
    x, bias = torch.randn(8, 10), torch.randn(10)
    report = peak_memory(net, (x,), {"bias": bias})
    expected = (
        nbytes(*net.parameters())  # (10*10 + 10) + 10 + 10 floats = 520 bytes
        + nbytes(*net.buffers())  # 10 + 10 floats + one int64 = 88 bytes
        + nbytes(net.mask, x, bias)  # 40 + 320 + 40 bytes
    )
    assert report.start_bytes == expected == 1008


def test_views_of_parameters_and_buffers_are_not_counted_as_new_memory():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(1000, 1000))  # 4 MB
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self):
            return self.table.t().t().reshape(-1)[:4] * self.scale  # views, then 4 floats

    report = peak_memory(Views(), ())
    # Only small tensors are allocated: the product (16 bytes), the loss (4), the backward
    # seed (4) and the gradient of `scale` (16); at most 24 bytes live at once above start.
    # Counting a view of `table` as new memory would add 4,000,000 bytes.
    assert report.activation_peak_bytes == 24


def test_existing_gradients_are_discarded_before_the_step():
    model = two_linears()
    x = torch.randn(100, 1000)
    first = peak_memory(model, (x,))
    second = peak_memory(model, (x,))  # the first step left gradients behind
    assert second == first
    assert all(p.grad is not None for p in model.parameters())


def test_a_leaf_input_that_requires_grad_gets_a_gradient_which_is_counted():
    lin = nn.Linear(100, 100, bias=False)
    x = torch.randn(10, 100, requires_grad=True)
    report = peak_memory(lin, (x,))
    assert report.end_bytes - report.start_bytes == nbytes(lin.weight) + nbytes(x)


def test_timeline_starts_at_start_bytes_and_peaks_at_peak_bytes():
    model = two_linears()
    x = torch.randn(100, 1000)
    report = peak_memory(model, (x,), record_timeline=True)
    assert report.timeline[0] == report.start_bytes
    assert max(report.timeline) == report.peak_bytes
    assert report.timeline[-1] == report.end_bytes
    # First event: the first Linear's output, 100 x 1000 floats.
    assert report.timeline[1] - report.timeline[0] == 100 * 1000 * F32


def test_the_tracker_leaves_no_dispatch_mode_active_even_when_the_step_fails():
    model = two_linears()
    assert dispatch_modes_active() == 0
    peak_memory(model, (torch.randn(2, 1000),))
    assert dispatch_modes_active() == 0
    with pytest.raises(RuntimeError):
        peak_memory(model, (torch.randn(2, 7),))  # wrong width
    assert dispatch_modes_active() == 0


def test_memory_report_is_frozen_and_its_repr_omits_the_timeline():
    report = MemoryReport(10, 4, 6, "cpu", (4, 10, 6))
    assert report.activation_peak_bytes == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.peak_bytes = 0
    assert "timeline" not in repr(report)


# --------------------------------------------------------------------------------------------
# peak_memory on CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_agrees_with_the_cpu_tracker():
    model = two_linears()
    x = torch.randn(100, 1000)
    on_cpu = peak_memory(model, (x,))
    model.cuda()
    x = x.cuda()
    training_step(model, (x,))  # warm up cuBLAS, whose workspace then stays allocated
    on_gpu = peak_memory(model, (x,))
    assert on_gpu.device == f"cuda:{torch.cuda.current_device()}"
    assert on_gpu.timeline is None
    assert on_gpu.start_bytes >= param_bytes(model) + nbytes(x)
    # The caching allocator rounds every block up to a multiple of 512 bytes and may hold
    # small extra buffers; allow 1 MiB of difference on an 8.4 MB activation peak.
    assert abs(on_gpu.activation_peak_bytes - on_cpu.activation_peak_bytes) <= 2**20
    assert abs((on_gpu.end_bytes - on_gpu.start_bytes) - param_bytes(model)) <= 4 * 512


# --------------------------------------------------------------------------------------------
# FLOPs and time
# --------------------------------------------------------------------------------------------


def test_step_flops_matches_hand_count():
    model = two_linears()
    x = torch.randn(100, 1000)  # does not require grad
    matmul = 2 * 100 * 1000 * 1000  # one (100 x 1000) @ (1000 x 1000): a multiply-add is 2
    # Forward: two matmuls. Backward: the weight gradients of both layers, and the input
    # gradient of the second layer only (the input needs no gradient). ReLU and bias count 0.
    assert step_flops(model, (x,)) == 5 * matmul == 1_000_000_000


def test_step_flops_does_not_change_a_later_memory_measurement():
    model = two_linears()
    x = torch.randn(100, 1000)
    before = peak_memory(model, (x,))
    step_flops(model, (x,))
    assert peak_memory(model, (x,)) == before


def test_step_time_is_a_positive_median_and_checks_its_arguments():
    lin = nn.Linear(10, 10)
    seconds = step_time(lin, (torch.randn(4, 10),), repeat=3, warmup=0)
    assert 0 < seconds < 5
    with pytest.raises(ValueError):
        step_time(lin, (torch.randn(4, 10),), repeat=0)


# --------------------------------------------------------------------------------------------
# Predictions that read under the measured peak, found by trying the library (each failed
# before its fix)
# --------------------------------------------------------------------------------------------


def _predicted_and_measured(model, args, choice=()):
    """(the replay's peak, the tracker's) for ``model`` planned with ``choice``."""
    from planner.pipeline import prepare
    from planner.rewrite import rewrite
    from planner.simulate import simulate

    captured, problem = prepare(model, args)
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    return simulate(problem, choice).peak_bytes, peak_memory(planned, args).peak_bytes


@pytest.mark.parametrize("name", ["gpt", "resnet", "mlp"])
def test_a_plan_at_the_stated_minimum_budget_measures_within_it(name):
    """The loss's value and backward's seed (two scalars) are counted: a plan at the minimum
    the infeasible-budget error states measured 8 bytes over it."""
    import re

    import planner

    sizes = {"gpt": {"layers": 2, "d_model": 64, "seq": 32, "batch": 2}}.get(name, {})
    model, inputs = planner.zoo.build(name, **sizes)
    with pytest.raises(planner.PlanningError) as error:
        planner.plan(model, inputs, budget_bytes=1000)
    minimum = int(re.search(r"at least budget_bytes=(\d+)", str(error.value)).group(1))
    p = planner.plan(model, inputs, budget_bytes=minimum)
    assert peak_memory(p.module, inputs).peak_bytes == p.predicted_peak_bytes <= minimum


class _Tagger(nn.Module):
    def __init__(self, rnn: nn.Module, features: int):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.rnn = rnn
        self.head = nn.Linear(features, 100)

    def forward(self, ids):
        hidden = self.rnn(self.embed(ids))[0]
        return self.head(torch.relu(hidden))


@pytest.mark.parametrize(
    "rnn, features, choice",
    [
        (lambda: nn.LSTM(32, 64, batch_first=True), 64, ()),
        (lambda: nn.LSTM(32, 64, batch_first=True), 64, ((1, 3),)),
        (lambda: nn.LSTM(32, 64, num_layers=2, dropout=0.3, batch_first=True), 64, ((1, 3),)),
        (lambda: nn.LSTM(32, 64, bidirectional=True, num_layers=2, batch_first=True), 128, ()),
        (lambda: nn.GRU(32, 64, num_layers=2, batch_first=True), 64, ()),
        (lambda: nn.RNN(32, 64, bidirectional=True, batch_first=True), 128, ()),
    ],
)
def test_recurrent_layers_are_predicted_to_the_byte(rnn, features, choice):
    """On the CPU nn.LSTM runs oneDNN, whose workspace (1.27 MB for LSTM(32, 64) at 8 x 40)
    the fake kernel gives as empty: the step measured 3.3x its prediction. Several layers
    or directions were over-predicted by 2-35%: autograd frees a layer's saved tensors during
    the module's backward, and its forward's temporaries as it goes, where the replay held
    them to the end of each."""
    torch.manual_seed(0)
    model = _Tagger(rnn(), features)
    predicted, measured = _predicted_and_measured(model, (torch.randint(0, 100, (8, 40)),), choice)
    assert measured == predicted


class _Spectrogram(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(65, 65)

    def forward(self, audio):
        window = torch.hann_window(128)  # a constant of the graph, on 129 floats of storage
        spec = torch.stft(audio, 128, hop_length=32, window=window, return_complex=True)
        return self.proj(spec.abs().transpose(1, 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda: (_Spectrogram(), torch.randn(8, 4096)),
        lambda: (nn.EmbeddingBag(1000, 64, mode="mean"), torch.randint(0, 1000, (256, 16))),
        lambda: (nn.EmbeddingBag(1000, 64, mode="max"), torch.randint(0, 1000, (256, 16))),
    ],
)
def test_stft_and_embedding_bag_are_predicted_to_the_byte(make):
    """The window's storage holds one float more than its elements span (+4 bytes), and the
    CPU EmbeddingBag makes its offset2bag one index longer (+8 bytes): both were under."""
    torch.manual_seed(0)
    model, x = make()
    predicted, measured = _predicted_and_measured(model, (x,))
    assert measured == predicted


class _Patches(nn.Module):
    """``F.unfold`` (im2col) then ``F.fold`` (col2im) of 3 x 3 patches, or unfold alone,
    whose backward is col2im."""

    def __init__(self, fold: bool):
        super().__init__()
        self.fold = fold
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 16)

    def forward(self, x):
        columns = F.unfold(torch.tanh(self.a(x)).view(-1, 4, 8, 8), 3, padding=1)
        image = F.fold(columns, (8, 8), 3, padding=1) if self.fold else columns.sum(1).repeat(1, 4)
        return self.b(image.reshape(x.shape[0], 256))


@pytest.mark.parametrize("fold", [False, True], ids=["unfold", "fold"])
def test_col2im_is_predicted_with_the_columns_sized_storage_its_cpu_kernel_returns(fold):
    """The CPU col2im makes its result like its input, the columns, then resizes it to the
    image: 9x its size here. Found trying the library: a plan at the baseline's budget
    measured 200,776 bytes over it."""
    torch.manual_seed(0)
    predicted, measured = _predicted_and_measured(_Patches(fold), (torch.randn(256, 256),))
    assert measured <= predicted < 1.01 * measured


class _NormedAcross(nn.Module):
    """BatchNorm over a dimension the input does not hold densely: a sequence model's
    BatchNorm1d on ``x.transpose(1, 2)``, or a BatchNorm2d on a permuted image that is not
    channels-last."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.lin = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        norm = nn.BatchNorm1d if layout == "sequence" else nn.BatchNorm2d
        self.bn = nn.ModuleList(norm(32) for _ in range(4))

    def forward(self, x):
        for lin, bn in zip(self.lin, self.bn):
            if self.layout == "image":  # (B, H, C, W) -> (B, C, H, W)
                x = torch.tanh(bn(lin(x.transpose(2, 3)).transpose(2, 3).transpose(1, 2)))
                x = x.transpose(1, 2)
            elif self.layout == "sequence":  # (B, T, C) -> (B, C, T) and back
                x = torch.tanh(bn(lin(x).transpose(1, 2)).transpose(1, 2))
            else:  # (B, T, C) -> (B, C, T, 1): channels-last and contiguous at once
                y = bn(lin(x).transpose(1, 2).unsqueeze(-1)).squeeze(-1)
                x = torch.tanh(y.reshape(y.shape[0], -1)).view_as(y).transpose(1, 2)
        return x


@pytest.mark.parametrize("layout", ["sequence", "image", "sequence as an image"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_of_a_transposed_input_is_predicted_with_the_dense_result_of_its_kernel(
    layout, training
):
    """The CPU kernels return (and backward's input gradient) dense in the layout they pick;
    the fake kernels kept the input's strides, so the profile missed the copies the real
    graph then makes. Found trying the library: 25% over the prediction (34% unplanned); and
    by review, a first fix that took torch's Python ``suggest_memory_format`` for the kernel's
    choice: 7.4% over where a size-1 dimension makes the input channels-last too."""
    torch.manual_seed(0)
    model = _NormedAcross(layout).train(training)
    x = torch.randn(8, 6, 32, 4) if layout == "image" else torch.randn(16, 24, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eval mode warns
        for choice in [(), [(0, 2)], [(2, 9)]]:
            x = x.detach().requires_grad_()  # no gradient held from the call before
            predicted, measured = _predicted_and_measured(model, (x,), choice)
            assert measured == predicted, choice


@pytest.mark.parametrize("wrap", [nn.utils.spectral_norm, nn.utils.weight_norm])
def test_hook_based_weight_norms_are_named_with_their_replacement(wrap):
    """The old hook-based forms store the weight they compute on the module, which the
    profile does not follow (66 KB over a plan's prediction with six 64x64 layers)."""
    import warnings

    from planner.pipeline import prepare

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's own deprecation
        model = nn.Sequential(wrap(nn.Linear(64, 64)), nn.ReLU(), wrap(nn.Linear(64, 64)))
    with pytest.warns(UserWarning, match=f"0, 2 .*parametrizations.{wrap.__name__} instead"):
        prepare(model, (torch.randn(32, 64),))


class _InPlaceOnViews(nn.Module):
    """In-place ops on views whose incoming gradient stays alive without them: a feature
    dropout on a reshaped activation the model returns (its gradient is the loss's, expanded),
    and Linear layers' 3-d outputs (views of their addmm) scaled in place on a residual path,
    as timm's ``LayerScale(inplace=True)``."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.fc3, self.fc4 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        if self.how == "dropout1d":
            h = self.fc1(x.flatten(0, 1))
            return F.dropout1d(h.view(h.shape[0], 256, 1), 0.2, True, inplace=True).view_as(h)
        x = x + self.fc2(self.drop(torch.tanh(self.fc1(x)))).mul_(2.0)
        return x + self.fc4(self.drop(torch.tanh(self.fc3(x)))).mul_(2.0)


@pytest.mark.parametrize(
    "how, choice",
    [("dropout1d", ()), ("mul_", ()), ("mul_", ((0, 6), (6, 8))), ("mul_", ((0, 3), (6, 9)))],
)
def test_in_place_ops_on_views_are_predicted_to_the_byte(how, choice):
    """Eager backward regenerates a view written in place by ``as_strided``, whose gradient
    is a new tensor of the base's size, where the profile's fake tensors replay the view: the
    replay read one such tensor under the measured peak (found trying the library: 6% at the
    baseline, 11% over a plan's budget). And the Linear's ``AddmmBackward0``, behind the
    in-place op's ``CopySlices``, was charged to the in-place op, before the segment's
    recompute, where it runs after it (5% over)."""
    torch.manual_seed(0)
    model, x = _InPlaceOnViews(how).train(), torch.randn(16, 32, 64)
    predicted, measured = _predicted_and_measured(model, (x,), choice)
    assert measured == predicted


class _FusedSquare(torch.autograd.Function):
    """``h * h`` with its gradient computed in forward, saved and returned, scaled in place,
    as fused losses do."""

    @staticmethod
    def forward(ctx, h):
        gradient = 2 * h
        ctx.save_for_backward(gradient)
        return h * h

    @staticmethod
    def backward(ctx, g):
        (gradient,) = ctx.saved_tensors
        return gradient.mul_(g)


class _Squares(nn.Module):
    def forward(self, y):
        return _FusedSquare.apply(y)


class _FusedSquareBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.square = _Squares()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x + (self.square(layer(x)) if i % 2 else torch.tanh(layer(x)))
        return x


@pytest.mark.parametrize(
    "choice",
    [
        ((0, 12),),
        ((0, 4), (4, 8)),
        "nested: [0, 12) holding [3, 6) and [9, 12)",
        "nested: [0, 12) holding [0, 6) holding [3, 6)",
    ],
)
def test_a_gradient_a_custom_function_saved_in_forward_is_held_until_it_is_consumed(choice):
    """A custom function's backward that returns the tensor it saved as its input's gradient
    hands that storage on to the next backward function: the replay freed it with the
    function's saved tensors (found by review: nested plans 4.8% under the measured peak)."""
    from planner import CaptureOptions
    from planner.nested import Nest, NestedChoice
    from planner.pipeline import prepare
    from planner.rewrite import rewrite
    from planner.simulate import simulate

    if choice == "nested: [0, 12) holding [3, 6) and [9, 12)":
        choice = NestedChoice((Nest(0, 12, (Nest(3, 6), Nest(9, 12))),))
    elif choice == "nested: [0, 12) holding [0, 6) holding [3, 6)":
        choice = NestedChoice((Nest(0, 12, (Nest(0, 6, (Nest(3, 6),)),)),))
    torch.manual_seed(0)
    model, x = _FusedSquareBlocks(), torch.randn(32, 64)
    options = CaptureOptions(leaf_modules=(_Squares,))
    captured, problem = prepare(model, (x,), capture_options=options)
    assert problem.names[4] == "square"  # the blocks' nodes: layer, square or tanh, add
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, (x,)).peak_bytes == simulate(problem, choice).peak_bytes


class _AttentionBlock(nn.Module):
    """``nn.MultiheadAttention``, which fx keeps whole: one node, a dozen backward functions."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(32, 4)

    def forward(self, x):
        return torch.tanh(x + self.attention(x, x, x, need_weights=False)[0])


class _NormBlock(nn.Module):
    """``nn.RMSNorm`` is a composite op: several backward functions for one node."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(32, 32), nn.RMSNorm(32)

    def forward(self, x):
        return torch.tanh(self.norm(self.linear(x)))


@pytest.mark.parametrize(
    "block, shape, choice",
    [
        (_AttentionBlock, (12, 16, 32), ()),
        (_AttentionBlock, (12, 16, 32), ((0, 4),)),
        (_AttentionBlock, (12, 16, 32), ((4, 12),)),
        (_NormBlock, (256, 32), ()),
        (_NormBlock, (256, 32), ((0, 3), (3, 9))),
    ],
)
def test_a_node_with_many_backward_functions_frees_its_saved_tensors_one_by_one(
    block, shape, choice
):
    """Each backward function drops what it unpacked as it returns and what it saved as
    autograd releases it: the replay held them all to the end of the node's backward
    (found trying the library: 14-29% over on MultiheadAttention, 6-12% on RMSNorm)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[block() for _ in range(3)]).train(), torch.randn(*shape)
    predicted, measured = _predicted_and_measured(model, (x,), choice)
    assert measured == predicted


class _KeptOnContext(torch.autograd.Function):
    """A matmul that keeps its inputs as attributes of its context, not through
    ``save_for_backward`` (the older pattern): the graph holds them as long as the function."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x @ w

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w.t(), ctx.x.t() @ g


class _ContextBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 48) * 0.1)
        self.l1, self.l2 = nn.Linear(48, 96), nn.Linear(96, 48)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(_KeptOnContext.apply(x, self.w))))


@pytest.mark.parametrize("choice", [(), ((1, 3),)])
def test_tensors_a_function_inside_a_module_kept_whole_keeps_on_its_context_are_held(choice):
    """Such tensors were counted only for functions whose output the node returns: inside a
    module kept whole they were not held at all (found by review: 3-5% under the measured
    peak once its saved tensors were freed function by function)."""
    from planner import CaptureOptions
    from planner.pipeline import prepare
    from planner.rewrite import rewrite
    from planner.simulate import simulate

    torch.manual_seed(0)
    model = nn.Sequential(*[_ContextBlock() for _ in range(3)], nn.LayerNorm(48))
    x = torch.randn(40, 48)
    options = CaptureOptions(leaf_modules=(_ContextBlock,))
    captured, problem = prepare(model, (x,), capture_options=options)
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, (x,)).peak_bytes == simulate(problem, choice).peak_bytes


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gru, self.b = nn.Linear(32, 32), nn.GRU(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(self.gru(torch.tanh(self.a(x)))[0]).tanh()


def test_a_recompute_stopping_inside_a_node_holds_its_temporaries_as_at_its_last_save():
    """A recompute stops at a node's last save, inside the GRU here, before it makes its
    outputs: its temporaries are then as they were at that moment, not as at the forward's
    high point less all it keeps (found trying the library: 2 KiB under the measured peak)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_Recurrent(), _Recurrent()).train(), torch.randn(12, 16, 32)
    predicted, measured = _predicted_and_measured(model, (x,), ((0, 4), (4, 7), (7, 9), (9, 12)))
    assert measured == predicted


def test_measuring_a_step_on_the_meta_device_is_refused_not_read_as_zero():
    """Found by a tester: ``peak_memory`` of a meta model returned 0 bytes."""
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device, where nothing is allocated"):
        peak_memory(model, (torch.empty(2, 4, device="meta"),))
