"""Constrained decoding (llguidance): tool_choice, text.format JSON, thinking budgets.

The server builds one `ConstraintCompiler(model.tokenizer)` per loaded model and calls
`compile(...)` per request; the result (None: unconstrained) goes into
`GenerationRequest.constraint`. See docs/constrained_decoding.md.
"""
from engine.constrain.compiler import ConstraintCompiler, ConstraintError
from engine.constrain.constraint import Constraint, ConstraintViolation

__all__ = ["Constraint", "ConstraintCompiler", "ConstraintError", "ConstraintViolation"]
