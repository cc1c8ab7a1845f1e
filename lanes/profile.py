"""Lane profiles: one serving profile per device, as typed data with a canonical hash.

A profile names its kernel plan (engine/plan.py) in a `[plan]` table: `preset` (default
"reference") and any plan field to override, e.g.

    [plan]
    preset = "h200"
    narrow_decode = true

An unknown preset, field or value is refused when the profile loads, naming the key."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from engine.plan import REFERENCE, KernelPlan, PlanError, preset, with_overrides

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

_DTYPES = {"float32", "bfloat16"}
_KV_DTYPES = {"float32", "bfloat16", "int8"}
# Fields a profile TOML may leave out, and their defaults. A field left at its default is also
# left out of the canonical hash, so adding such a field never changes the hash (or the
# checkpoint fingerprint) of an existing profile; any other value is hashed.
OPTIONAL_DEFAULTS = {
    "plan": REFERENCE,
    "model_preset": None,       # the model's shapes: "embedded:<preset>" names its own
    "weights": "fp32",          # the artifact's weight format (a `./ninfer convert` recipe)
    "kv_capacity_auto": False,  # kv_capacity_tokens was "auto": resolved by the planner
    "card": None,               # a GPU lane's card; None: the host is the device
    "admission_headroom_bytes": 0,
    "compile_headroom_bytes": 0,
    "host_kv_bytes": 0,
    "checkpoint_quota_bytes": None,
    "checkpoint_staging_bytes": 0,
    "ram_floor_bytes": 0,
    "keep_warm": None,
    "speculative": None,
    "model_source": None,
    "agent_tools": (),          # the agent client's tools the lane is qualified with; (): all
}
_CARD_KEYS = {"name": str, "memory_mib": int, "arch": str, "min_driver": str}
_KEEP_WARM_KEYS = {"window_ms": int, "period_ms": int, "duty": float, "grace_ms": int}
_SPECULATIVE_KEYS = {"method": str, "draft_tokens": int}
_SOURCE_KEYS = {"repository": str, "revision": str, "recipe": str, "converter": str}


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
    # what runs: the kernel plan the profile's [plan] table names (engine/plan.py)
    plan: KernelPlan = REFERENCE
    model_preset: str | None = None
    weights: str = "fp32"
    kv_capacity_auto: bool = False
    # [card]: name (as the driver reports it), memory_mib, arch (sm_XX), min_driver
    card: tuple | None = None
    admission_headroom_bytes: int = 0
    compile_headroom_bytes: int = 0
    host_kv_bytes: int = 0
    checkpoint_quota_bytes: int | None = None
    checkpoint_staging_bytes: int = 0
    ram_floor_bytes: int = 0
    keep_warm: tuple | None = None     # [keep_warm]: window_ms, period_ms, duty, grace_ms
    speculative: tuple | None = None   # [speculative]: method, draft_tokens
    model_source: tuple | None = None  # [model_source]: repository, revision, recipe, converter
    # the agent client's tools the lane's model acts with (OMP runs with `--tools` these in
    # qualification and in its tests); () offers every tool the client has
    agent_tools: tuple = ()

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
        need(self.kv_capacity_auto or self.kv_capacity_tokens >= self.context_tokens,
             "kv_capacity_tokens must hold at least one full context")
        need(self.prefill_chunk & (self.prefill_chunk - 1) == 0,
             "prefill_chunk must be a power of two")
        need(0 < self.port < 65536, "port must be in 1..65535")
        need(isinstance(self.plan, KernelPlan), "plan must be a KernelPlan")
        need(len(self.model_sha256) == 64 or self.model_sha256 == "PENDING",
             "model_sha256 must be a 64-hex sha256")
        from lanes.planner import WEIGHT_FORMATS

        need(self.weights in WEIGHT_FORMATS, f"weights must be one of {list(WEIGHT_FORMATS)}")
        for f in ("admission_headroom_bytes", "compile_headroom_bytes", "host_kv_bytes",
                  "checkpoint_staging_bytes", "ram_floor_bytes"):
            v = getattr(self, f)
            need(isinstance(v, int) and v >= 0, f"{f} must be a non-negative integer, got {v!r}")
        need(self.checkpoint_quota_bytes is None or (
            isinstance(self.checkpoint_quota_bytes, int) and self.checkpoint_quota_bytes > 0),
            "checkpoint_quota_bytes must be a positive integer")
        spec = dict(self.speculative or ())
        from engine.runtime.speculative import check_speculative, uses_mtp

        try:  # the drafter and K (engine/runtime/speculative.py)
            check_speculative(spec.get("method", "off"), spec.get("draft_tokens", 0),
                              where="[speculative] ")
        except ValueError as e:
            need(False, str(e))
        if uses_mtp(spec.get("method")) and (self.model_preset is not None
                                            or self.model.startswith("embedded:")):
            try:  # a drafter the model lacks
                mtp_layers = model_config(self).mtp_layers
            except ProfileError:
                mtp_layers = None  # the model's own error is reported where it is used
            need(mtp_layers != 0, f"[speculative] method {spec['method']!r} needs a model "
                 f"with an MTP layer; {self.model_preset or self.model!r} has none (allowed: "
                 f"'off', 'prompt_lookup')")
        if self.keep_warm is not None:
            from engine.runtime.keep_warm import KeepWarmConfig

            try:
                KeepWarmConfig(**dict(self.keep_warm))
            except (TypeError, ValueError) as e:
                need(False, f"[keep_warm]: {e}")
        need(isinstance(self.agent_tools, tuple) and len(set(self.agent_tools)) == len(
            self.agent_tools) and all(isinstance(t, str) and t.isidentifier()
                                      for t in self.agent_tools),
             f"agent_tools must be distinct tool names, got {self.agent_tools!r}")
        card = dict(self.card or ())
        need(self.card is None or card.get("memory_mib", 0) > 0,
             "[card] memory_mib must be a positive integer")

    def speculative_config(self):
        """The engine's speculation from [speculative] (engine/runtime/speculative.py's
        SpecConfig), or None when it is off."""
        from engine.runtime.speculative import SpecConfig

        spec = self.table("speculative")
        return SpecConfig.from_settings(spec.get("method", "off"), spec.get("draft_tokens", 0))

    def table(self, key: str) -> dict:
        """A table field ([card], [keep_warm], [speculative], [model_source]) as a dict."""
        return dict(getattr(self, key) or ())

    @property
    def gpu(self) -> bool:
        return self.card is not None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["plan"] = self.plan.to_dict()
        for k in _TABLES:
            if d[k] is not None:
                d[k] = dict(d[k])
        return d

    def canonical_hash(self) -> str:
        """sha256 of the profile as canonical JSON; optional fields at their defaults omitted."""
        d = {k: v for k, v in self.to_dict().items()
             if not (k in OPTIONAL_DEFAULTS and getattr(self, k) == OPTIONAL_DEFAULTS[k])}
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
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
    if "kernels" in data:
        raise ProfileError(f"{path}: 'kernels' is replaced by the [plan] table (preset = "
                           f"\"reference\", \"cpu\", \"pallas\" or \"h200\", plus fields to "
                           f"override)")
    fields = {f.name for f in dataclasses.fields(LaneProfile)}
    required = fields - set(OPTIONAL_DEFAULTS)
    if not required <= set(data) <= fields:
        raise ProfileError(f"{path}: unknown fields {sorted(set(data) - fields)}, "
                           f"missing fields {sorted(required - set(data))}")
    if "plan" in data:
        data["plan"] = plan_from_table(data["plan"], path)
    if isinstance(data.get("agent_tools"), list):
        data["agent_tools"] = tuple(data["agent_tools"])
    for key, spec in _TABLES.items():
        if key in data:
            data[key] = _table(data[key], key, spec, path)
    if data.get("kv_capacity_tokens") == "auto":
        data["kv_capacity_auto"] = True
        data["kv_capacity_tokens"] = 1  # replaced by the planner's figure below
    elif "kv_capacity_auto" in data:
        raise ProfileError(f"{path}: kv_capacity_auto is set by kv_capacity_tokens = \"auto\"")
    try:
        profile = LaneProfile(**data)
    except TypeError as e:
        raise ProfileError(f"{path}: {e}") from None
    if profile.kv_capacity_auto:
        from lanes.planner import plan_lane

        try:
            plan = plan_lane(profile)
        except ValueError as e:
            raise ProfileError(f"{path}: {e}") from None
        if plan.kv_capacity_tokens < profile.context_tokens:
            raise ProfileError(f"{path}: kv_capacity_tokens = \"auto\" resolves to "
                               f"{plan.kv_capacity_tokens:,} tokens, less than one "
                               f"{profile.context_tokens:,}-token context:\n{plan.table()}")
        profile = dataclasses.replace(profile, kv_capacity_tokens=plan.kv_capacity_tokens)
    return profile


_TABLES = {"card": _CARD_KEYS, "keep_warm": _KEEP_WARM_KEYS, "speculative": _SPECULATIVE_KEYS,
           "model_source": _SOURCE_KEYS}


def _table(value, key: str, spec: dict, path) -> tuple:
    """A profile's sub-table as a sorted tuple of (key, value): every key known and typed."""
    if not isinstance(value, dict):
        raise ProfileError(f"{path}: '{key}' must be a table ([{key}]), got {value!r}")
    unknown = sorted(set(value) - set(spec))
    if unknown:
        raise ProfileError(f"{path}: [{key}] has unknown keys {unknown}; known: {sorted(spec)}")
    for k, v in value.items():
        t = spec[k]
        ok = isinstance(v, t) and not (t is int and isinstance(v, bool)) or \
            (t is float and isinstance(v, int) and not isinstance(v, bool))
        if not ok:
            raise ProfileError(f"{path}: [{key}] {k} must be a {t.__name__}, got {v!r}")
    return tuple(sorted(value.items()))


