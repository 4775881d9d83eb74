"""Federation (floor 3): the one round loop of Algorithm 1 (loop.py) over a transport (engine.py:
in-process; fedccrl_flower: Flower), round checkpoints (checkpoints.py) and client interleaving
on CUDA streams (concurrent.py). Eq. 2 itself is on floor 1 (fedccrl_core/learning/aggregation.py)."""
