"""The block table a step reads is the one the host had when it dispatched the step.

On the CPU backend `jax.device_put` (and `jnp.asarray`) may alias a 64-byte-aligned numpy
buffer rather than copy it, and the step reads it only when it runs. The engine's `Memory`
keeps one numpy block table and rewrites a row in place for each step (a page appended, a
copy-on-write page swapped in). A step still queued behind the last one would then read the
next step's rows: a prefill piece's K/V went to the page the following piece's `prepare` put in
the row, and the shared prefix's own page kept zeros (the role corpus's tools-06 answered
differently from one engine to the next).

The test pins the conditions instead of waiting for them: the table is placed at a 64-byte
boundary and the CPU is kept busy while the host writes the next row."""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import TEST_SMALL
from engine.runtime.memory import Memory
from engine.runtime.pages import PageTable


def _aligned_like(a: np.ndarray) -> np.ndarray:
    raw = np.zeros(a.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == 0
    return out


def test_a_queued_step_reads_the_rows_it_was_given_not_the_next_steps():
    mem = Memory(TEST_SMALL, batch=2, context_tokens=2048, capacity_tokens=4096,
                 kv_dtype=jnp.float32, conv_dtype=jnp.float32, state_slots=2,
                 host_state_bytes=0)
    mem.table = _aligned_like(mem.table)
    busy = jax.jit(lambda x: (x @ x @ x @ x).sum())
    big = jnp.ones((1024, 1024), jnp.float32)
    busy(big).block_until_ready()
    seq = SimpleNamespace(table=PageTable(mem.alloc), slot=0)
    given, read = [], []
    for _ in range(8):  # one page a step
        pending = busy(big)  # the device is still on the last step when the host moves on
        mem.prepare([seq], mem.page_size)
        given.append(mem.table[0].copy())
        read.append(mem.cache.block_table)  # what this step's forward is handed
        pending.block_until_ready()
    for k, (want, got) in enumerate(zip(given, read)):
        np.testing.assert_array_equal(np.asarray(got)[0], want, err_msg=f"step {k}")
    assert len(seq.table.pages) == 8
