"""Figures (FedCCRL Fig. 3, 5, 7 and per-round curves): data computed here, drawn with matplotlib (Agg).

Floor 4 of fedccrl_core (docs/architecture.md, "Layers")."""

import matplotlib

matplotlib.use("Agg")
