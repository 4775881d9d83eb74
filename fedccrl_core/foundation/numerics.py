"""Which kernels made a run's numbers.

Training is bit-identical on one machine (resume, engines, reruns), but not across machines: oneDNN, MKL
and ATen pick their float32 kernels by the CPU's instruction set, so sums round differently on an AVX2
CPU than on an AVX-512 one, and a few test images of 240 flip after 10 rounds. Every trained model records
this description, and the report prints it under its table, so a number always carries its platform.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import platform

# the variables that force a reduced instruction set (ATen's, oneDNN's, MKL's); each set one is recorded
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def numeric_platform(device: str = "cpu") -> str:
    """One line, e.g. 'cpu x86_64 AVX2, torch 2.14.1+cu130' or 'cuda NVIDIA H100 80GB HBM3, torch ...'."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        where = f"cuda {torch.cuda.get_device_name(torch.device(device))}"
    else:
        where = f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    forced = [f"{k}={os.environ[k]}" for k in ISA_VARIABLES if os.environ.get(k)]
    return f"{where}{' (' + ' '.join(forced) + ')' if forced else ''}, torch {torch.__version__}"
