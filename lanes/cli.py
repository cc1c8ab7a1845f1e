"""`./ninfer plan`: the memory planner's table for one lane or for every lane.

    ./ninfer plan                          every lane's table; exit 0 when all of them fit
    ./ninfer plan --lane rtx3090           one lane (a name or a TOML path)
    ./ninfer plan --lane h200 --context 262144 [--json]

A profile that does not fit, a malformed or unknown one, or a --context above the model's limit
exits 78 (EX_CONFIG) naming the file, key or figure, before anything is allocated.
"""
from __future__ import annotations

import argparse
import json
import sys

EX_CONFIG = 78


def known_lanes() -> list[str]:
    from lanes.profile import PROFILE_DIR

    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ninfer plan", description=__doc__.splitlines()[0])
    ap.add_argument("--lane", help="lane name or profile TOML path (default: every lane)")
    ap.add_argument("--context", type=int, help="plan for this many tokens of context instead "
                                                "of the profile's")
    ap.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EX_CONFIG if e.code else 0
    from lanes.planner import plan_lane
    from lanes.profile import ProfileError, load_profile, model_config

    lanes = [args.lane] if args.lane else known_lanes()
    plans, code = [], 0
    for lane in lanes:
        try:
            profile = load_profile(lane)
            cfg = model_config(profile)
        except ProfileError as e:
            print(f"ninfer plan: {e}", file=sys.stderr)
            return EX_CONFIG
        if args.context is not None:
            if args.context <= 0:
                print(f"ninfer plan: --context must be positive, got {args.context}",
                      file=sys.stderr)
                return EX_CONFIG
            if args.context > cfg.max_position:
                print(f"ninfer plan: --context {args.context:,} is above {cfg.name}'s limit of "
                      f"{cfg.max_position:,} tokens", file=sys.stderr)
                return EX_CONFIG
        plan = plan_lane(profile, cfg, context_tokens=args.context)
        plans.append(plan)
        if not plan.fits:
            code = EX_CONFIG
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(p.table() for p in plans))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
