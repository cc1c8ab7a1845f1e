"""Constrained decoding (llguidance): tool_choice, text.format JSON, thinking budgets.

The server builds one `compiler.ConstraintCompiler(model.tokenizer)` per loaded model and calls
`compile(...)` per request; the result (None: unconstrained) goes into
`GenerationRequest.constraint`. See docs/constrained_decoding.md. Import the submodules
(`compiler`, `constraint`, `grammar`) directly: this package re-exports nothing.
"""
