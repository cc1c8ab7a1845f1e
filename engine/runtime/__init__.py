"""Host-side memory managers and the serving loop's parts: KV page ownership (`pages`),
recurrent-state images (`states`), the scheduler with the engine's inbox, `memory` tying them to
the device cache (with the prefix index and the retention rule that decides what to keep),
the executable store and per-request sampling (`sampling`); the engine's stages: its requests
and events (`request`), the model runner with a step's sampling dispatch (`runner`), the engine
thread's loop with its chained decode steps (`loop`), and the checkpoint interface
(`checkpoint_port`, over `checkpoint_io`). Import the submodules directly: this package
re-exports nothing."""
