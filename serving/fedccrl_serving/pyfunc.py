"""The MLflow pyfunc flavour of an exported model: raw images in, class names and probabilities out.

Input: uint8 HWC images, as one array [N, H, W, 3] (or one image [H, W, 3]), or image file paths (a list of
str, or a DataFrame with a `path` column). Each image goes through the training eval transform recorded in the
ONNX metadata (fedccrl_serving.preprocess: resize to S x S, then normalize), so any H x W is accepted.
Output: a DataFrame with one row per image: `class` (top-1 class name), `probability` (its softmax
probability) and one `p_<class>` column per class. The logged model carries the onnx flavour too (the plain
`images` -> `logits` graph), read from the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mlflow.pyfunc import PythonModel

ONNX_ARTIFACT = "onnx_model"  # the key of the .onnx file among the pyfunc's artifacts


def _images(model_input) -> tuple[np.ndarray | None, list[str] | None]:
    """(uint8 [N, H, W, 3] array, None) or (None, file paths)."""
    import pandas as pd

    if isinstance(model_input, dict) and len(model_input) == 1:  # a named tensor input {"images": array}
        model_input = next(iter(model_input.values()))
    if isinstance(model_input, pd.DataFrame):
        if "path" not in model_input.columns:
            raise ValueError(f"a DataFrame input needs a 'path' column of image files; got {list(model_input.columns)}")
        return None, [str(p) for p in model_input["path"]]
    if isinstance(model_input, (str, Path)):
        return None, [str(model_input)]
    if isinstance(model_input, (list, tuple)) and model_input and all(isinstance(p, (str, Path)) for p in model_input):
        return None, [str(p) for p in model_input]
    x = np.asarray(model_input)
    if x.dtype.kind in "UO":
        return None, [str(p) for p in x.ravel()]
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W, 3] (or one [H, W, 3]); got {x.dtype} {list(x.shape)}")
    return x, None


class ImageClassifier(PythonModel):
    """Wraps fedccrl_serving.runtime.ServedModel (onnxruntime on the CPU) with the serving preprocessing."""

    def load_context(self, context):
        from fedccrl_serving.runtime import ServedModel

        self.model = ServedModel(Path(context.artifacts[ONNX_ARTIFACT]), device="cpu")

    def predict(self, context, model_input, params=None):
        import pandas as pd
        from PIL import Image

        from fedccrl_core.data.images import resize_u8
        from fedccrl_serving.preprocess import load_u8, normalize
        from fedccrl_serving.runtime import softmax

        meta = self.model.meta
        x, paths = _images(model_input)
        size = meta.image_size
        if paths is not None:
            batch = np.stack([load_u8(p, size) for p in paths]) if paths else np.zeros((0, size, size, 3), np.uint8)
        else:
            assert x is not None  # _images gives an array or file paths
            batch = x if x.shape[1:3] == (size, size) else np.stack([resize_u8(Image.fromarray(im), size) for im in x])
        probs = softmax(self.model.logits(normalize(batch, meta)))
        top = probs.argmax(1) if len(probs) else np.zeros(0, int)
        out = pd.DataFrame(
            {"class": [meta.classes[i] for i in top], "probability": probs[np.arange(len(top)), top].astype(np.float64)}
        )
        for i, name in enumerate(meta.classes):
            out[f"p_{name}"] = probs[:, i].astype(np.float64)
        return out


def signature(classes, example_u8: np.ndarray):
    """uint8 images [-1, -1, -1, 3] -> (class, probability, p_<class>...)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, Schema, TensorSpec

    inputs = Schema([TensorSpec(np.dtype(np.uint8), (-1, -1, -1, 3), "images")])
    outputs = Schema(
        [ColSpec("string", "class"), ColSpec("double", "probability"), *[ColSpec("double", f"p_{c}") for c in classes]]
    )
    return ModelSignature(inputs=inputs, outputs=outputs)
