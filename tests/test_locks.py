"""The hashed locks (release/lock.py check, `./ninfer lock --check --static`) and the wheel fetch
(release/wheels.py, release tier: it downloads)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from release import lock
from release.lockfile import parse

ROOT = Path(__file__).resolve().parent.parent
LOCKS = [t.lock for t in lock.TARGETS]

H1 = "a" * 64
H2 = "b" * 64


def _write(tmp: Path, lock_text: str, in_text: str = "idna\n", name="requirements") -> Path:
    (tmp / f"{name}.in").write_text(in_text)
    p = tmp / f"{name}.lock"
    p.write_text(lock_text)
    return p


GOOD = f"""# a lock
idna==3.20 \\
    --hash=sha256:{H1} \\
    --hash=sha256:{H2}
    # via -r requirements.in
"""


@pytest.mark.parametrize("name", LOCKS)
def test_committed_locks_pass_check(name):
    assert (ROOT / name).is_file()
    assert lock.check(ROOT / name) == []
    dists = parse(ROOT / name)  # the release's parser reads every lock too
    assert len(dists) >= 40 and all(d.hashes for d in dists)


def test_locks_name_no_mirror_and_keep_the_runtime_pins():
    texts = {n: (ROOT / n).read_text() for n in LOCKS}
    for n, text in texts.items():
        assert "/opt/" not in text and "file:" not in text and "--find-links" not in text, n
    cpu = lock.pins(ROOT / "requirements.lock")
    dev = lock.pins(ROOT / "requirements-dev.lock")
    gpu = lock.pins(ROOT / "requirements-gpu.lock")
    assert all(dev[k] == v for k, v in cpu.items())  # the dev lock is constrained by the CPU one
    assert dev["torch"] == "2.13.0+cpu"
    assert dev["spdx-tools"] == "0.8.5" and dev["cyclonedx-python-lib"].startswith("11.12.")
    assert dev["uv"] == lock.UV_VERSION
    # the GPU lock keeps every CPU pin, JAX included: a GPU lane's image runs its bundle's
    # forwards, exported by the release's JAX, over its bookworm base's python3.11
    assert {k for k in cpu if gpu.get(k) != cpu[k]} == set()
    assert gpu["jax"] == gpu["jaxlib"] == gpu["jax-cuda13-plugin"] == gpu["jax-cuda13-pjrt"] \
        == cpu["jax"] == "0.10.2"
    head = texts["requirements-gpu.lock"].splitlines()[0]
    cuda = gpu["nvidia-cuda-runtime"]
    assert "Python 3.11" in head and "CUDA 13" in head and cuda.startswith("13.") and cuda in head
    assert "Python 3.11" in texts["requirements.lock"].splitlines()[0]


def test_good_lock_passes(tmp_path):
    assert lock.check(_write(tmp_path, GOOD)) == []


@pytest.mark.parametrize("line", ["--index-url https://example.org/simple",
                                  "--extra-index-url file:///opt/pypi/simple",
                                  "-i https://example.org/simple"])
def test_index_line_fails(tmp_path, line):
    problems = lock.check(_write(tmp_path, line + "\n" + GOOD))
    assert any("index or find-links" in p and line in p for p in problems), problems


def test_find_links_line_fails(tmp_path):
    problems = lock.check(_write(tmp_path, "--find-links /opt/wheels\n" + GOOD))
    assert any("index or find-links: --find-links /opt/wheels" in p for p in problems)
    assert any("local path" in p and "/opt/wheels" in p for p in problems)


def test_file_url_anywhere_fails(tmp_path):
    text = GOOD.replace("# via -r requirements.in",
                        "# via -r file:///home/x/requirements.in")
    problems = lock.check(_write(tmp_path, text))
    assert problems and all(":5: file: URL" in p for p in problems), problems
    direct = f"idna @ file:///tmp/idna-3.20-py3-none-any.whl --hash=sha256:{H1}\n"
    problems = lock.check(_write(tmp_path, direct))
    assert any("file: URL" in p for p in problems)
    assert any("idna is not pinned with ==" in p for p in problems)


def test_local_path_in_a_comment_fails(tmp_path):
    text = GOOD.replace("# via -r requirements.in", "# via -r /work/x/requirements.in")
    problems = lock.check(_write(tmp_path, text))
    assert problems == ["requirements.lock:5: local path: # via -r /work/x/requirements.in"]


def test_unhashed_requirement_fails(tmp_path):
    text = GOOD + "h11==0.16.0\n    # via httpcore\n"
    problems = lock.check(_write(tmp_path, text))
    assert problems == ["requirements.lock:6: h11 has no sha256 hash"]
    md5 = GOOD + "h11==0.16.0 --hash=md5:0123456789abcdef0123456789abcdef\n"
    assert lock.check(_write(tmp_path, md5)) == ["requirements.lock:6: h11 has no sha256 hash"]


def test_requirement_missing_from_the_lock_fails(tmp_path):
    problems = lock.check(_write(tmp_path, GOOD, "idna\nsanic>=25\n"))
    assert problems == ["requirements.lock: dirty: sanic (from requirements.in) is not pinned"]


def test_pin_outside_the_in_specifier_fails(tmp_path):
    problems = lock.check(_write(tmp_path, GOOD, "idna>=4\n"))
    assert problems == ["requirements.lock: dirty: idna is pinned 3.20 but requirements.in "
                        "asks >=4"]


def test_dirty_follows_includes_but_not_constraints(tmp_path):
    (tmp_path / "requirements.in").write_text("idna\n")
    (tmp_path / "base.lock").write_text(GOOD)
    dev = _write(tmp_path, GOOD, "-c base.lock\n-r requirements.in\nrich\n", "requirements-dev")
    assert lock.check(dev) == ["requirements-dev.lock: dirty: rich (from requirements-dev.in) "
                               "is not pinned"]
    (tmp_path / "requirements.in").write_text("idna\nnumpy\n")
    assert any("numpy" in p for p in lock.check(dev))


def test_gpu_lock_must_pin_the_runtime_requirements_too(tmp_path):
    (tmp_path / "requirements.in").write_text("jax==0.10.2\nidna\nsanic\n")
    gpu = _write(tmp_path, GOOD.replace("idna", "jax").replace("3.20", "0.11.2") + GOOD,
                 "jax==0.11.2\nidna\n", "requirements-gpu")
    assert lock.check(gpu) == ["requirements-gpu.lock: dirty: sanic (from requirements.in) "
                               "is not pinned"]


def test_lock_check_cli_static(tmp_path):
    for name in LOCKS + [t.source for t in lock.TARGETS]:
        (tmp_path / name).write_text((ROOT / name).read_text())
    cmd = [sys.executable, "-c", "import sys; from release.lock import main; "
           "sys.exit(main(sys.argv[1:]))", "--check", "--static", "--root", str(tmp_path)]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    text = (tmp_path / "requirements-gpu.lock").read_text()
    (tmp_path / "requirements-gpu.lock").write_text("--find-links /opt/wheels\n" + text)
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "requirements-gpu.lock:1: names an index or find-links: --find-links" in bad.stderr
    assert (tmp_path / "requirements-gpu.lock").read_text().startswith("--find-links")


def test_mirrors_come_from_pip_config_only_on_the_command_line():
    args = lock.mirror_args()
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2])
    assert lock.wheel_platform("requirements-gpu.lock") == "manylinux_2_31_x86_64"
    assert lock.wheel_platform("requirements.lock") is None


# ---------------------------------------------------------------- release tier: real downloads

def _small_lock(tmp: Path, names: tuple[str, ...]) -> Path:
    """A lock of a few distributions, cut from the committed CPU lock (real names, hashes)."""
    blocks = re.split(r"\n(?=[a-z])", (ROOT / "requirements.lock").read_text())
    keep = [b for b in blocks if b.split("==")[0] in names]
    assert len(keep) == len(names)
    p = tmp / "small.lock"
    p.write_text("\n".join(keep).rstrip() + "\n")
    return p


@pytest.mark.release
def test_fetch_checks_hashes_and_refetches_a_corrupted_cache(tmp_path):
    from release.wheels import WheelError, fetch, sha256

    small = _small_lock(tmp_path, ("aiofiles", "h11", "idna"))
    hashes = {d.name: set(d.hashes) for d in parse(small)}
    dest = tmp_path / "wheels"
    got = fetch(small, dest, python="3.12")
    assert sorted(got) == ["aiofiles", "h11", "idna"]
    for name, f in got.items():
        assert f.parent == dest and f.name.endswith("-py3-none-any.whl")
        assert sha256(f) in hashes[name]
    mtimes = {n: f.stat().st_mtime_ns for n, f in got.items()}
    assert {n: f.stat().st_mtime_ns for n, f in fetch(small, dest, python="3.12").items()} \
        == mtimes  # cached files are not downloaded again

    victim = got["h11"]
    victim.write_bytes(victim.read_bytes()[:-10] + b"corrupted!")
    again = fetch(small, dest, python="3.12")
    assert sha256(again["h11"]) in hashes["h11"]
    assert again["idna"].stat().st_mtime_ns == mtimes["idna"]

    bad = tmp_path / "bad.lock"
    text = small.read_text()
    for h in hashes["idna"]:
        text = text.replace(h, "0" * 64)
    bad.write_text(text)
    with pytest.raises(WheelError, match=r"idna==3\.20"):
        fetch(bad, tmp_path / "other")


@pytest.mark.release
def test_fetch_names_a_distribution_without_a_wheel(tmp_path):
    from release.wheels import WheelError, fetch

    # llguidance 1.9.1 has no manylinux_2_28 x86_64 wheel (its Linux wheel needs glibc 2.31)
    small = _small_lock(tmp_path, ("idna", "llguidance"))
    with pytest.raises(WheelError, match=r"llguidance==1\.9\.1") as e:
        fetch(small, tmp_path / "w", platform="manylinux_2_28_x86_64")
    assert "idna" not in str(e.value)
    got = fetch(small, tmp_path / "w", platform="manylinux_2_31_x86_64")
    assert "manylinux_2_31_x86_64" in got["llguidance"].name


@pytest.mark.release
def test_lock_check_re_resolves_without_writing(tmp_path):
    """`./ninfer lock --check`: the committed locks are what uv resolves now (pins kept), and
    a requirement added to requirements.in makes the locks stale or dirty, naming it, with
    nothing written."""
    for name in LOCKS + [t.source for t in lock.TARGETS]:
        (tmp_path / name).write_text((ROOT / name).read_text())
    cmd = [sys.executable, "-c", "import sys; from release.lock import main; "
           "sys.exit(main(sys.argv[1:]))", "--check", "--root", str(tmp_path)]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    before = {n: (tmp_path / n).read_bytes() for n in LOCKS}
    with open(tmp_path / "requirements.in", "a") as f:
        f.write("wcwidth\n")  # pure Python, no dependencies, in no lock
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1
    err = bad.stderr
    assert re.search(r"requirements\.lock: stale \(\./ninfer lock would rewrite it\): "
                     r"wcwidth - -> \S+", err), err
    assert "requirements.lock: dirty: wcwidth (from requirements.in) is not pinned" in err
    assert re.search(r"requirements-dev\.lock: stale .*wcwidth - -> ", err), err
    assert "requirements-gpu.lock: dirty: wcwidth (from requirements.in) is not pinned" in err
    assert {n: (tmp_path / n).read_bytes() for n in LOCKS} == before


def test_a_lane_lock_must_run_its_bundle_in_its_image(tmp_path):
    """release.manifest.lock_problems, which the build and the verifier apply to every lane:
    the lock's JAX is the one that exported the bundle, its Python the image base's."""
    from release.manifest import IMAGE_PYTHON, lock_problems

    for name in ("requirements.lock", "requirements-gpu.lock"):
        assert lock_problems(ROOT / name, "0.10.2") == []
    old = tmp_path / "requirements-gpu.lock"
    old.write_text((ROOT / "requirements-gpu.lock").read_text().replace(
        f"Python {IMAGE_PYTHON},", "Python 3.12,", 1).replace("\njax==0.10.2 ", "\njax==0.11.2 "))
    assert lock_problems(old, "0.10.2") == [
        "requirements-gpu.lock installs jax 0.11.2 but the bundle's forwards were exported with "
        "jax 0.10.2",
        f"requirements-gpu.lock is for Python 3.12 but the image's base runs Python "
        f"{IMAGE_PYTHON}"]
