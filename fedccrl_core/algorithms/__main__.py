"""`python -m fedccrl_core.algorithms`: print docs/hyperparameters.md, the table of every registered algorithm's
declared hyperparameters (`make hyperparameters-doc` writes it)."""
from fedccrl_core.algorithms import ALGORITHMS
from fedccrl_core.hparams import markdown

print(markdown({name: cls.Params for name, cls in ALGORITHMS.items()}), end="")
