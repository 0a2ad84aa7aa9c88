#!/usr/bin/env python3
"""Build ``deploy/Dockerfile`` with buildah and hand its filesystem to the multi-host test, so the processes tested
are the image the manifests name.

No registry and no Docker engine here: the base image is made locally with ``debootstrap --variant=minbase``
(Debian bookworm from the mirror this machine's apt uses, plus python3 and python3-venv) and committed with buildah
as ``localhost/umbp-base:bookworm``; the Dockerfile takes it as ``--build-arg BASE``. ``buildah bud --isolation
chroot`` runs the RUN steps in a chroot (no OCI runtime: podman's cannot start here). pip inside the build gets this
machine's pip settings: ``PIP_INDEX_URL``/``PIP_EXTRA_INDEX_URL``/``PIP_FIND_LINKS``/``PIP_TRUSTED_HOST`` (from the
environment and ``pip config``) as build arguments, local find-links directories mounted read-only, and the CA
bundle as a build secret (never in a layer).

Caching, so ``make test`` pays the build once per change: buildah's store lives under ``build/image/`` (ignored by
git, removed by ``make clean``); the base is made once; the image is tagged with a hash of everything it is built
from (Dockerfile, ignore file, pyproject, README, umbp/, metaserver/, transport/, base image id) and rebuilt only
when that changes, with ``--layers`` so a code change reuses the torch layer. Older test tags are removed.
``build/image/last-build.json`` records what was built and how long it took.

``rootfs_for_tests()`` returns ``(path, note)``: a mounted working container of the image (``release()`` unmounts
and removes it), or ``(None, why)`` when the build cannot run here (not root, no buildah/debootstrap and no apt to
install them, no network for debootstrap or pip, a build error, ``UMBP_TEST_IMAGE=0``); callers then run the checkout
and say so. ``UMBP_TEST_IMAGE=<tag>`` tests that image (already in the store) instead of building one.

Usage: ``python tests/image.py build`` (build or confirm the cache, print the tag and timings),
``python tests/image.py clean`` (remove the store).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILD = REPO / "build" / "image"
BASE_TAG = "localhost/umbp-base:bookworm"
IMAGE_REPO = "localhost/umbp"
SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
INPUTS = ["deploy/Dockerfile", "deploy/Dockerfile.dockerignore", "pyproject.toml", "README.md"]
INPUT_DIRS = ["umbp", "metaserver", "transport"]
BASE_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 1200

_container: str | None = None


class ImageError(Exception):
    pass


def log(msg: str) -> None:
    print(f"image: {msg}", file=sys.stderr, flush=True)


def buildah(*args: str, timeout: float = 120, input: str | None = None) -> str:
    cmd = ["buildah", "--root", str(BUILD / "storage"), "--runroot", str(BUILD / "run"), *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                           stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"`{shlex.join(cmd[:6])} ...` did not finish within {timeout}s\n"
                         f"{(e.stdout or '')[-3000:]}{(e.stderr or '')[-3000:]}") from None
    if r.returncode != 0:
        raise ImageError(f"`buildah {shlex.join(args)[:300]}` exited with {r.returncode}:\n"
                         f"{r.stdout[-3000:]}{r.stderr[-4000:]}")
    return r.stdout.strip()


# ------------------------------------------------------------------------------------------------------ tools

def ensure_tools() -> None:
    """buildah and debootstrap on PATH; installed with apt-get when root and missing. Raises ImageError."""
    if os.environ.get("UMBP_TEST_IMAGE") == "0":
        raise ImageError("UMBP_TEST_IMAGE=0 is set (0: run the checkout; a tag: test that image, built elsewhere)")
    if os.geteuid() != 0:
        raise ImageError("not root: debootstrap and buildah's chroot isolation need root")
    missing = [b for b in ("buildah", "debootstrap") if shutil.which(b) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ImageError(f"{' and '.join(missing)} missing and no apt-get to install them")
    log(f"installing {' '.join(missing)} with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode != 0 or any(shutil.which(b) is None for b in missing):
        raise ImageError(f"apt-get install {' '.join(missing)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources), else deb.debian.org."""
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            if p.suffix in ("", ".list", ".sources"):
                texts.append(p.read_text())
    for t in texts:
        for m in re.finditer(r"^URIs:\s*(\S+)", t, re.M):
            if "security" not in m.group(1):
                return m.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", t, re.M):
            if "security" not in m.group(1):
                return m.group(1)
    return "http://deb.debian.org/debian"


