"""The inference engine: the model and its kernels (each chosen by a kernel plan,
engine/plan.py), the artifact format and loader, the tokenizer and chat template, and the
serving runtime (engine/engine.py)."""
