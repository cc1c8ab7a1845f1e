"""The inference engine. Importing it sets the engine's XLA defaults (below) before JAX starts
its backend."""
from __future__ import annotations

import os

# XLA's command buffers (CUDA graphs) for the decode step: custom calls (the int4 GEMV, the
# Pallas kernels) join the graphs and graphs of any length are made. On the H200 (v10,
# docs/benchmarks/README.md) this takes the 27B C1 1K decode step from 9.48 ms with XLA's
# defaults to 9.09 ms (and 9.13 ms with no graphs at all). Flags given in XLA_FLAGS that name
# command buffers win; NINFER_XLA_GRAPHS=xla keeps XLA's defaults. CPU backends ignore them.
GPU_GRAPH_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                   "--xla_gpu_graph_min_graph_size=1")


def _set_xla_defaults() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" in flags or os.environ.get("NINFER_XLA_GRAPHS") == "xla":
        return
    os.environ["XLA_FLAGS"] = f"{flags} {GPU_GRAPH_FLAGS}".strip()


_set_xla_defaults()
