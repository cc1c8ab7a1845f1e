"""The pure-JAX references and data formats that the model and the kernels share: weight
formats and the reference matmul (`quant`), the norms (`norms`), attention's softmax and RoPE
(`attention`), the gated delta rule and the GDN step between its projections (`gdn`), the
paged KV pool's format and reference paths (`paged_kv`). They import no kernel and no model
module: a kernel's `_ref` is one of these, or is built from them."""