def model_config(profile: LaneProfile):
    """The model shapes a profile serves: its embedded model's, or `model_preset`'s."""
    from engine.model.config import preset as model_preset

    name = profile.model_preset
    if name is None and profile.model.startswith("embedded:"):
        from engine.io.tiny import EMBEDDED

        embedded = profile.model.split(":", 1)[1]
        if embedded in EMBEDDED:
            return EMBEDDED[embedded]
        name = embedded
    if name is None:
        raise ProfileError(f"lane profile {profile.name!r}: model_preset is required when the "
                           f"model is an artifact path")
    try:
        return model_preset(name)
    except (KeyError, ValueError) as e:
        raise ProfileError(f"lane profile {profile.name!r}: model_preset: {e}") from None


def plan_from_table(table, path) -> KernelPlan:
    """The KernelPlan of a profile's [plan] table: its `preset` with the other keys as
    overrides. Errors name the TOML key and the allowed values."""
    if not isinstance(table, dict):
        raise ProfileError(f"{path}: 'plan' must be a table ([plan] with preset = ... and "
                           f"overrides), got {table!r}")
    table = dict(table)
    name = table.pop("preset", "reference")
    try:
        return with_overrides(preset(name), table, where=f"{path}: [plan]")
    except PlanError as e:
        msg = str(e)
        if "unknown kernel plan preset" in msg:
            msg = f"{path}: [plan] preset: {msg}"
        raise ProfileError(msg) from None
