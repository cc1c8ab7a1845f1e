"""The model: its config and parameters, the caches, and the forward, whose layers choose
each implementation by the kernel plan (engine/plan.py) between the references (engine/ops/)
and the kernels (engine/kernels/)."""
