"""CPU check of trim_tf_models.py (dev machine, no GPU): import, in a full and in a trimmed site, every
module of transformers/models (each in its own interpreter per site, in batches) and every name that
sglang takes from `transformers`, and compare. The trim is safe when the only modules that import in
the full site and not in the trimmed one are the modeling files it dropped, and no name sglang imports
from transformers is lost (a name that fails in both, for a package this machine lacks, is reported
but is no regression).

Usage: python3 check_tf_trim.py FULL_SITE TRIMMED_SITE [--extra-path DIR]
Both sites need transformers and sglang (only read, not imported); the interpreter running this needs
torch and transformers' other dependencies (--extra-path goes first on the path, e.g. a tokenizers
the interpreter lacks)."""
import argparse
import ast
import json
import re
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROBE = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
import transformers
modules, names = json.loads(sys.stdin.read())
result = {}
for m in modules:
    try:
        importlib.import_module(m)
        result[m] = "ok"
    except BaseException as e:
        result[m] = f"{type(e).__name__}: {str(e)[:160]}"
for module, n in names:
    try:
        getattr(importlib.import_module(module), n)
        result[f"{module}:{n}"] = "ok"
    except BaseException as e:
        result[f"{module}:{n}"] = f"{type(e).__name__}: {str(e)[:160]}"
print(json.dumps(result))
"""


def probe(site, modules, names, extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra, str(site)]), TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps([modules, names]), capture_output=True,
                         text=True, env=env, cwd=site)
    if run.returncode:
        sys.exit(f"probe failed in {site}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def sglang_imports(site):
    # written apart from trim_tf_models.sglang_names on purpose: a name the trim's own scan misses
    # must not be missed here too
    """(module, name) for every `from transformers... import name` in sglang (at any depth) and every
    `transformers.Name` it reads."""
    pairs = set()
    for path in (site / "sglang").rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="ignore")
        pairs.update(("transformers", n) for n in re.findall(r"\btransformers\.([A-Z]\w*)", text))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "transformers":
                pairs.update((node.module, a.name) for a in node.names if a.name != "*")
    return sorted(pairs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("full", type=Path)
    parser.add_argument("trimmed", type=Path)
    parser.add_argument("--extra-path", action="append", default=[])
    parser.add_argument("--batch", type=int, default=400)
    args = parser.parse_args()
    full, trimmed = args.full.resolve(), args.trimmed.resolve()
    models = full / "transformers" / "models"
    modules = sorted(".".join(p.relative_to(full).with_suffix("").parts).removesuffix(".__init__")
                     for p in models.rglob("*.py") if not p.name.startswith(("modular_", "convert_")))
    dropped = {m for m in modules if not (trimmed / Path(*m.split("."))).with_suffix(".py").exists()
               and not (trimmed / Path(*m.split(".")) / "__init__.py").exists()}
    names = sglang_imports(full)
    a, b = {}, {}
    for i in range(0, len(modules), args.batch):
        batch = modules[i:i + args.batch]
        a.update(probe(full, batch, names if i == 0 else [], args.extra_path))
        b.update(probe(trimmed, batch, names if i == 0 else [], args.extra_path))
    lost = sorted(k for k in a if a[k] == "ok" and b.get(k) != "ok" and k not in dropped)
    both = sorted(k for k in a if ":" in k and a[k] != "ok")
    ok_a = sum(v == "ok" for v in a.values())
    ok_b = sum(v == "ok" for v in b.values())
    print(f"{len(modules)} transformers.models modules ({len(dropped)} dropped by the trim) and {len(names)} names "
          f"sglang imports from transformers modules: {ok_a} import in the full site, {ok_b} in the trimmed one")
    for k in both:
        print(f"  fails in both (not a regression): {k}: {a[k]}")
    for k in lost:
        print(f"  LOST by the trim: {k}: {b.get(k)}")
    print("no module or name lost beyond the dropped modeling files" if not lost else f"{len(lost)} lost")
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    main()
