"""serving: `fedccrl-serve` and the MLflow pyfunc on an exported fedccrl ONNX model, without torch.

The exported file carries its own preprocessing (input size, mean/std, resize policy) as ONNX metadata
(serving.metadata), so serving needs nothing but the .onnx file. One module per job: metadata (the format),
preprocess (the training eval transform in numpy), runtime (ONNX Runtime), inputs (files and folders read),
report (evaluate's report), console (stderr), cli (the click commands), pyfunc (the MLflow flavour). The exporter,
which needs torch, is pipeline/onnx_export.py.
"""
