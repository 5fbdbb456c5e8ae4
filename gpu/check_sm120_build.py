"""What the pinned FlashInfer can build for SM120: its JIT arch gate, and nvcc on its sources.

Run by gpu/check_sm120_build.sh inside a venv that holds the pinned CUDA 13.0 compiler wheels,
CCCL and apache-tvm-ffi headers and flashinfer-python 0.6.8.post1 or the one FLASHINFER_VERSION names
(standard library only here).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import types
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])
CUDA_HOME = SITE / "nvidia" / "cu13"
NVCC = CUDA_HOME / "bin" / "nvcc"
FLASHINFER = SITE / "flashinfer"
TRTLLM_COMM_SOURCES = ["trtllm_allreduce.cu", "trtllm_allreduce_fusion.cu", "trtllm_moe_allreduce_fusion.cu"]
# A kernel that uses at least this many registers on sm_90a but at most EMPTY_REGS on SM120 had
# its body removed by the preprocessor there.
REAL_REGS, EMPTY_REGS = 16, 8


def flashinfer_version() -> str:
    for dist in SITE.glob("flashinfer_python-*.dist-info"):
        for line in (dist / "METADATA").read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "?"


def comm_gate_majors() -> list[int] | None:
    """supported_major_versions of gen_trtllm_comm_module in flashinfer/jit/comm.py (read, not run)."""
    tree = ast.parse((FLASHINFER / "jit" / "comm.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "gen_trtllm_comm_module":
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    for kw in call.keywords:
                        if kw.arg == "supported_major_versions":
                            return list(ast.literal_eval(kw.value))
    return None


def nvcc_release() -> str:
    out = subprocess.run([str(NVCC), "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "?"


def run_flashinfer_arch_selection(arch_list: str, majors: list[int]) -> dict:
    """FlashInfer's own CompilationContext, as on a box whose GPUs are `arch_list`; torch is a stub
    (only the GPU query uses it, and FLASHINFER_CUDA_ARCH_LIST replaces that query)."""
    stub_torch = types.ModuleType("torch")
    stub_ext = types.ModuleType("flashinfer.jit.cpp_ext")
    release = tuple(int(x) for x in nvcc_release().split("."))
    stub_ext.is_cuda_version_at_least = lambda v: release >= tuple(int(x) for x in v.split("."))
    stub_ext.get_cuda_path = lambda: str(CUDA_HOME)   # 0.7.x asks nvcc whether it knows compute_107
    saved = {k: sys.modules.get(k) for k in ("torch", "flashinfer", "flashinfer.jit", "flashinfer.jit.cpp_ext")}
    sys.modules.update({"torch": stub_torch, "flashinfer": types.ModuleType("flashinfer"),
                        "flashinfer.jit": types.ModuleType("flashinfer.jit"), "flashinfer.jit.cpp_ext": stub_ext})
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = arch_list
    try:
        spec = importlib.util.spec_from_file_location("fi_compilation_context", FLASHINFER / "compilation_context.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        context = module.CompilationContext()
        result = {"arch_list": arch_list, "targets": sorted("".join(map(str, t)) for t in context.TARGET_CUDA_ARCHS)}
        try:
            result["flags"] = context.get_nvcc_flags_list(supported_major_versions=majors)
            result["builds"] = True
        except RuntimeError as exc:
            result.update(builds=False, error=str(exc))
        return result
    finally:
        os.environ.pop("FLASHINFER_CUDA_ARCH_LIST", None)
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def nvcc_argv(source: Path, arch: str, out: Path, threads: int) -> list[str]:
    """FlashInfer's JIT command for one source (flashinfer/jit/core.py gen_jit_spec, cpp_ext.py
    build_cuda_cflags / get_system_includes), for one arch, with ptxas -v for the register use."""
    virtual = "compute_" + arch.split("_", 1)[1]
    includes = [sysconfig.get_path("include"), CUDA_HOME / "include", CUDA_HOME / "include" / "cccl",
                SITE / "tvm_ffi" / "include", FLASHINFER / "data" / "include", FLASHINFER / "data" / "csrc",
                FLASHINFER / "data" / "cutlass" / "include", FLASHINFER / "data" / "cutlass" / "tools" / "util" / "include",
                FLASHINFER / "data" / "spdlog" / "include"]
    argv = [str(NVCC), "-std=c++17", f"--threads={threads}", "-use_fast_math", "-DFLASHINFER_ENABLE_F16",
            "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3", "-DFLASHINFER_ENABLE_FP8_E5M2",
            "-DNDEBUG", "-O3", "--compiler-options=-fPIC", "--expt-relaxed-constexpr",
            "-static-global-template-stub=false", f"-gencode=arch={virtual},code={arch}",
            "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1", "-Xptxas", "-v"]
    for folder in includes:
        if Path(folder).is_dir():
            argv += ["-isystem", str(folder)]
    return argv + ["-c", str(source), "-o", str(out)]


def kernel_registers(log: str) -> dict[str, int]:
    """{mangled kernel name: registers} from ptxas -v output."""
    found, current = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            current = entry.group(1)
            continue
        used = re.search(r"Used (\d+) registers", line)
        if used and current:
            found[current] = int(used.group(1))
            current = None
    return found


def kernel_family(mangled: str) -> str:
    """The kernel's name without namespace and template arguments (read from the Itanium mangling:
    _ZN <len><name>... ), e.g. allreduce_fusion_kernel_oneshot_lamport."""
    pos = 3 if mangled.startswith("_ZN") else 2 if mangled.startswith("_Z") else 0
    last = mangled
    while pos < len(mangled):
        if mangled[pos] == "L":          # internal linkage marker before a name
            pos += 1
        digits = re.match(r"\d+", mangled[pos:])
        if not digits:
            break
        pos += len(digits.group(0))
        last = mangled[pos:pos + int(digits.group(0))]
        pos += int(digits.group(0))
    return last


def compile_one(source: str, arch: str, work: Path, threads: int) -> dict:
    src = FLASHINFER / "data" / "csrc" / source
    out = work / f"{Path(source).stem}.{arch}.o"
    started = time.monotonic()
    done = subprocess.run(nvcc_argv(src, arch, out, threads), capture_output=True, text=True)
    log = done.stdout + done.stderr
    (work / f"{Path(source).stem}.{arch}.log").write_text(log)
    errors = [line for line in log.splitlines() if "error" in line.lower() and "ptxas info" not in line]
    return {"source": source, "arch": arch, "ok": done.returncode == 0, "rc": done.returncode,
            "seconds": round(time.monotonic() - started, 1), "kernels": kernel_registers(log),
            "errors": errors[:40], "object_bytes": out.stat().st_size if out.exists() else 0}


def compare(results: list[dict], control: str) -> list[dict]:
    """Per source and SM120 arch: kernels that are real on the control arch and empty on SM120."""
    by_key = {(r["source"], r["arch"]): r for r in results}
    rows = []
    for r in results:
        base = by_key.get((r["source"], control))
        if r["arch"] == control or not base or not r["ok"] or not base["ok"]:
            continue
        emptied = sorted(name for name, regs in base["kernels"].items()
                         if regs >= REAL_REGS and r["kernels"].get(name, REAL_REGS) <= EMPTY_REGS)
        families: dict[str, int] = {}
        for name in emptied:
            families[kernel_family(name)] = families.get(kernel_family(name), 0) + 1
        rows.append({"source": r["source"], "arch": r["arch"], "kernels": len(r["kernels"]),
                     "emptied": len(emptied), "emptied_families": families})
    return rows


def summarized(data: dict) -> dict:
    """report.json: per compile, the kernels by family with their register range (the full
    per-kernel map goes to build/kernels.json)."""
    short = dict(data, compiles=[])
    for r in data["compiles"]:
        families: dict[str, list[int]] = {}
        for name, regs in r["kernels"].items():
            families.setdefault(kernel_family(name), []).append(regs)
        short["compiles"].append(dict(r, kernels=len(r["kernels"]), families={
            f: {"count": len(v), "registers_min": min(v), "registers_max": max(v)} for f, v in sorted(families.items())}))
    return short


def report(data: dict) -> str:
    gate = data["gate"]
    lines = [f"# SM120 build check: FlashInfer {data['flashinfer']} trtllm_comm, nvcc {data['nvcc']}", "",
             f"`flashinfer/jit/comm.py` gen_trtllm_comm_module: supported_major_versions = {data['gate_majors']}", ""]
    for sel in gate:
        verdict = ("builds with " + " ".join(f for f in sel["flags"] if f.startswith("-gencode"))) if sel["builds"] \
            else f"refused: RuntimeError: {sel['error']}"
        lines.append(f"- FlashInfer JIT on a box with FLASHINFER_CUDA_ARCH_LIST={sel['arch_list']} "
                     f"(targets {', '.join(sel['targets'])}): {verdict}")
    lines += ["", "| source | arch | nvcc | seconds | kernels | object bytes |", "|---|---|---|---|---|---|"]
    for r in data["compiles"]:
        lines.append(f"| {r['source']} | {r['arch']} | {'ok' if r['ok'] else 'FAILED rc=%s' % r['rc']} | "
                     f"{r['seconds']} | {len(r['kernels'])} | {r['object_bytes']} |")
    lines += ["", f"Kernels real on {data['control']} (>= {REAL_REGS} registers) but empty on SM120 (<= {EMPTY_REGS}):", ""]
    for row in data["comparison"]:
        fams = ", ".join(f"{k} x{v}" for k, v in sorted(row["emptied_families"].items())) or "none"
        lines.append(f"- {row['source']} {row['arch']}: {row['emptied']} of {row['kernels']} kernels emptied ({fams})")
    for r in data["compiles"]:
        if not r["ok"]:
            lines += ["", f"## nvcc errors: {r['source']} {r['arch']}", "```", *r["errors"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--archs", default="sm_90a sm_120a sm_120f")
    parser.add_argument("--sources", default=" ".join(TRTLLM_COMM_SOURCES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    work = out / "build"
    work.mkdir(parents=True, exist_ok=True)
    if not NVCC.exists():
        print(f"no nvcc at {NVCC}: install the CUDA 13.0 compiler wheels first", file=sys.stderr)
        return 2
    majors = comm_gate_majors()
    data = {"flashinfer": flashinfer_version(), "nvcc": nvcc_release(), "gate_majors": majors,
            "gate": [run_flashinfer_arch_selection(a, majors or []) for a in ("9.0", "12.0", "12.1")],
            "control": args.archs.split()[0], "compiles": []}
    print(f"FlashInfer {data['flashinfer']}, nvcc {data['nvcc']}; trtllm_comm arch gate: majors {majors}", flush=True)
    for sel in data["gate"]:
        print(f"  FlashInfer JIT for {sel['arch_list']}: {'builds' if sel['builds'] else 'REFUSED: ' + sel['error']}",
              flush=True)
    for source in args.sources.split():
        for arch in args.archs.split():
            print(f"nvcc {source} for {arch} ...", flush=True)
            result = compile_one(source, arch, work, args.threads)
            data["compiles"].append(result)
            state = "ok" if result["ok"] else f"FAILED (rc {result['rc']})"
            print(f"  {state} in {result['seconds']}s, {len(result['kernels'])} kernels", flush=True)
            for line in result["errors"][:10]:
                print(f"    {line}", flush=True)
    data["comparison"] = compare(data["compiles"], data["control"])
    (work / "kernels.json").write_text(json.dumps({f"{r['source']} {r['arch']}": r["kernels"]
                                                   for r in data["compiles"]}, indent=0) + "\n")
    (out / "report.json").write_text(json.dumps(summarized(data), indent=1, sort_keys=True) + "\n")
    text = report(data)
    (out / "report.md").write_text(text)
    print(text)
    for obj in work.glob("*.o"):
        obj.unlink()  # the objects are large; the logs stay
    return 0 if all(r["ok"] for r in data["compiles"]) else 1


if __name__ == "__main__":
    sys.exit(main())
