"""Let the CPU torch import torchvision 0.28.0, in tests only (never in the library).

The only torchvision 0.28.0 wheel (the release matching torch 2.13) served to this project is a
CUDA build: its compiled operators do not load beside the CPU torch, and importing torchvision
then fails where it registers Python kernels for ``torchvision::nms`` (``operator
torchvision::nms does not exist``). transformers imports torchvision whenever it is installed
(``image_utils``), so with it installed every transformers model would fail to import, and timm
imports it too. Defining the two operator schemas before the import lets the pure-Python models
build; nothing here calls those operators.
"""

from __future__ import annotations

import importlib.metadata

import torch

_LIBRARIES: list = []  # a Library undefines its operators when collected: kept for the process


def define_torchvision_operators() -> None:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` where a CUDA build of torchvision
    sits beside a CPU torch (call before anything imports torchvision)."""
    if _LIBRARIES or torch.version.cuda is not None:
        return  # defined already, or a CUDA torch: its torchvision loads its own operators
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return
    if "+cpu" in version:
        return  # a CPU build loads its operators
    library = torch.library.Library("torchvision", "FRAGMENT")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define(
        "qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point)"
        " -> Tensor"
    )
    _LIBRARIES.append(library)
