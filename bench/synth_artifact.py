"""Write a real `.ninfer` artifact of a preset's shapes with synthetic random weights, fast
(engine/io/synthetic.py, what `./ninfer serve --synthetic-weights` uses), from the command line.

    python bench/synth_artifact.py --out /tmp/w/qwen3.8-27b-int4.ninfer            # 27B int4_g64
    python bench/synth_artifact.py --preset tiny --format bf16 --out /tmp/tiny.ninfer
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.io.synthetic import (FORMATS, expected_bytes, synth_artifact,  # noqa: E402,F401
                                 synth_tensors, write_parallel)
from engine.model.config import preset  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .ninfer file to write")
    ap.add_argument("--preset", default="qwen3.8-27b", help="engine.model.config preset name")
    ap.add_argument("--format", default="int4_g64", choices=FORMATS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--writer", default="parallel", choices=("parallel", "engine"),
                    help="parallel (default; same bytes) or engine.io.artifact.write_artifact")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)
    cfg = preset(args.preset)
    log = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    if log:
        free = os.statvfs(Path(args.out).resolve().parent if Path(args.out).parent.exists()
                          else ".")
        log(f"synth {cfg.name} {args.format}: ~{expected_bytes(cfg, args.format) / 1e9:.2f} GB "
            f"of weights, {free.f_bavail * free.f_frsize / 1e9:.1f} GB free")
    r = synth_artifact(Path(args.out), args.preset, args.format, args.seed, log, args.writer)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['path']} sha256 {r['sha256']} {r['bytes'] / 1e9:.3f} GB "
              f"in {r['seconds']:.1f}s ({r['write_GBps']:.2f} GB/s) phases {r['phases']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
