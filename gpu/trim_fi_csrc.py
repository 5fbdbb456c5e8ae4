"""Drop the FlashInfer JIT sources (flashinfer/data/csrc) that neither the norm JIT nor SGLang's own
JIT kernels can include. Usage: python3 trim_fi_csrc.py SITE [--dry-run]

csrc holds the sources of every FlashInfer JIT module (263 MB for 0.7.2); the carried site builds one
of them, norm (flashinfer/jit/norm.py: csrc/norm.cu and csrc/flashinfer_norm_binding.cu), and SGLang's
JIT kernels put csrc (and csrc/nv_internal) on their include path (sglang/kernels/jit/utils/deps.py).
Kept: the two norm sources and every csrc file reachable from them or from any file of the sglang
package (its .cu/.cuh/.h sources and the C++ it writes from Python strings) by #include, and
every csrc file that sglang's Python names as a JIT source (its SM100 LoRA MoE module), following
includes through every header of the site's flashinfer/data, tvm_ffi and sglang trees. An include is
resolved against the including file's folder and against every include folder at once (not just the
first match), and #if branches are all followed, so the kept set is a superset of what a compiler
opens. Everything else in csrc goes (the other JIT modules' sources and jinja templates)."""
import re
import sys
from pathlib import Path

INCLUDE = re.compile(rb'#\s*include\s*[<"]([^>"\n]+)[>"]')
# a source path in a Python string, e.g. flashinfer_csrc_dir / "nv_internal/cpp/kernels/quantization.cu"
NAMED = re.compile(r'["\']([\w./-]+\.(?:cu|cuh|cpp|cc|h|hpp|inc|inl))["\']')
SOURCE_SUFFIXES = {".cu", ".cuh", ".h", ".hpp", ".hh", ".cpp", ".cc", ".c", ".inc", ".inl", ".tcc", ".ipp", ".py",
                   ".jinja"}


def include_dirs(site):
    data = site / "flashinfer" / "data"
    dirs = [data / "include", data / "csrc", data / "csrc" / "nv_internal", data / "csrc" / "nv_internal" / "include",
            data / "cutlass" / "include", data / "cutlass" / "tools" / "util" / "include", data / "spdlog" / "include",
            data / "cccl" / "cub", data / "cccl" / "libcudacxx" / "include", data / "cccl" / "thrust",
            site / "tvm_ffi" / "include", site / "tvm_ffi" / "include" / "tvm" / "ffi"]
    # SGLang's kernel include roots (<sgl_kernel/...>) are wherever an include folder sits in its tree
    dirs += [p for p in (site / "sglang").rglob("include") if p.is_dir()]
    return [d for d in dirs if d.is_dir()]


def closure(site, roots):
    dirs = include_dirs(site)
    seen, queue = set(), [p.resolve() for p in roots]
    while queue:
        path = queue.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name in INCLUDE.findall(path.read_bytes()):
            name = name.decode(errors="ignore").strip()
            for base in [path.parent] + dirs:
                candidate = (base / name).resolve()
                if candidate not in seen and candidate.is_file():
                    queue.append(candidate)
    return seen


def main():
    site = Path(sys.argv[1]).resolve()
    dry = "--dry-run" in sys.argv[2:]
    csrc = site / "flashinfer" / "data" / "csrc"
    roots = [csrc / "norm.cu", csrc / "flashinfer_norm_binding.cu"]
    missing = [r for r in roots if not r.is_file()]
    if missing:
        sys.exit(f"trim_fi_csrc: {missing[0]} not found: is this the site of a FlashInfer that builds norm so?")
    sources = [p for p in (site / "sglang").rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()]
    roots += sources
    # csrc files that sglang's Python names as JIT sources (compiled, not included)
    for path in sources:
        if path.suffix == ".py":
            roots += [csrc / name for name in NAMED.findall(path.read_text(errors="ignore")) if (csrc / name).is_file()]
    keep = {p for p in closure(site, roots) if csrc in p.parents}
    removed = kept = 0
    for path in sorted(csrc.rglob("*"), reverse=True):
        if path.is_file() and not path.is_symlink():
            if path.resolve() in keep:
                kept += path.stat().st_size
                continue
            removed += path.stat().st_size
            if not dry:
                path.unlink()
        elif path.is_dir() and not dry and not any(path.iterdir()):
            path.rmdir()
    print(f"flashinfer/data/csrc: kept {len(keep)} files ({kept >> 10} KiB) that norm's JIT or sglang's sources "
          f"include, transitively; {'would drop' if dry else 'dropped'} {removed >> 20} MiB")
    for path in sorted(keep):
        print("  kept", path.relative_to(site))


if __name__ == "__main__":
    main()
