"""The Nix flake, for real (release tier): `nix run .#serve-cpu` serves, `nix run
.#serve-rtx5090` refuses on a machine without the card, `nix flake check` passes, and the
package's store path does not depend on where the tree is. Runs Debian's nix-bin offline, as
root without a daemon (installs it if missing), in git copies of the working tree, and prints
the cold and cached build times and the closure size."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "x86_64-linux"
LANES = sorted(p.stem for p in (ROOT / "lanes" / "profiles").glob("*.toml"))
# Where the lock's wheels are downloaded once and reused (~170 MB for this platform).
WHEEL_CACHE = Path.home() / ".cache" / "ninfer-wheels"
READY_TIMEOUT_S = 600  # the cpu lane compiles its model on first start (~90 s on a busy host)


def _run(cmd, *, cwd=None, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _ensure_nix() -> None:
    if shutil.which("nix") and shutil.which("nix-store"):
        return
    if _run(["apt-get", "install", "-y", "nix-bin"], check=False, timeout=600).returncode != 0:
        _run(["apt-get", "update"], timeout=600)
        _run(["apt-get", "install", "-y", "nix-bin"], timeout=600)
    assert shutil.which("nix"), "nix-bin installed but `nix` is not on PATH"


def _ensure_wheels() -> None:
    """The runtime lock's wheels in WHEEL_CACHE (downloaded once), checked against the committed
    nix/wheels.nix and added to the Nix store by sha256."""
    check = [sys.executable, str(ROOT / "nix" / "wheels.py"), "check", str(WHEEL_CACHE)]
    if _run(check, check=False).returncode != 0:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
              "--only-binary=:all:", "-r", str(ROOT / "requirements.lock"),
              "-d", str(WHEEL_CACHE)], timeout=1800)
    _run([sys.executable, str(ROOT / "nix" / "wheels.py"), "seed", str(WHEEL_CACHE)])


def _copy_tree(dest: Path) -> Path:
    """The working tree's files that git sees (tracked, or untracked and not ignored) in a new
    git repository at dest, all staged: what a flake of this checkout evaluates."""
    listing = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                   cwd=ROOT).stdout
    for rel in filter(None, listing.split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    _run(["git", "init", "-q"], cwd=dest)
    _run(["git", "add", "-A"], cwd=dest)
    return dest


@pytest.fixture(scope="module")
def nix(tmp_path_factory):
    """(run, tree): run(args, ...) runs `nix <args> --offline` in a git copy of the tree, with
    the flake's settings (nix/nix.conf: flakes, no substituters, the sandbox's paths)."""
    _ensure_nix()
    _ensure_wheels()
    tree = _copy_tree(tmp_path_factory.mktemp("flake"))
    env = dict(os.environ, NIX_CONFIG=(ROOT / "nix" / "nix.conf").read_text())

    def run(args, cwd=tree, **kw):
        # --offline goes before a `--` (what follows that is the app's)
        cut = args.index("--") if "--" in args else len(args)
        return _run(["nix", *args[:cut], "--offline", *args[cut:]], cwd=cwd, env=env, **kw)

    run.env = env
    return run, tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _out_path(run, cwd, attr: str) -> str:
    return json.loads(run(["eval", "--json", f".#{attr}.outPath"], cwd=cwd).stdout)


def test_package_store_path_is_stable_and_builds_reproducibly(nix, tmp_path):
    run, tree = nix
    attr = f"packages.{SYSTEM}.ninfer"
    first = _out_path(run, tree, attr)
    # a second copy of the tree, elsewhere: the same derivation, so the same store path
    other = _copy_tree(tmp_path / "other")
    assert _out_path(run, other, attr) == first
    assert _out_path(run, tree, attr) == first

    # Cold: the package and the launchers that refer to it leave the store (the wheels stay,
    # seeded), so each build installs and compiles all 50 wheels again. Built twice from cold:
    # the NAR hash Nix records as it registers each build must be the same (reproducible).
    launchers = [run(["eval", "--raw", f".#apps.{SYSTEM}.serve-{lane}.program"],
                     cwd=tree).stdout.rsplit("/bin/", 1)[0] for lane in LANES]
    colds, nar_hashes = [], []
    for _ in range(2):
        present = [p for p in [*launchers, first] if Path(p).exists()]
        if present:
            run(["store", "delete", *present])
        assert not Path(first).exists(), f"{first} is still alive: the build would be cached"
        t0 = time.monotonic()
        run(["build", "--no-link", f".#{attr}"])
        colds.append(time.monotonic() - t0)
        nar_hashes.append(json.loads(run(["path-info", "--json", first]).stdout)[0]["narHash"])
    assert nar_hashes[0] == nar_hashes[1], "two builds of the package differ"
    t0 = time.monotonic()
    run(["build", "--no-link", f".#{attr}"])
    cached = time.monotonic() - t0
    assert Path(first, "site-packages", "jax").is_dir() and Path(first, "src", "server").is_dir()
    info = json.loads(run(["path-info", "--json", "-S", first]).stdout)[0]
    print(f"\nnix package {first}: cold builds {colds[0]:.1f} s and {colds[1]:.1f} s, cached "
          f"{cached:.1f} s, closure {info['closureSize'] / 2**20:.0f} MiB ({info['closureSize']} B)")
    cold = min(colds)
    assert cached < cold
    # its closure is the package alone: the wheels were installed, not referenced
    refs = run(["path-info", "-r", first]).stdout.split()
    assert refs == [first]


def test_flake_lists_a_serve_app_per_lane(nix):
    run, tree = nix
    apps = json.loads(run(["eval", "--json", f".#apps.{SYSTEM}",
                           "--apply", "builtins.attrNames"]).stdout)
    assert apps == sorted(f"serve-{lane}" for lane in LANES)
    assert {"serve-cpu", "serve-rtx5090"} <= set(apps)


def test_serve_rtx5090_fails_closed_with_the_preflight_message(nix, tmp_path):
    run, tree = nix
    state = tmp_path / "state"
    p = run(["run", ".#serve-rtx5090", "--", "--state-dir", str(state)], check=False,
            timeout=600)
    assert p.returncode == 78, (p.returncode, p.stderr[-2000:])
    assert "ninfer: lane rtx5090: preflight refused" in p.stderr
    assert "needs an NVIDIA GeForce RTX 5090" in p.stderr
    assert not state.exists(), "the refusal wrote the state directory"


def test_serve_cpu_answers_health(nix, tmp_path):
    run, tree = nix
    port, state = _free_port(), tmp_path / "state"
    log = (tmp_path / "serve.log").open("w")
    # `nix run` execs the launcher, which execs python: this process is the server.
    proc = subprocess.Popen(["nix", "run", "--offline", ".#serve-cpu", "--", "--port", str(port),
                             "--state-dir", str(state)], cwd=tree, env=run.env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        deadline, status = t0 + READY_TIMEOUT_S, None
        while time.monotonic() < deadline and proc.poll() is None:
            status = _health(port)
            if status == 200:
                break
            time.sleep(1)
        text = (tmp_path / "serve.log").read_text()
        assert status == 200, f"health {status}, exit {proc.poll()}:\n{text[-3000:]}"
        print(f"\nnix run .#serve-cpu: /health 200 after {time.monotonic() - t0:.1f} s")
        assert f"lane cpu listening on http://127.0.0.1:{port}" in text
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[:5] == [b"/usr/bin/python3.11", b"-P", b"-S", b"-m", b"server.cli"]
        assert (state / "keys").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    print(f"nix run .#serve-cpu: exit status {proc.returncode} after SIGTERM")
    assert "ninfer: stop report:" in text, text[-3000:]  # SIGTERM took the server's stop path
    assert proc.returncode == 0, (proc.returncode, text[-3000:])


def test_flake_check_passes(nix):
    run, tree = nix
    run(["flake", "check"], timeout=900)
    plan = _out_path(run, tree, f"checks.{SYSTEM}.plan-cpu")
    assert "lane cpu on cpu" in Path(plan, "plan-cpu.txt").read_text()
    refusal = _out_path(run, tree, f"checks.{SYSTEM}.refuse-rtx5090")
    assert "preflight refused" in Path(refusal, "refusal.txt").read_text()
    verifier = Path(_out_path(run, tree, f"checks.{SYSTEM}.verifier"))
    assert json.loads((verifier / "sbom" / "sbom.cdx.json").read_text())["specVersion"] == "1.6"
    assert "FAIL" in (verifier / "verify.txt").read_text()
