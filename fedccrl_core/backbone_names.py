"""The backbones fedccrl_core/models.py builds (`model.backbone`), by name. Plain names, no torch: params.yaml's
validation reads them.
"""
BACKBONES = ("small_cnn", "mobilenet_v3_large", "resnet18", "resnet50")
