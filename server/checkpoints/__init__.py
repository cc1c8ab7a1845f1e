"""Durable session checkpoints: the on-disk store (`checkpoint_store`), when to save and how to
restore (`manager`), the HTTP hooks (`http`) and the wiring into `./ninfer serve` (`setup`).
Format and protocol: docs/checkpoints.md."""
