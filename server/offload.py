"""CPU-heavy request work off the event loop, with a bound on what one principal occupies.

Parsing a large JSON body, rendering a conversation and tokenizing it take time in proportion
to the request (a 31 MB chat message: ~30 s of tokenization). On the event loop that time
stops every other request, `/health` included. Here it runs on worker threads (the tokenizer
and the JSON parser release little of the GIL, but the loop still gets its turns), and each
principal has PER_PRINCIPAL such tasks at a time: one client's large requests queue behind
each other instead of taking every worker thread."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

PER_PRINCIPAL = 2
INLINE_BYTES = 64 * 1024  # a body this small is parsed on the loop: a thread costs more

_slots: dict[str, asyncio.Semaphore] = {}


@asynccontextmanager
async def slot(principal: str):
    """Hold one of the principal's PER_PRINCIPAL slots for heavy request work."""
    sem = _slots.get(principal)
    if sem is None:
        sem = _slots[principal] = asyncio.Semaphore(PER_PRINCIPAL)
    async with sem:
        yield


async def run(fn, *args, size: int | None = None):
    """fn(*args) on a worker thread, or inline when `size` (the input's bytes) is small."""
    if size is not None and size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
