"""Lane profiles: one serving profile per device, as typed data with a canonical hash."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

_DTYPES = {"float32", "bfloat16"}
_KV_DTYPES = {"float32", "bfloat16", "int8"}


class ProfileError(ValueError):
    """A lane profile that is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class LaneProfile:
    name: str
    device: str
    model: str  # "embedded:<preset>" or a path to a .ninfer artifact
    model_sha256: str
    compute_dtype: str
    kv_dtype: str
    context_tokens: int
    max_concurrency: int
    prefill_chunk: int
    max_output_tokens: int
    max_queue: int
    queue_timeout_s: float
    kv_capacity_tokens: int
    state_slots: int
    host_state_bytes: int
    host: str
    port: int

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ProfileError(f"lane profile {self.name!r}: {msg}")

        need(self.compute_dtype in _DTYPES, f"compute_dtype must be one of {sorted(_DTYPES)}")
        need(self.kv_dtype in _KV_DTYPES, f"kv_dtype must be one of {sorted(_KV_DTYPES)}")
        for f in ("context_tokens", "max_concurrency", "prefill_chunk", "max_output_tokens",
                  "kv_capacity_tokens", "state_slots"):
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f"{f} must be a positive integer, got {v!r}")
        need(isinstance(self.max_queue, int) and self.max_queue >= 0,
             "max_queue must be a non-negative integer")
        need(isinstance(self.queue_timeout_s, (int, float)) and self.queue_timeout_s > 0,
             "queue_timeout_s must be positive")
        need(isinstance(self.host_state_bytes, int) and self.host_state_bytes >= 0,
             "host_state_bytes must be a non-negative integer")
        need(self.kv_capacity_tokens >= self.context_tokens,
             "kv_capacity_tokens must hold at least one full context")
        need(self.prefill_chunk & (self.prefill_chunk - 1) == 0,
             "prefill_chunk must be a power of two")
        need(0 < self.port < 65536, "port must be in 1..65535")
        need(len(self.model_sha256) == 64 or self.model_sha256 == "PENDING",
             "model_sha256 must be a 64-hex sha256")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def canonical_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def load_profile(name_or_path: str) -> LaneProfile:
    """Load a profile by lane name (lanes/profiles/<name>.toml) or by file path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
        raise ProfileError(f"no lane profile {name_or_path!r}; known lanes: {known}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from None
    fields = {f.name for f in dataclasses.fields(LaneProfile)}
    if set(data) != fields:
        raise ProfileError(f"{path}: unknown fields {sorted(set(data) - fields)}, "
                           f"missing fields {sorted(fields - set(data))}")
    return LaneProfile(**data)
