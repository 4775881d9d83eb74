"""Backbones split as encoder h and classifier g, f = g . h (FedCCRL section 3.2, Eq. 4-5).

g is always the last linear layer of the backbone (paper section 4.2: "the final fully connected
layer acts as the classifier g, and the preceding layers serve as the representation encoder h").


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedccrl_core.foundation.backbone_names import BACKBONES


class FedModel(nn.Module):
    """f = g . h with h: images -> representation Z [B, V], g: Z -> logits [B, num_classes]."""

    def __init__(self, h: nn.Module, g: nn.Linear):
        super().__init__()
        self.h = h
        self.g = g

    @property
    def feature_dim(self) -> int:
        return self.g.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(self.h(x))


class SmallCNN(nn.Module):
    """A small BatchNorm CNN encoder for the CPU default (embedded synthetic dataset)."""

    def __init__(self, widths=(16, 32, 64, 64)):
        super().__init__()
        layers, c_in = [], 3
        for i, c in enumerate(widths):
            layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_dim = c_in

    def forward(self, x):
        return torch.flatten(self.pool(self.features(x)), 1)


class _TorchvisionEncoder(nn.Module):
    """Everything of a torchvision classifier except its last Linear layer."""

    def __init__(self, net: Any, kind: str):  # a torchvision model (torchvision ships no types)
        super().__init__()
        self.kind = kind
        if kind == "mobilenet_v3_large":
            self.features, self.avgpool = net.features, net.avgpool
            self.head = nn.Sequential(*list(net.classifier.children())[:-1])  # Linear 960->1280, Hardswish, Dropout
        else:  # resnet
            net.fc = nn.Identity()
            self.net = net

    def forward(self, x):
        if self.kind == "mobilenet_v3_large":
            return self.head(torch.flatten(self.avgpool(self.features(x)), 1))
        return self.net(x)


class PretrainedWeightsError(RuntimeError):
    pass


def _torchvision_net(backbone: str, pretrained: str):
    import torchvision.models as tvm

    ctor = {"mobilenet_v3_large": tvm.mobilenet_v3_large, "resnet18": tvm.resnet18, "resnet50": tvm.resnet50}[backbone]
    net = ctor(weights=None)
    if pretrained == "none":
        return net
    if pretrained == "imagenet":
        enum = {
            "mobilenet_v3_large": tvm.MobileNet_V3_Large_Weights,
            "resnet18": tvm.ResNet18_Weights,
            "resnet50": tvm.ResNet50_Weights,
        }[backbone]
        try:
            state = enum.DEFAULT.get_state_dict(progress=False)
        except Exception as e:  # network refused, no cache
            raise PretrainedWeightsError(
                f"model.pretrained=imagenet: cannot fetch torchvision weights {enum.DEFAULT} ({e.__class__.__name__}: {e}). "
                "Download them elsewhere and set model.pretrained to the local .pth path, or use model.pretrained=none."
            ) from e
    else:
        path = Path(pretrained)
        if not path.is_file():
            raise PretrainedWeightsError(f"model.pretrained={pretrained!r}: no such weights file")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise PretrainedWeightsError(f"model.pretrained={pretrained!r}: not a readable state_dict ({e})") from e
        state = state.get("state_dict", state)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith(("fc.", "classifier.3."))]:
        raise PretrainedWeightsError(
            f"model.pretrained={pretrained!r} does not fit {backbone}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return net


def build_model(backbone: str, num_classes: int, pretrained: str = "none") -> FedModel:
    """Build f = g . h. pretrained: 'imagenet' | 'none' | path to a torchvision state_dict."""
    if backbone not in BACKBONES:
        raise ValueError(f"model.backbone: unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
    if backbone == "small_cnn":
        if pretrained != "none":
            raise PretrainedWeightsError("model.pretrained: small_cnn has no pretrained weights; use 'none'")
        h = SmallCNN()
        return FedModel(h, nn.Linear(h.out_dim, num_classes))
    net = _torchvision_net(backbone, pretrained)
    last = net.classifier[-1] if backbone == "mobilenet_v3_large" else net.fc
    return FedModel(_TorchvisionEncoder(net, backbone), nn.Linear(last.in_features, num_classes))
