{
  # Placeholder flake: the release issue adds per-lane `serve-<lane>` apps (nix run .#serve-rtx5090)
  # built offline from the hash-locked wheels. No nixpkgs input: it must evaluate offline.
  description = "OMP NInfer: local Qwen3.8 inference appliance";
  outputs = { self }: { };
}