# ------------------------------------------------------------------------------------------------------ images

def _images() -> dict[str, str]:
    out = buildah("images", "--json")
    found = {}
    for img in json.loads(out or "null") or []:
        for name in img.get("names") or []:
            found[name] = img["id"]
    return found


def base_image() -> tuple[str, float]:
    """Make the debootstrap base once; returns (image id, seconds spent now: 0 when cached)."""
    have = _images()
    if BASE_TAG in have:
        return have[BASE_TAG], 0.0
    t0 = time.monotonic()
    mirror = debian_mirror()
    log(f"making the base image: debootstrap --variant=minbase --include={BASE_PACKAGES} {SUITE} from {mirror}")
    ctr = buildah("from", "--name", f"umbp-base-{os.getpid()}", "scratch")
    try:
        mnt = buildah("mount", ctr)
        r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, mnt, mirror],
                           capture_output=True, text=True, timeout=BASE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise ImageError(f"debootstrap failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in Path(mnt, d).glob("*"):
                if f.is_file():
                    f.unlink()
        buildah("umount", ctr)
        buildah("config", "--env", "LANG=C.UTF-8", "--cmd", "/bin/bash", ctr)
        buildah("commit", "--rm", ctr, BASE_TAG, timeout=600)
        ctr = ""
    finally:
        if ctr:
            with contextlib.suppress(ImageError):
                buildah("rm", ctr)
    took = time.monotonic() - t0
    (BUILD / "base.json").write_text(json.dumps({"tag": BASE_TAG, "mirror": mirror, "packages": BASE_PACKAGES,
                                                 "seconds": round(took, 1)}, indent=2) + "\n")
    return _images()[BASE_TAG], took


def inputs_hash(base_id: str) -> str:
    h = hashlib.sha256(base_id.encode())
    files = [REPO / p for p in INPUTS]
    for d in INPUT_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix != ".pyc")
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def pip_settings() -> tuple[dict[str, str], list[str]]:
    """(build args, read-only volumes) carrying this machine's pip configuration into the build."""
    conf: dict[str, str] = {}
    py = REPO / ".venv" / "bin" / "python"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run([str(py if py.exists() else sys.executable), "-m", "pip", "config", "list"],
                           capture_output=True, text=True, timeout=30)
        for line in r.stdout.splitlines():
            m = re.match(r"^[\w]+\.([\w-]+)='(.*)'$", line)
            if m:
                conf[m.group(1)] = m.group(2)
    args, vols = {}, []
    for key in ("index-url", "extra-index-url", "find-links", "trusted-host"):
        env = "PIP_" + key.upper().replace("-", "_")
        val = os.environ.get(env) or conf.get(key)
        if val:
            args[env] = val
    # local indexes and wheel directories (find-links paths, file:// index URLs) are mounted where pip expects them
    for key in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        for d in (args.get(key) or "").split():
            d = d[len("file://"):] if d.startswith("file://") else d
            if d.startswith("/") and Path(d).is_dir():
                top = Path(d).parent if Path(d).name == "simple" else Path(d)  # an index links to files beside it
                vol = f"{top}:{top}:ro"
                if vol not in vols:
                    vols.append(vol)
    return args, vols


