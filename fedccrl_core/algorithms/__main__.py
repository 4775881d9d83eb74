"""`python -m fedccrl_core.algorithms`: print the hyperparameters page of the documentation site, the table of
every registered algorithm's declared hyperparameters (`make docs` generates the page from the same function)."""
from fedccrl_core.algorithms import ALGORITHMS
from fedccrl_core.hparams import markdown

print(markdown({name: cls.Params for name, cls in ALGORITHMS.items()}), end="")
