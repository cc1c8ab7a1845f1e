"""Host-side memory managers and the serving loop's parts: KV page ownership (`pages`),
recurrent-state images (`states`), the retention rule that decides what to keep (`retention`),
the prefix index, the scheduler, `memory` tying them to the device cache, the executable store
and per-request sampling (`sampling`). Import the submodules directly: this package re-exports
nothing."""
