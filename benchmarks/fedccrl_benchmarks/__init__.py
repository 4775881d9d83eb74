"""The benchmarks behind `fedccrl-bench` (benchmarks/fedccrl_benchmarks/cli.py). `fedccrl-bench speed`: the fast engine path against a plain
baseline, in one process on one device.

plain.py is the baseline (used only here and in its tests); speed.py measures both and builds the table.
"""
