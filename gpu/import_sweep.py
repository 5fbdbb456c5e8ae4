"""Which third-party modules a site lacks, read by importing every module of a package (device, stdlib).

    PYTHONPATH=/tmp/site:/tmp/site/_stubs python3 gpu/import_sweep.py sglang.srt sglang.kernels.ops --json OUT

A server start finds one missing module per try (the 0.5.23 calls of 2026-12-03: argparse, then the
sglang-kernel version check, then `import cutlass` while the model was built, each a call of its own).
This imports each module under the given packages in turn, in one process, and reports every
ModuleNotFoundError by the top-level name that was missing, with the modules that needed it, so a call
learns them all at once. Modules that fail otherwise (an ImportError of a name, a RuntimeError of a
platform check) are counted apart with their first line. It imports, so module-level code runs: run it
where the server would run, not beside a live one on a small GPU.
"""
import argparse
import importlib
import json
import pkgutil
import sys
import time


def modules_under(package_name):
    """The package and every module below it, found on the file system (nothing imported yet
    but the packages on the way)."""
    package = importlib.import_module(package_name)
    names = [package_name]
    for info in pkgutil.walk_packages(package.__path__, prefix=package_name + ".", onerror=lambda name: None):
        names.append(info.name)
    return names


def sweep(package_names, skip=()):
    """{"imported": n, "missing": {top-level module: [modules that needed it]},
    "failed": {module: first line of the error}, "seconds": s}."""
    t0 = time.time()
    missing, failed, imported = {}, {}, 0
    names = []
    for package_name in package_names:
        try:
            names += modules_under(package_name)
        except ModuleNotFoundError as exc:
            missing.setdefault((exc.name or "?").split(".")[0], []).append(package_name)
        except Exception as exc:  # noqa: BLE001 (reported, the sweep goes on)
            failed[package_name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    for name in names:
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        try:
            importlib.import_module(name)
            imported += 1
        except ModuleNotFoundError as exc:
            top = (exc.name or "?").split(".")[0]
            if any(top == p.split(".")[0] for p in package_names):  # the swept package's own (a trimmed tree)
                failed[name] = f"ModuleNotFoundError: {exc}"
            else:
                missing.setdefault(top, []).append(name)
        except BaseException as exc:  # noqa: BLE001 (SystemExit of a script module included)
            text = str(exc).splitlines()[0] if str(exc) else ""
            failed[name] = f"{type(exc).__name__}: {text}"[:300]
    return {"imported": imported, "missing": {k: sorted(v) for k, v in sorted(missing.items())},
            "failed": dict(sorted(failed.items())), "seconds": round(time.time() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", help="packages to sweep, e.g. sglang.srt sglang.kernels.ops")
    ap.add_argument("--skip", action="append", default=[], help="a module (and what is under it) left out")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args(argv)
    result = sweep(a.packages, a.skip)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"imported {result['imported']} modules in {result['seconds']} s; "
          f"{len(result['missing'])} missing module(s), {len(result['failed'])} other failure(s)")
    for top, users in result["missing"].items():
        print(f"missing {top}: needed by {len(users)} module(s), e.g. {', '.join(users[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
