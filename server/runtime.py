"""What the routes share: one `Runtime`, built by `./ninfer serve` (server/cli.py) or a test and
held by the app as `app.ctx.rt`."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.auth import KeyRing
from server.observability import Metrics, Observability
from server.reasoning_seal import ReasoningSeal

if TYPE_CHECKING:
    from engine.constrain.compiler import ConstraintCompiler
    from engine.engine import Engine
    from engine.io.loader import LoadedModel
    from lanes.profile import LaneProfile
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.manager import Checkpointer
    from server.generation import InFlight
    from server.response_store import ResponseStore


@dataclass
class Runtime:
    """What the routes need. `engine` and `model` stay None while the model loads; the
    checkpoint fields stay None when the server runs without checkpoints."""
    keys: KeyRing
    max_output_tokens: int  # a request's output budget when it names none
    context_tokens: int     # prompt plus output, at most
    # stored responses (`<state-dir>/responses.db`); None in a runtime that stores nothing
    response_store: ResponseStore | None = None
    engine: Engine | None = None
    model: LoadedModel | None = None
    # the served model's sampling defaults (its artifact's extra.generation), for a request
    # that names no temperature or top_p: set with `model`, {} until then
    sampling_defaults: dict = field(default_factory=dict)
    load_error: str | None = None  # why the model failed to load, once it did
    # the lane's serving profile (`/v1/ninfer/status`, `ninfer ctl status`); None in tests
    profile: LaneProfile | None = None
    # serving random weights (`serve --synthetic-weights`): every status and receipt says so
    synthetic_weights: bool = False
    # `ninfer ctl drain` or a graceful stop under way: new responses are refused with a 503
    draining: bool = False
    # `<state-dir>/checkpoints`, opened before the model loads (server/checkpoints/setup.py)
    checkpoint_store: CheckpointStore | None = None
    # saves and restores session states through `checkpoint_store`; built once the model is
    # loaded. Every checkpoint hook is a no-op while it is None.
    checkpointer: Checkpointer | None = None
    fingerprint_sha256: str = ""  # the runtime fingerprint's digest, set with `checkpointer`
    ctl_server: object | None = None  # the gRPC control server (grpc.Server), once it listens
    obs: Observability = field(default_factory=lambda: Observability(Metrics()))
    inflight: dict[str, InFlight] = field(default_factory=dict)  # by response id
    constraints: ConstraintCompiler | None = None  # built at load (or at first use in tests)
    # (max responses per principal, max age in seconds): applied at start and then hourly
    retention: tuple[int | None, float | None] = (None, None)
    seal: ReasoningSeal = field(default_factory=lambda: ReasoningSeal(secrets.token_bytes(32)))
