"""ImageNet's channel mean and std: the normalization of every backbone here (torchvision's weights expect it)
and the default of params.yaml `preprocess.mean`/`std`. Plain numbers, no torch: params.yaml's validation reads them.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
