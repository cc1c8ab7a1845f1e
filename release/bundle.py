"""Engine bundles: one lane's product code, exported forwards and CUDA ops in one tar.

`build_bundle(lane, out)` writes a deterministic tar (entries sorted by name, mtime `epoch`,
uid/gid 0 without names, modes 0644 or 0755) holding

    code/<path>                                  the product files (lanes.instance.product_files)
    exported/<platform>/<rows>x<width>.jaxexport  every forward the lane's engine runs
                                                 (engine/runtime/exported.py), exported for
                                                 "cpu" (a cpu lane) or "cuda" (a GPU lane)
    cuda/<library>.so                            the CUDA ops built for the lane's card arch
                                                 (only when its plan runs them)
    profile.json                                 the resolved lane profile, canonical JSON
    bundle.json                                  what the bundle is for and every file's sha256

The exports are lowered at the lane's real shapes (its model config, weight format, plan,
max_concurrency rows, prefill chunk and KV pool) from abstract params: no weight is made, so a
27B GPU lane's bundle is built on a CPU machine. The same tree and epoch give the same bytes.

`open_bundle(path)` reads a bundle back and refuses (BundleError, naming the file) one whose
files differ from bundle.json: a changed byte, a missing, extra or truncated file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = "ninfer-bundle/1"
MANIFEST = "bundle.json"
REPO = Path(__file__).resolve().parent.parent


class BundleError(Exception):
    """A bundle that cannot be built, or one that is not what its bundle.json says."""


# the nvcc flags third_party/bazel/cuda.bzl builds //engine:cuda_ops with (its DEFAULT_FLAGS)
BAZEL_CUDA_FLAGS = ("-O3", "-std=c++17")

def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _epoch(epoch: int | None) -> int:
    if epoch is not None:
        return int(epoch)
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


def _versions() -> dict:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def lane_platform(profile) -> str:
    """The export platform of a lane: "cpu" for the host device, "cuda" for a GPU lane."""
    if profile.device == "cpu" and not profile.gpu:
        return "cpu"
    if profile.device == "cuda":
        return "cuda"
    raise BundleError(f"lane {profile.name}: no export platform for device {profile.device!r}")


def _model_config(cfg) -> dict:
    if dataclasses.is_dataclass(cfg):
        return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    return {"repr": repr(cfg)}


def _product(tree: Path) -> dict[str, tuple[bytes, bool]]:
    """{code/<path>: (bytes, executable)} of the tree's product files."""
    from lanes.instance import product_files

    out = {}
    for rel in product_files(tree):
        path = tree / rel
        out[f"code/{rel}"] = (path.read_bytes(), bool(os.stat(path).st_mode & 0o111))
    return out


def _same_engine(tree: Path, product: dict) -> None:
    """The exports are made by the engine code this process runs: refuse a tree whose engine
    differs from it (the bundle's code would not be the code of its exports)."""
    if tree.resolve() == REPO:
        return
    for name, (data, _) in product.items():
        rel = name[len("code/"):]
        if rel.startswith("engine/"):
            here = REPO / rel
            if not here.is_file() or here.read_bytes() != data:
                raise BundleError(f"{tree}: {rel} differs from the running engine's; build the "
                                  f"bundle with the tree's own ninfer")


def _cuda_libraries(profile, cuda_ops: Path | None = None) -> dict[str, bytes]:
    """{cuda/<name>.so: bytes} of the CUDA ops for the lane's plan (none if it runs none),
    under the name the runtime gives that build (engine/kernels/cuda_build.py: a digest of
    source, headers, nvcc, arch and flags). `cuda_ops`: a directory of prebuilt libraries
    (int4_gemv-sm<arch>.so, what Bazel's //engine:cuda_ops writes, byte-identical wherever the
    workspace lies) to take them from; else they are built here with the plan's flags."""
    plan = profile.plan
    if not plan.uses_cuda:
        return {}
    from engine.kernels import cuda_build

    nvcc = cuda_build._nvcc()
    if nvcc is None:
        raise BundleError(f"lane {profile.name}: its plan runs the CUDA ops and no nvcc was "
                          f"found (NVCC, PATH, /usr/local/cuda/bin/nvcc)")
    flags = tuple(plan.cuda_flags)
    name = cuda_build.library_path(cuda_build.INT4_SOURCE, plan.cuda_arch, nvcc, flags).name
    if cuda_ops is None:
        path = cuda_build.build(cuda_build.INT4_SOURCE, plan.cuda_arch, nvcc, flags)
        return {f"cuda/{name}": path.read_bytes()}
    prebuilt = Path(cuda_ops) / f"int4_gemv-sm{plan.cuda_arch}.so"
    if flags != BAZEL_CUDA_FLAGS:
        raise BundleError(f"lane {profile.name}: its plan's cuda_flags {list(flags)} are not "
                          f"the ones {prebuilt} was built with ({list(BAZEL_CUDA_FLAGS)})")
    if not prebuilt.is_file():
        raise BundleError(f"lane {profile.name}: {prebuilt} is missing (build "
                          f"//engine:cuda_ops_sm{plan.cuda_arch})")
    return {f"cuda/{name}": prebuilt.read_bytes()}


