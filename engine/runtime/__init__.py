"""Host-side memory managers: KV page ownership (`pages`), recurrent-state images (`states`),
and the retention rule that decides what to keep (`retention`)."""
from engine.runtime.pages import CopyPlan, PageAllocator, PagesExhausted, PageTable
from engine.runtime.retention import Role, retention_score, retention_weight
from engine.runtime.states import StateImage, StatePool, StatePoolError, Tier

__all__ = ["CopyPlan", "PageAllocator", "PagesExhausted", "PageTable", "Role", "retention_score",
           "retention_weight", "StateImage", "StatePool", "StatePoolError", "Tier"]
