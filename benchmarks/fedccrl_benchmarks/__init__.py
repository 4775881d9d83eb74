"""The benchmarks behind `fedccrl-bench` (benchmarks/fedccrl_benchmarks/cli.py). `fedccrl-bench speed`: the fast engine path against a plain
baseline, in one process on one device.

plain.py is the baseline (used only here and in its tests); speed.py measures both (speed_paths.py,
speed_timing.py, on speed_data.py's data) and builds the table (speed_table.py).
"""
