"""fedccrl_core: the federated domain generalization library (no DVC, MLflow or click inside).

Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

__version__ = "0.1.0"
