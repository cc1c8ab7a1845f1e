{
  # OMP NInfer, built offline from the hash-locked runtime wheels. No inputs (no nixpkgs): the
  # flake evaluates, builds and runs with `--offline`. Setup, once per machine and lock:
  #   pip download --no-deps --require-hashes --only-binary=:all: -r requirements.lock -d DIR
  #   python3 nix/wheels.py seed DIR        # checks nix/wheels.nix, adds the wheels by sha256
  #   export NIX_CONFIG="$(cat nix/nix.conf)"
  #   nix run .#serve-cpu                    # nix run .#serve-rtx5090 refuses without the card
  # nix/README.md says what stays impure (the host's python3.11 and /bin/sh) and why.
  description = "OMP NInfer: local Qwen3.8 inference appliance";

  outputs = { self }:
    let
      system = "x86_64-linux";
      # Impure on purpose: no nixpkgs can be fetched here, so the interpreter is the host's.
      # The sandbox sees it through sandbox-paths (nix/nix.conf).
      python = "/usr/bin/python3.11";
      version = "0.16.0";
      epoch = "315532800"; # SOURCE_DATE_EPOCH: 1980-01-01, the earliest a zip can hold

      locked = import ./nix/wheels.nix;
      lockSha256 = builtins.hashFile "sha256" ./requirements.lock;
      fresh = locked.lockSha256 == lockSha256
        || throw "nix/wheels.nix was made from another requirements.lock: run python3 nix/wheels.py generate DIR";

      # Each wheel by its sha256. `nix/wheels.py seed DIR` puts it in the store under this very
      # name and hash, so nothing is read; a wheel not seeded is read from wheelDir.
      wheelDir = "/var/cache/ninfer/wheels";
      fetchWheel = w: builtins.fetchurl {
        name = w.file;
        url = "file://${wheelDir}/${w.file}";
        inherit (w) sha256;
      };
      wheels = assert fresh; map fetchWheel locked.wheels;
      requirements = builtins.concatStringsSep "\n"
        (map (w: "@WHEELS@/${w.file} --hash=sha256:${w.sha256}") locked.wheels) + "\n";

      # The product source: the packages and the entry point, nothing else of the checkout.
      keep = [ "engine" "server" "lanes" "release" "sbom" "ninfer" "requirements.lock" "requirements-dev.lock" ];
      src = builtins.path {
        name = "ninfer-src-${version}";
        path = ./.;
        filter = path: type:
          let
            rel = builtins.substring (builtins.stringLength (toString ./.) + 1) (-1) (toString path);
            top = builtins.head (builtins.split "/" rel);
            base = baseNameOf path;
          in builtins.elem top keep && base != "__pycache__" && builtins.match ".*\\.pyc" base == null;
      };

      ninfer = derivation {
        name = "ninfer-${version}";
        inherit system python src wheels requirements;
        builder = "/bin/sh";
        args = [ ./nix/build.sh ];
        passAsFile = [ "requirements" ];
        PATH = "/usr/bin:/bin";
        SOURCE_DATE_EPOCH = epoch;
      };

      lanes = map (f: builtins.replaceStrings [ ".toml" ] [ "" ] f)
        (builtins.filter (f: builtins.match ".*\\.toml" f != null)
          (builtins.attrNames (builtins.readDir ./lanes/profiles)));

      launcher = lane: derivation {
        name = "ninfer-serve-${lane}-${version}";
        inherit system python lane ninfer;
        builder = "/bin/sh";
        args = [ ./nix/app.sh ];
        PATH = "/usr/bin:/bin";
      };

      # A check runs the package's own code in the sandbox and keeps its output.
      check = name: script: derivation {
        name = "ninfer-check-${name}";
        inherit system python ninfer;
        builder = "/bin/sh";
        args = [ "-eu" "-c" script ];
        PATH = "/usr/bin:/bin";
        SOURCE_DATE_EPOCH = epoch;
      };
      pyenv = ''export HOME="$TMPDIR" PYTHONNOUSERSITE=1 JAX_PLATFORMS=cpu PYTHONPATH="$ninfer/site-packages:$ninfer/src"; '';
    in {
      packages.${system} = {
        inherit ninfer;
        default = ninfer;
      };

      apps.${system} = builtins.listToAttrs (map (lane: {
        name = "serve-${lane}";
        value = { type = "app"; program = "${launcher lane}/bin/serve-${lane}"; };
      }) lanes);

      checks.${system} = {
        # The memory planner's fit table for the cpu lane, from the built package.
        plan-cpu = check "plan-cpu" (pyenv + ''
          mkdir -p "$out"
          "$python" -P -S -m server.cli plan --lane cpu > "$out/plan-cpu.txt"
          grep -q . "$out/plan-cpu.txt"
        '');
        # The release verifier and its SBOM validators, from the package: the cpu lane's SBOMs
        # built and validated (spdx-tools, the CycloneDX schema), and `release verify` on a
        # directory that is no release fails naming it.
        verifier = derivation {
          name = "ninfer-check-verifier";
          inherit system python ninfer;
          omplock = ./tests/omp/package-lock.json;
          builder = "/bin/sh";
          PATH = "/usr/bin:/bin";
          SOURCE_DATE_EPOCH = epoch;
          args = [ "-eu" "-c" (pyenv + ''
            mkdir -p "$out"
            "$python" -P -S -m sbom build --lane cpu --version 0.16.0 \
              --lock "$ninfer/src/requirements.lock" --created 2026-01-01T00:00:00Z \
              --model embedded:tiny,tiny,fp32,-,embedded --npm-lock "$omplock" --out "$out/sbom"
            "$python" -P -S -m sbom validate "$out/sbom/sbom.spdx.json" "$out/sbom/sbom.cdx.json"
            rc=0
            "$python" -P -S -m release verify "$TMPDIR/absent" > "$out/verify.txt" || rc=$?
            test "$rc" = 1
            grep -q "FAIL" "$out/verify.txt"
          '') ];
        };
        # A GPU lane on a machine without its card: serve must refuse with EX_CONFIG (78).
        refuse-rtx5090 = check "refuse-rtx5090" (pyenv + ''
          mkdir -p "$out"
          rc=0
          "$python" -P -S -m server.cli serve --lane rtx5090 --state-dir "$TMPDIR/state" 2> "$out/refusal.txt" || rc=$?
          test "$rc" = 78
          grep -q "preflight refused" "$out/refusal.txt"
          test ! -e "$TMPDIR/state"
        '');
      };
    };
}
