"""Foundation (floor 0, docs/architecture.md "Layers"): errors, the hyperparameter declarations, seeds, threads, processes, safe file
writes, the names several layers share, and the run key; no model, no data."""
