"""CPU check of trim_fi_csrc.py (dev machine, needs nvcc, no GPU): preprocess (nvcc -E, sm_90a) every
translation unit that could reach flashinfer/data/csrc on the carried path in a full site and in the
trimmed one, and compare the outputs. A trimmed-away header that a file includes shows up as a
different output (a "No such file" where the full tree had the header).

Usage: python3 check_fi_csrc_trim.py FULL_SITE TRIMMED_SITE STUB_DIR [--nvcc PATH] [--jobs N]
Both sites need flashinfer (with data/), sglang and tvm_ffi. A header that is missing in the FULL site
(a CUDA library the dev machine's toolkit lacks, torch's ATen, FlashInfer's downloaded cubin headers)
gets an empty stand-in in STUB_DIR, searched last, so that preprocessing goes on past it; stand-ins
come only from the full site's failures, which the trimmed site (a subset) shares.
Translation units: csrc/norm.cu and csrc/flashinfer_norm_binding.cu (flashinfer.norm's JIT), every
.cu/.cuh/.cpp of the sglang package, and the csrc files that sglang's Python names as JIT sources."""
import argparse
import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trim_fi_csrc import NAMED, include_dirs  # noqa: E402


def preprocess(nvcc, site, rel, stub):
    flags = ["-E", "-x", "cu", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DENABLE_BF16", "-DENABLE_FP8"]
    flags += [f"-I{d}" for d in include_dirs(site)]
    if stub:
        flags += ["-isystem", stub]
    run = subprocess.run([nvcc, *flags, str(site / rel)], capture_output=True, text=True, cwd=site)
    return run.returncode, (run.stdout + run.stderr).replace(str(site) + "/", "")


def stub_missing(nvcc, site, rel, stub, rounds=60):
    """Preprocess in the full site, adding an empty stand-in for each missing header, until it passes."""
    for _ in range(rounds):
        rc, out = preprocess(nvcc, site, rel, stub)
        missing = re.search(r"fatal error: (\S+): No such file", out)
        if rc == 0 or not missing or ".." in missing.group(1) or missing.group(1).startswith("/"):
            return
        target = Path(stub) / missing.group(1)
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("")


def units(site):
    csrc = site / "flashinfer" / "data" / "csrc"
    found = [csrc / "norm.cu", csrc / "flashinfer_norm_binding.cu"]
    for path in sorted((site / "sglang").rglob("*")):
        if path.suffix in {".cu", ".cuh", ".cpp"} and "hip" not in path.name:
            found.append(path)
        elif path.suffix == ".py":
            found += [csrc / n for n in NAMED.findall(path.read_text(errors="ignore")) if (csrc / n).is_file()]
    return sorted({p.relative_to(site) for p in found})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("full", type=Path)
    parser.add_argument("trimmed", type=Path)
    parser.add_argument("stub")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    full, trimmed = args.full.resolve(), args.trimmed.resolve()
    todo = units(full)
    Path(args.stub).mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda rel: stub_missing(args.nvcc, full, rel, args.stub), todo))
    same = differ = clean = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = pool.map(lambda rel: (rel, preprocess(args.nvcc, full, rel, args.stub),
                                        preprocess(args.nvcc, trimmed, rel, args.stub)), todo)
        for rel, (rc_a, out_a), (rc_b, out_b) in results:
            if (rc_a, out_a) == (rc_b, out_b):
                same += 1
                clean += rc_a == 0
            else:
                differ += 1
                missing = [line for line in out_b.splitlines() if "No such file" in line][:2]
                print(f"DIFFERS {rel}: rc {rc_a} -> {rc_b} {missing}")
    print(f"{len(todo)} translation units: {same} preprocess the same in both sites ({clean} without error), "
          f"{differ} differ; {sum(1 for p in Path(args.stub).rglob('*') if p.is_file())} stand-in headers")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
