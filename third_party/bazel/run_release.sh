#!/usr/bin/env bash
# `bazel run //release:v0_16_0`: writes the release to <workspace>/dist/v<VERSION>/ with
# `python3 -m release build`, run by the host Python 3.11 (@host_python) from this target's
# runfiles: the workspace's packages and the lock's site-packages (@pypi) on PYTHONPATH. The
# bundles carry the CUDA ops //engine:cuda_ops built (byte-identical wherever the workspace
# is), under the name the runtime and the checkpoint fingerprint know that build by
# (engine/kernels/cuda_build.py).
#   usage: run_release.sh VERSION [extra `release build` arguments]
set -euo pipefail

version="${1:?usage: run_release.sh VERSION [release build args]}"
shift
if [ -z "${BUILD_WORKSPACE_DIRECTORY:-}" ]; then
  echo "run_release.sh: run me with 'bazel run' (BUILD_WORKSPACE_DIRECTORY is unset)" >&2
  exit 2
fi

runfiles="${RUNFILES_DIR:-$0.runfiles}"
[ -d "$runfiles" ] || { echo "run_release.sh: no runfiles at $runfiles" >&2; exit 2; }
python="$(head -n1 "$runfiles/host_python/interpreter.txt")"
site="$runfiles/pypi/site"
src="$runfiles/ninfer"

out="$BUILD_WORKSPACE_DIRECTORY/dist/v$version"
cd "$src"
PYTHONPATH="$src:$site" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m release build --out "$out" --version "$version" \
  --cuda-ops "$src/engine/cuda_ops" "$@"
