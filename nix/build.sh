# Builder of the `ninfer` package (run by /bin/sh inside the Nix sandbox; see flake.nix).
# Inputs from the derivation: $python (the host's python3.11), $src (the product source),
# $wheels (the lock's wheels, store paths), $requirementsPath (one line per wheel:
# `$TMPDIR/wheels/<file> --hash=sha256:<sha256>`).
set -eu
export HOME="$TMPDIR" PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 \
  PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONNOUSERSITE=1 PYTHONHASHSEED=0
# A store path is <hash>-<name>: pip needs the wheel's own file name to read its tags.
mkdir "$TMPDIR/wheels"
for w in $wheels; do
  base="${w##*/}"
  ln -s "$w" "$TMPDIR/wheels/${base#*-}"
done
sed "s|@WHEELS@|$TMPDIR/wheels|" "$requirementsPath" > "$TMPDIR/requirements.txt"
# --no-compile: pip would compile in a randomly named temporary directory, and each .pyc would
# carry that name; compileall below compiles the files where they stay.
"$python" -s -m pip install --quiet --no-index --no-deps --require-hashes --only-binary=:all: \
  --no-compile --target "$out/site-packages" -r "$TMPDIR/requirements.txt"
# pip writes console scripts whose #! line names the build's python: nothing runs them here.
rm -rf "$out/site-packages/bin"
mkdir -p "$out/src"
cp -R "$src/." "$out/src/"
chmod -R u+w "$out/src"
# checked-hash .pyc: no source mtime inside, so the bytes depend on the source alone
"$python" -s -m compileall -q -j 0 --invalidation-mode checked-hash \
  "$out/site-packages" "$out/src" >/dev/null
