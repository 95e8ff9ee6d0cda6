"""Small torchvision and timm models (random weights, train mode) for the vision matrix.

torchvision and timm are not in the ``test`` extra (see docs/huggingface.md, "Vision models"):
install them with ``.venv/bin/pip install --no-deps torchvision==0.28.0 timm==1.0.31``. The
tests skip without them. ``tests/torchvision_shim.py`` (run by conftest) lets the CPU torch
import torchvision.
"""

from __future__ import annotations

import pytest
import torch

torchvision = pytest.importorskip(
    "torchvision",
    reason="torchvision is not installed: pip install --no-deps torchvision==0.28.0 timm==1.0.31",
)
timm = pytest.importorskip(
    "timm", reason="timm is not installed: pip install --no-deps timm==1.0.31"
)


def _classifier(build, **options):
    def make(batch=2, size=64):
        torch.manual_seed(0)
        model = build(**options).train()
        return model, (torch.randn(batch, 3, size, size),), {}

    return make


def _torchvision(name, **options):
    return _classifier(getattr(torchvision.models, name), weights=None, **options)


def _segmentation(name):
    return _classifier(
        getattr(torchvision.models.segmentation, name),
        weights=None,
        weights_backbone=None,
        num_classes=5,
        aux_loss=False,
    )


def _timm(name, **options):
    return _classifier(timm.create_model, model_name=name, pretrained=False, **options)


MODELS = {
    "resnet18": _torchvision("resnet18", num_classes=10),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small", num_classes=10),
    "efficientnet_b0": _torchvision("efficientnet_b0", num_classes=10),
    "shufflenet_v2_x0_5": _torchvision("shufflenet_v2_x0_5", num_classes=10),
    "regnet_y_400mf": _torchvision("regnet_y_400mf", num_classes=10),
    "densenet121": _torchvision("densenet121", num_classes=10),
    "convnext_tiny": _torchvision("convnext_tiny", num_classes=10),
    "swin_t": _torchvision("swin_t", num_classes=10),
    "vit_b_16": _torchvision("vit_b_16", num_classes=10, image_size=64),
    "deeplabv3_mobilenet": _segmentation("deeplabv3_mobilenet_v3_large"),
    "fcn_resnet50": _segmentation("fcn_resnet50"),
    "timm_vit_tiny": _timm("vit_tiny_patch16_224", img_size=64, num_classes=10),
    "timm_deit_tiny": _timm("deit_tiny_patch16_224", img_size=64, num_classes=10),
    "timm_resnet26d": _timm("resnet26d", num_classes=10),
    "timm_swin": _timm("swin_tiny_patch4_window7_224", img_size=64, window_size=2, num_classes=10),
}
