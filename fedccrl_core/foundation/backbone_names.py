"""The backbones fedccrl_core/learning/models.py builds (`model.backbone`), by name. Plain names, no torch: params.yaml's
validation reads them.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

BACKBONES = ("small_cnn", "mobilenet_v3_large", "resnet18", "resnet50")
