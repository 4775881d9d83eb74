"""serving: `fedccrl-serve` and the MLflow pyfunc on an exported fedccrl ONNX model, without torch.

The exported file carries its own preprocessing (input size, mean/std, resize policy) and class names as ONNX
metadata (serving/fedccrl_serving/metadata.py), so serving needs nothing but the .onnx file. One module per job
(docs/architecture.md, "The edges"); the exporter, which needs torch, is pipeline/fedccrl_pipeline/onnx_export.py.
"""
