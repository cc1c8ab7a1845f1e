"""The release: per-lane engine bundles, SBOMs and OCI images, bound by one manifest.

`./ninfer release build [--out dist/v0.16.0]` (and `bazel run //release:v0_16_0`, and the Nix
flake) write a release directory; `./ninfer release verify DIR` checks one. The layout:

    DIR/manifest.json                    binds every file's sha256, every bundle and OCI digest,
                                         the locks and the qualification receipts
    DIR/SHA256SUMS                       every file but itself, `sha256  path`, sorted
    DIR/compatibility.json               lanes, cards, OMP versions, checkpoint fingerprints
    DIR/locks/requirements*.lock         the hashed locks the bundles were built from
    DIR/lanes/<lane>/profile.json        the lane's resolved profile (canonical JSON)
    DIR/lanes/<lane>/engine-bundle.tar   the engine bundle (release/bundle.py)
    DIR/lanes/<lane>/sbom.spdx.json      SPDX 2.3 (sbom/spdx.py)
    DIR/lanes/<lane>/sbom.cdx.json       CycloneDX 1.6 (sbom/cyclonedx.py)
    DIR/lanes/<lane>/oci/                an OCI image layout (release/oci.py)
    DIR/qualification/<lane>.json        the lane receipts that exist

Modules: lockfile (parse a hashed lock), lock (`./ninfer lock`), wheels (the lock's wheels,
fetched and checked by hash), bundle (engine bundles), oci (image layouts), build (the whole
release), manifest, verify.
"""
