"""A run's compiled code in one file, to start warm on another machine: PyTorch's portable compile cache.

    python train.py config/20m_muon_wsd.py --compile_cache=out/20m.compile   # compiles, then saves the file
    python train.py config/20m_muon_wsd.py --compile_cache=out/20m.compile   # here or on a fresh node: loads it

torch.compiler.save_cache_artifacts() gathers what this process compiled (Inductor's graphs, AOTAutograd's
entries, the Triton kernels and their autotuning picks) and load_cache_artifacts() puts them into the local
caches, so the next compile of the same graphs finds them instead of generating code. Each of those entries is
keyed by torch on its graph and options, so a cache of other settings is only missed, never used. flash-attn-4
keeps its compiled CuTe kernels in a folder of its own, outside torch's caches, and Triton compiles our kernels that
run inside custom ops (the fused loss's rows), outside torch.compile's code, into its own cache, with the C helpers it
builds to launch any kernel: the file carries that folder and those entries of Triton's cache too. cuDNN generates
its attention forward at run time as PTX, which the CUDA driver compiles into its own JIT cache (CUDA_CACHE_PATH, else
~/.nv/ComputeCache), 0.3 to 0.6 s of a loaded start on a fresh machine (docs/COLD_START.md): the file carries that
folder too, up to JIT_MAX_BYTES, and puts it in place only where the machine's holds no file; the driver checks its
entries itself (a newer driver compiles again).
The file adds a key of its own around them, the things torch's keys do not promise to cover: the torch, Triton
and CUDA versions, Python's (Triton's .so helpers are built for it), the GPU, the kernel packages and this
repository's code. A file whose key differs is ignored with a line saying what differs, and rewritten when this run
has compiled; a file that is not a compile cache is never written over.
"""
import collections
import io
import json
import os
import platform
import tarfile
import tempfile
from pathlib import Path

import torch

import env
import model_kernels
from results import atomic_write, atomic_write_text

MAGIC = b"tiny-llm compile cache\n"
FORMAT = 2  # 2: the files after torch's bytes are one tar of flash-attn-4's folder and Triton's entries
STAGING = ".unpack-"  # unpack_kernel_files' temporary folders, which a killed process leaves behind
JIT_MAX_BYTES = 64 * 2**20  # the driver's JIT cache is carried up to this size (a run's own entries: under 1 MiB)


class CompileCacheError(ValueError):
    """A compile_cache path that holds something other than a compile cache."""


def key(device):
    """What a cache's code depends on beyond torch's own keys: versions, the device and the repository's code."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = f"{torch.cuda.get_device_name(index)} sm_{''.join(map(str, torch.cuda.get_device_capability(index)))}"
    else:
        name = f"cpu {platform.machine()}"
    versions = env.package_versions(("torch", "triton", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels"))
    return {"format": FORMAT, "device": name, "cuda": torch.version.cuda, "python": platform.python_version(),
            **versions, "code": env.source_hash()}


def check_path(path):
    """A CompileCacheError when path holds something other than a compile cache (read: its first bytes only)."""
    path = Path(path)
    if not path.exists():
        return
    start = b""
    if path.is_file():
        with open(path, "rb") as f:
            start = f.read(len(MAGIC))
    if start != MAGIC:
        raise CompileCacheError(f"compile_cache {path} exists and is not a compile cache this project wrote; give "
                                f"a new path (the file is made after the first update) or one made before")


def read(path):
    """(key, artefacts) of a cache file, the key None where its header is damaged (a copy cut inside it); None when
    there is no file. CompileCacheError for another kind of file."""
    check_path(path)
    path = Path(path)
    if not path.exists():
        return None
    header, _, artefacts = path.read_bytes()[len(MAGIC):].partition(b"\n")
    try:
        stored = json.loads(header)
    except ValueError:
        stored = None
    return (stored if isinstance(stored, dict) else None), artefacts


def kernel_folder():
    """flash-attn-4's folder of compiled CuTe kernels (flash_attn.cute.cache_utils.get_cache_path's), or None when
    its on-disk cache is off (model_kernels/attention.py turns it on)."""
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0") != "1":
        return None
    folder = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    if folder:
        return Path(folder)
    import getpass
    return Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


def triton_folder():
    """Triton's cache folder (env.compiler_cache's, by Triton's rule)."""
    return Path(env.compiler_cache()["TRITON_CACHE_DIR"])


def triton_entries():
    """The entries of Triton's cache that torch's artefacts do not hold: those of our kernels launched from custom ops
    (model_kernels.OPAQUE_TRITON_KERNELS) and the compiled C helpers (Triton's driver utilities and kernel launchers,
    .so files named for the Python that built them). Each entry is a folder named by Triton's key of its contents."""
    folder = triton_folder()
    if not folder.is_dir():
        return []
    ours = set(model_kernels.OPAQUE_TRITON_KERNELS)
    return sorted(entry for entry in folder.iterdir() if entry.is_dir() and any(
        f.suffix == ".so" or f.name.split(".")[0] in ours for f in entry.iterdir()))


def jit_folder():
    """The CUDA driver's JIT cache folder (CUDA_CACHE_PATH, else ~/.nv/ComputeCache), None where CUDA_CACHE_DISABLE=1
    keeps none."""
    if os.environ.get("CUDA_CACHE_DISABLE") == "1":
        return None
    return Path(os.environ.get("CUDA_CACHE_PATH") or Path.home() / ".nv" / "ComputeCache")


def jit_files():
    """The driver's JIT cache folder when it holds files, JIT_MAX_BYTES at most (else None: not carried)."""
    folder = jit_folder()
    files = [f for f in folder.rglob("*") if f.is_file()] if folder is not None and folder.is_dir() else []
    return folder if files and sum(f.stat().st_size for f in files) <= JIT_MAX_BYTES else None


