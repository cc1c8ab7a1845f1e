"""`bazel test //tests:smoke`: the packages, their data files and the lock's site-packages work
together from Bazel's runfiles: every package imports, every lane profile loads, the memory
planner plans the cpu lane, and the data files the code reads at run time are present."""
from __future__ import annotations

import importlib
import os
import sys
import unittest
from pathlib import Path

PACKAGES = ("engine", "server", "lanes", "release", "sbom")
LANES = ("cpu", "h200", "rtx3090", "rtx4090", "rtx5090")


class Smoke(unittest.TestCase):
    def test_runs_on_the_host_python_311(self):
        self.assertEqual(sys.version_info[:2], (3, 11))

    def test_packages_import_from_the_runfiles(self):
        runfiles = os.environ.get("RUNFILES_DIR") or os.environ.get("TEST_SRCDIR")
        self.assertTrue(runfiles, "not run by Bazel: no RUNFILES_DIR / TEST_SRCDIR")
        for name in PACKAGES:
            mod = importlib.import_module(name)
            self.assertTrue(os.path.abspath(mod.__file__).startswith(os.path.abspath(runfiles)),
                            f"{name} imported from {mod.__file__}, not from {runfiles}")

    def test_third_party_comes_from_the_lock(self):
        import jax
        import numpy
        import sanic

        for mod in (jax, numpy, sanic):
            self.assertIn(f"{os.sep}pypi{os.sep}site{os.sep}", mod.__file__)
        self.assertEqual(jax.__version__, "0.10.2")

    def test_every_lane_profile_loads(self):
        from lanes.profile import PROFILE_DIR, load_profile

        self.assertEqual(sorted(p.stem for p in PROFILE_DIR.glob("*.toml")), sorted(LANES))
        for lane in LANES:
            profile = load_profile(lane)
            self.assertEqual(profile.name, lane)

    def test_the_planner_plans_the_cpu_lane(self):
        from lanes.planner import plan_lane
        from lanes.profile import load_profile

        plan = plan_lane(load_profile("cpu"))
        self.assertTrue(plan.fits, plan.table())
        # the cpu lane keeps everything on the host; its weights are the embedded tiny model's
        self.assertEqual(plan.total("device"), 0)
        self.assertGreater(plan.part("weights").bytes, 0)
        self.assertEqual(plan.total("host"), sum(p.bytes for p in plan.parts if p.where == "host"))

    def test_data_files_are_in_the_runfiles(self):
        import engine
        import server

        eng = Path(engine.__file__).parent
        self.assertTrue((eng / "text" / "templates" / "qwen3_5_chat.jinja").is_file())
        self.assertTrue((eng / "kernels" / "cuda" / "int4_gemv.cu").is_file())
        self.assertIn("service", (Path(server.__file__).parent / "ctl.proto").read_text())


if __name__ == "__main__":
    unittest.main()
