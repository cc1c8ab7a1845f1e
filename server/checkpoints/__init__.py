"""Durable session checkpoints: the on-disk store (`checkpoint_store`, with its write and read
sides `publish` and `verify`, its eviction `quota`), when to save and how to restore (`manager`),
what the Responses routes tell the checkpointer (`hooks`) and the wiring into `./ninfer serve`
(`setup`). Format and protocol: docs/checkpoints.md."""