def build() -> dict:
    """Build (or find cached) the image; returns the build record (tag, cached, seconds...)."""
    ensure_tools()
    BUILD.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    base_id, base_s = base_image()
    tag = f"{IMAGE_REPO}:test-{inputs_hash(base_id)}"
    images = _images()
    rec = {"tag": tag, "base": BASE_TAG, "base_seconds": round(base_s, 1)}
    if tag in images:
        rec.update(cached=True, build_seconds=0.0)
        return rec
    args, vols = pip_settings()
    cmd = ["bud", "--isolation", "chroot", "--layers", "-f", str(REPO / "deploy" / "Dockerfile"),
           "--ignorefile", str(REPO / "deploy" / "Dockerfile.dockerignore"), "--build-arg", f"BASE={BASE_TAG}",
           "-t", tag]
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    for v in vols:
        cmd += ["-v", v]
    ca = os.environ.get("PIP_CERT") or CA_BUNDLE
    if Path(ca).is_file():
        cmd += ["--secret", f"id=pip_ca,src={ca}"]
    log(f"building {tag} (pip: {', '.join(f'{k}={v}' for k, v in args.items()) or 'defaults'}"
        f"{', CA ' + ca if Path(ca).is_file() else ''})")
    tb = time.monotonic()
    buildah(*cmd, str(REPO), timeout=BUILD_TIMEOUT_S)
    rec.update(cached=False, build_seconds=round(time.monotonic() - tb, 1))
    for name in images:  # keep one test image: older tags go, their unshared layers with them
        if name.startswith(f"{IMAGE_REPO}:test-") and name != tag:
            with contextlib.suppress(ImageError):
                buildah("rmi", name)
    rec["total_seconds"] = round(time.monotonic() - t0, 1)
    (BUILD / "last-build.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


# ------------------------------------------------------------------------------------------------------ for tests

def sweep_containers() -> None:
    """Remove working containers of test runs whose process is gone."""
    with contextlib.suppress(ImageError, ValueError):
        for c in json.loads(buildah("containers", "--json") or "null") or []:
            name = c.get("containername", "")
            m = re.fullmatch(r"umbp-(?:mh|base)-(\d+)", name)
            # a failed `buildah bud` leaves its "<id>-working-container" behind
            if (m and not Path(f"/proc/{m.group(1)}").exists()) or name.endswith("-working-container"):
                with contextlib.suppress(ImageError):
                    buildah("umount", c["id"])
                    buildah("rm", c["id"])


def rootfs_for_tests() -> tuple[str | None, str]:
    """Build (or reuse) the image and mount a working container of it: (root path, note), or (None, why not)."""
    global _container
    try:
        ensure_tools()
        BUILD.mkdir(parents=True, exist_ok=True)
        sweep_containers()
        given = os.environ.get("UMBP_TEST_IMAGE", "")
        if given and given != "1":  # an image built elsewhere, already in build/image's store
            if given not in _images():
                raise ImageError(f"UMBP_TEST_IMAGE={given}: no such image in {BUILD / 'storage'}")
            rec = {"tag": given, "cached": True, "given": True}
        else:
            rec = build()
        name = f"umbp-mh-{os.getpid()}"
        _container = buildah("from", "--name", name, rec["tag"])
        root = buildah("mount", _container)
        if not Path(root, "opt/umbp/bin/umbp").exists():
            raise ImageError(f"{rec['tag']} has no /opt/umbp/bin/umbp")
        how = "given by UMBP_TEST_IMAGE" if rec.get("given") else "cached" if rec["cached"] else (f"built in {rec['build_seconds']}s"
                                               + (f", base made in {rec['base_seconds']}s" if rec['base_seconds']
                                                  else ", base cached"))
        return root, f"image {rec['tag']} ({how}; buildah --isolation chroot, base {BASE_TAG} from debootstrap)"
    except (ImageError, OSError, subprocess.SubprocessError) as e:
        release()
        return None, f"the image could not be built or mounted here: {e}"


def release() -> None:
    global _container
    if _container:
        with contextlib.suppress(ImageError):
            buildah("umount", _container)
        with contextlib.suppress(ImageError):
            buildah("rm", _container)
        _container = None


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        try:
            rec = build()
        except ImageError as e:
            print(f"image: {e}", file=sys.stderr)
            return 1
        print(json.dumps(rec, indent=2))
        return 0
    if argv[:1] == ["clean"]:
        sweep_containers()
        with contextlib.suppress(ImageError):
            buildah("rm", "--all")
        with contextlib.suppress(ImageError):
            buildah("rmi", "--all", "--force")
        shutil.rmtree(BUILD, ignore_errors=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
