"""`./ninfer omp-config`: the Oh My Pi client configuration for this server, fail-closed.

Writes `models.yml` (one `openai-responses` provider: text-only input, the lane's context and
output limits, our compat flags) and `config.yml` (retry off, no model fallback, no update check,
`maxInFlightRequests` equal to the lane's concurrency, and every provider OMP would otherwise add
or probe by itself disabled, so a turn can never leave this machine). JSON is valid YAML, so the
files are written as JSON. Both are mode 0600: models.yml carries the bearer key.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# Providers OMP adds by itself: local servers it probes on loopback at start (ports 11434, 8080,
# 1234), and hosted catalogs it fetches at start even when only our provider is configured.
IMPLICIT_PROVIDERS = ("ollama", "llama.cpp", "lm-studio", "kilo", "venice", "zenmux",
                      "alibaba-coding-plan", "commandcode", "charm-hyper")


@dataclass(frozen=True)
class Provider:
    """One `openai-responses` provider in models.yml, serving one model."""
    id: str
    base_url: str  # ends in /v1: OMP POSTs {base_url}/responses
    api_key: str
    model: str = "tiny"
    context_window: int = 32768
    max_tokens: int = 4096


def models_yml(providers: Sequence[Provider]) -> dict:
    return {"providers": {p.id: {
        "baseUrl": p.base_url,
        "api": "openai-responses",
        "apiKey": p.api_key,
        "models": [{
            "id": p.model, "name": p.model, "reasoning": False, "input": ["text"],
            "contextWindow": p.context_window, "maxTokens": p.max_tokens,
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            "compat": {"includeEncryptedReasoning": False, "supportsReasoningSummary": False,
                       "supportsImageDetailOriginal": False},
        }],
    } for p in providers}}


def config_yml(default: Provider, *, max_in_flight: int = 1, fallback_chain: Sequence[str] = (),
               retry: dict | None = None, compaction: bool | None = None) -> dict:
    """Fail-closed client settings. `fallback_chain`/`retry` exist so a test can show what
    happens without them; `compaction` None keeps OMP's default."""
    settings = {"enabled": False, "modelFallback": False, "fallbackRevertPolicy": "never"}
    if fallback_chain:
        settings["fallbackChains"] = {"default": list(fallback_chain)}
    settings.update(retry or {})
    cfg = {
        "modelRoles": {"default": f"{default.id}/{default.model}"},
        "providers": {"maxInFlightRequests": {default.id: max_in_flight}},
        "disabledProviders": list(IMPLICIT_PROVIDERS),
        "retry": settings,
        "startup": {"checkUpdate": False},
    }
    if compaction is not None:
        cfg["compaction"] = {"enabled": compaction}
    return cfg


def _write_private(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_config(agent_dir: Path, providers: Sequence[Provider], **config) -> None:
    agent_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_private(agent_dir / "models.yml", models_yml(providers))
    _write_private(agent_dir / "config.yml", config_yml(providers[0], **config))


def main(argv: list[str], default_state_dir: Path) -> int:
    from lanes.profile import load_profile
    from server.auth import load_key_file

    p = argparse.ArgumentParser(prog="ninfer omp-config",
                                description="write the Oh My Pi provider config for this server")
    p.add_argument("--out", default=str(Path.home() / ".omp" / "agent"),
                   help="OMP agent directory (default ~/.omp/agent)")
    p.add_argument("--lane", default="cpu")
    p.add_argument("--host", help="the server's loopback address (default: the lane's)")
    p.add_argument("--port", type=int, help="the server's port (default: the lane's)")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--key-file", help="default <state-dir>/keys")
    p.add_argument("--principal", default="default", help="whose key the client uses")
    p.add_argument("--provider", default="ninfer", help="provider id in OMP")
    p.add_argument("--model-id", help="served model id (default: the lane's embedded model name)")
    args = p.parse_args(argv)
    profile = load_profile(args.lane)
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir
    key_file = Path(args.key_file) if args.key_file else state_dir / "keys"
    ring = load_key_file(key_file)
    keys = [k.decode() for who, k in ring.entries if who == args.principal]
    if not keys:
        raise SystemExit(f"ninfer: no key for principal {args.principal!r} in {key_file}")
    model = args.model_id or (profile.model.split(":", 1)[1] if
                              profile.model.startswith("embedded:") else None)
    if model is None:
        raise SystemExit("ninfer: pass --model-id (the lane serves an artifact by path)")
    host = args.host or profile.host
    port = args.port or profile.port
    prov = Provider(args.provider, f"http://{host}:{port}/v1", keys[0], model,
                    context_window=profile.context_tokens,
                    max_tokens=profile.max_output_tokens)
    out = Path(args.out)
    write_config(out, [prov], max_in_flight=profile.max_concurrency)
    print(f"ninfer: wrote {out / 'models.yml'} and {out / 'config.yml'} (mode 0600; the key "
          f"comes from {key_file}). Use: omp --model {args.provider}/{model}")
    return 0