def kernel_files():
    """flash-attn-4's kernel folder, triton_entries() and the driver's JIT cache (jit_files) as one uncompressed tar
    (b"" when there is none of them)."""
    folder, entries, jit = kernel_folder(), triton_entries(), jit_files()
    if (folder is None or not folder.is_dir()) and not entries and jit is None:
        return b""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        if folder is not None and folder.is_dir():
            tar.add(folder, arcname="flash-attn-4", filter=lambda m: None if STAGING in m.name else m)
        for entry in entries:
            tar.add(entry, arcname=f"triton/{entry.name}")
        if jit is not None:
            tar.add(jit, arcname="cuda-jit")
    return buffer.getvalue()


def unpack_kernel_files(data):
    """Put saved kernel files where flash-attn-4, Triton and the CUDA driver look. Each Triton entry (a folder), each
    file of flash-attn-4's and the driver's JIT cache (its index with its entries, only where the machine's holds no
    file) go into place whole or not at all (_unpack_whole); one already there is kept."""
    if not data:
        return
    folders = {"flash-attn-4": kernel_folder(), "triton": triton_folder(), "cuda-jit": _empty_jit_folder()}
    wholes = collections.defaultdict(list)  # {(top, its path under top's folder): its members}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            top, _, name = member.name.partition("/")
            if folders.get(top) is None or not name or (top != "triton" and not member.isfile()):
                continue
            if top == "cuda-jit":  # the folder itself is the whole
                whole, member.name = "", f"{folders[top].name}/{name}"
            else:
                whole = name.split("/")[0] if top == "triton" else name
                member.name = name[len(whole.rpartition("/")[0]):].lstrip("/")  # named from the folder it goes into
            wholes[top, whole].append(member)
        for (top, whole), members in wholes.items():
            _unpack_whole(tar, folders[top] / whole, members)


def _empty_jit_folder():
    """The driver's JIT cache folder when it is absent or empty (then removed, for _unpack_whole to put the saved one
    there), else None: a machine's own cache is never merged into."""
    folder = jit_folder()
    if folder is None or not folder.exists():
        return folder
    try:
        folder.rmdir()  # only an empty folder: one that holds anything, or gains it meanwhile, is the machine's
    except OSError:
        return None
    return folder


def _unpack_whole(tar, final, members):
    """Unpack members into a temporary folder beside final and rename the result to final, so that a killed process
    leaves no part of it under its name. Triton's group files name their members by absolute path, so those
    unpacked are pointed at final first."""
    if final.exists():  # put there whole, by this or by Triton's and flash-attn-4's own writes
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=STAGING) as staging:
        tar.extractall(staging, members=members, filter="data")
        for group in Path(staging, final.name).glob("__grp__*.json"):
            _point_group_here(group, final)
        try:
            os.replace(Path(staging, final.name), final)
        except OSError:  # another process put it there meanwhile
            pass


def _point_group_here(group, folder):
    """Rewrite a Triton group file's member paths to folder (atomically; one already right is left alone)."""
    try:
        data = json.loads(group.read_text())
    except ValueError:  # a damaged group file: Triton ignores it and compiles again, as it would have
        return
    paths = data.get("child_paths") if isinstance(data, dict) else None
    if not isinstance(paths, dict):
        return
    here = {name: str(folder / Path(path).name) for name, path in paths.items()}
    if here != paths:
        atomic_write_text(group, json.dumps(dict(data, child_paths=here)))


def differences(stored, expected):
    """The key's fields that differ, as 'field: stored (here expected)' (torch_bytes is the file's layout)."""
    return [f"{k}: {stored.get(k)} (here {v})" for k, v in expected.items() if stored.get(k) != v]


def load(path, device):
    """Put a saved cache into this process's compiler caches when its key matches; returns (loaded, the line to
    print)."""
    found = read(path)
    if found is None:
        return False, f"compile cache {path}: none yet; compiling, then saving it there after the first update"
    stored, artefacts = found
    if stored is None:  # cut inside its header (an interrupted copy), or edited
        return False, (f"compile cache {path} is damaged (its header does not read); compiling, and it is written "
                       f"again after the first update")
    changed = differences(stored, key(device))
    if changed:
        return False, f"compile cache {path} ignored, made for other code or machine ({'; '.join(changed)}); compiling"
    torch_bytes, total = stored.get("torch_bytes", len(artefacts)), stored.get("total_bytes", len(artefacts))
    if len(artefacts) != total or torch_bytes > total:  # cut short (an interrupted copy): torch would load nothing
        return False, (f"compile cache {path} is damaged ({len(artefacts):,} bytes of the {total:,} written; an "
                       f"interrupted copy?); compiling, and it is written again after the first update")
    info = torch.compiler.load_cache_artifacts(artefacts[:torch_bytes])
    unpack_kernel_files(artefacts[torch_bytes:])
    count = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
    return True, f"compile cache {path}: loaded {count} entries ({len(artefacts) / 2**20:.1f} MiB)"


def save(path, device):
    """Write what this process compiled to path (atomically); returns the line to print, or None with nothing to
    save."""
    check_path(path)  # refuses to replace a file that is not a compile cache
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    artefacts, _ = saved
    kernels = kernel_files()
    header = json.dumps(dict(key(device), torch_bytes=len(artefacts), total_bytes=len(artefacts) + len(kernels)),
                        sort_keys=True).encode()
    atomic_write(path, lambda f: f.write(MAGIC + header + b"\n" + artefacts + kernels))
    return f"compile cache {path}: saved {len(artefacts) / 2**20:.1f} MiB"
