# Builder of one `serve-<lane>` launcher: writes $out/bin/serve-$lane, a script that runs
# `python3.11 -m server.cli serve --lane $lane` on the package's PYTHONPATH. `serve` runs the
# lane's preflight before it binds or writes anything, and exits 78 with the preflight's
# message on a machine without the lane's card. `-P -S`: neither the working directory nor the
# host's site-packages is on sys.path, only the package's two directories and the stdlib.
set -eu
mkdir -p "$out/bin"
cat > "$out/bin/serve-$lane" <<SCRIPT
#!/bin/sh
# serve-$lane: the ninfer server on lane $lane, from $ninfer
export PYTHONPATH="$ninfer/site-packages:$ninfer/src"
export PYTHONNOUSERSITE=1
exec $python -P -S -m server.cli serve --lane $lane "\$@"
SCRIPT
chmod 0555 "$out/bin/serve-$lane"