def _tar_bytes(entries: dict[str, tuple[bytes, bool]], mtime: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name in sorted(entries):
            data, executable = entries[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            info.mode = 0o755 if executable else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def build_bundle(lane: str, out_path, *, tree: Path = REPO, epoch: int | None = None,
                 cuda_ops: Path | None = None) -> dict:
    """Write lane `lane`'s bundle to `out_path` (atomically). `tree`: the ninfer tree whose
    product code goes in (its engine must be the running one); `epoch`: every entry's mtime
    (default $SOURCE_DATE_EPOCH, else 0); `cuda_ops`: prebuilt CUDA ops (`_cuda_libraries`).
    Returns {sha256, size, files, export_s}."""
    from engine.runtime.exported import export_forwards, lane_runner
    from lanes.profile import load_profile

    tree, out_path = Path(tree), Path(out_path)
    profile = load_profile(str(tree / "lanes" / "profiles" / f"{lane}.toml"))
    platform = lane_platform(profile)
    product = _product(tree)
    _same_engine(tree, product)
    t0 = time.monotonic()
    runner, cache = lane_runner(profile)
    blobs = export_forwards(runner, cache, platform)
    export_s = time.monotonic() - t0
    entries = dict(product)
    for (rows, width), blob in blobs.items():
        entries[f"exported/{platform}/{rows}x{width}.jaxexport"] = (blob, False)
    entries.update({n: (b, True) for n, b in _cuda_libraries(profile, cuda_ops).items()})
    entries["profile.json"] = (_canonical(profile.to_dict()) + b"\n", False)
    manifest = {
        "format": FORMAT, "lane": profile.name, "platform": platform, **_versions(),
        "plan": profile.plan.to_dict(), "plan_digest": profile.plan.digest(),
        "model_config": _model_config(runner.model.cfg), "batch": runner.B,
        "prefill_chunk": runner.prefill_chunk, "profile_sha256": profile.canonical_hash(),
        "shapes": [list(sw) for sw in sorted(blobs)],
        "files": {n: _sha256(entries[n][0]) for n in sorted(entries)},
    }
    entries[MANIFEST] = (json.dumps(manifest, sort_keys=True, indent=1).encode() + b"\n", False)
    data = _tar_bytes(entries, _epoch(epoch))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"sha256": _sha256(data), "size": len(data), "files": len(entries),
            "export_s": round(export_s, 3)}


@dataclass(frozen=True)
class Bundle:
    """A verified bundle's manifest (bundle.json) and files, in memory."""
    path: Path
    manifest: dict
    files: dict  # name -> bytes

    @property
    def lane(self) -> str:
        return self.manifest["lane"]

    @property
    def platform(self) -> str:
        return self.manifest["platform"]

    def profile(self) -> dict:
        return json.loads(self.files["profile.json"])

    def forwards(self, platform: str) -> dict[tuple[int, int], bytes]:
        """{(rows, width): exported forward} for `platform`; BundleError if it has none."""
        prefix, out = f"exported/{platform}/", {}
        for name, data in self.files.items():
            if name.startswith(prefix) and name.endswith(".jaxexport"):
                rows, width = name[len(prefix):-len(".jaxexport")].split("x")
                out[(int(rows), int(width))] = data
        if not out:
            raise BundleError(f"{self.path}: no forwards exported for platform {platform!r} "
                              f"(the bundle is for {self.platform!r})")
        return out

    def cuda_libraries(self) -> dict[str, bytes]:
        return {n[len("cuda/"):]: b for n, b in self.files.items() if n.startswith("cuda/")}


def _read_members(path: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    current = None
    try:
        with tarfile.open(path, mode="r:") as tf:
            for m in tf:
                current = m.name
                if not m.isfile():
                    raise BundleError(f"{path}: {m.name} is not a regular file")
                if m.name in files:
                    raise BundleError(f"{path}: {m.name} appears twice")
                data = tf.extractfile(m).read()
                if len(data) != m.size:
                    raise BundleError(f"{path}: {m.name} is truncated")
                files[m.name] = data
    except (tarfile.TarError, EOFError, OSError) as e:
        where = f" at or after {current}" if current else ""
        raise BundleError(f"{path}: not a readable bundle tar{where} ({e})") from None
    return files


def open_bundle(path, expect_lane: str | None = None) -> Bundle:
    """Read and verify a bundle: bundle.json's format, every file's sha256 against it, and
    no file missing or extra. BundleError names the first file that differs."""
    path = Path(path)
    files = _read_members(path)
    if MANIFEST not in files:
        raise BundleError(f"{path}: no {MANIFEST} (not an engine bundle, or truncated)")
    try:
        manifest = json.loads(files.pop(MANIFEST))
    except ValueError as e:
        raise BundleError(f"{path}: {MANIFEST} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: {MANIFEST} format is {manifest.get('format')!r}, "
                          f"not {FORMAT!r}")
    listed = manifest.get("files") or {}
    for name in sorted(listed):
        if name == MANIFEST:
            continue
        if name not in files:
            raise BundleError(f"{path}: {name} is missing")
        if _sha256(files[name]) != listed[name]:
            raise BundleError(f"{path}: {name} does not match its sha256 in {MANIFEST}")
    extra = sorted(set(files) - set(listed))
    if extra:
        raise BundleError(f"{path}: {extra[0]} is not listed in {MANIFEST}")
    if expect_lane is not None and manifest.get("lane") != expect_lane:
        raise BundleError(f"{path}: the bundle is for lane {manifest.get('lane')!r}, not "
                          f"{expect_lane!r}")
    return Bundle(path=path, manifest=manifest, files=files)
