"""Durable session checkpoints: the on-disk store (`checkpoint_store`, with its write and read
sides `publish` and `verify`, its eviction `quota`), when to save and how to restore (`manager`)
and the wiring into `./ninfer serve` (`setup`); what the Responses routes tell the checkpointer
is server/chains.py's `checkpoint_*`. Format and protocol: docs/checkpoints.md."""
