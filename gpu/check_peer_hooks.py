"""Does an SGLang release have what eagle-harness's sglang plugin needs? (issue #30 item 2, on paper)

Usage (dev machine, stdlib only; nothing of either package is imported but eagle-harness's hook table):
  python3 gpu/check_peer_hooks.py SGLANG_TREE EAGLE_HARNESS_TREE [--json OUT]

SGLANG_TREE: a folder holding `sglang/` (e.g. the release's wheel unzipped); EAGLE_HARNESS_TREE: a
folder holding `eagle_harness/` (its wheel unzipped). eagle-harness lists the SGLang attributes it
overrides, calls or reads in `eagle_harness.sglang.hooks.HOOKS` (path "module:Class.attribute",
parameter names, kind) and registers nothing when one is missing or different. This reads that
table (`hooks.py` imports only the standard library) and looks each entry up statically in
SGLANG_TREE: the module's file, the class (a top-level class, or a name assigned at module level),
the attribute in the class body or in a base class (followed through the module's `from X import
Name` imports into other modules), and, for an override or a call, the parameter names.
Exit 0: every required hook found; 1: some missing; 2: bad input.
"""
import argparse
import ast
import json
import os
import sys


def module_file(tree, module):
    base = os.path.join(tree, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _classes(mod):
    found = {}
    for node in mod.body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = node
    return found


def _params(fn):
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return tuple(names[1:] if names and names[0] in ("self", "cls") else names)


def _members(cls):
    """Names defined in a class body: functions (with their parameters) and fields."""
    members = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members[node.name] = _params(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = None
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = None
    return members


def _imported(mod, module, name):
    """The module a top-level `from X import name` in `mod` (whose name is `module`) takes it from."""
    for node in mod.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            if node.level:
                package = module.split(".")[:-node.level] if node.level else []
                return ".".join(package + ([node.module] if node.module else []))
            return node.module
    return None


def lookup(tree, path, depth=0):
    """(status, detail) of one hook path "module:Class.attr" or "module:function"."""
    module, _, qual = path.partition(":")
    file = module_file(tree, module)
    if file is None:
        return "missing", f"no module {module}"
    mod = ast.parse(open(file, encoding="utf-8").read())
    parts = qual.split(".")
    classes = _classes(mod)
    top_funcs = {n.name: _params(n) for n in mod.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if len(parts) == 1:
        name = parts[0]
        if name in top_funcs:
            return "found", top_funcs[name]
        if name in classes:
            members = _members(classes[name])
            return "found", members.get("__init__") or tuple(k for k, v in members.items() if v is None)
        return "missing", f"no {name} in {module}"
    cls_name, attr = parts[0], parts[1]
    if cls_name not in classes:
        return "missing", f"no class {cls_name} in {module}"
    seen, queue = set(), [classes[cls_name]]
    while queue:
        cls = queue.pop(0)
        if cls.name in seen:
            continue
        seen.add(cls.name)
        members = _members(cls)
        if attr in members:
            return "found", members[attr]
        for base in cls.bases:
            if not isinstance(base, ast.Name):
                continue
            if base.id in classes:
                queue.append(classes[base.id])
            elif depth < 5 and (origin := _imported(mod, module, base.id)):
                status, detail = lookup(tree, f"{origin}:{base.id}.{attr}", depth + 1)
                if status == "found":
                    return status, detail
    return "missing", f"{cls_name} has no {attr}"


def check(sglang_tree, hooks):
    rows = []
    for hook in hooks:
        status, detail = lookup(sglang_tree, hook.path)
        problem = None
        if status == "missing":
            problem = detail
        elif hook.kind in ("override", "call") and isinstance(detail, tuple):
            expected = tuple(hook.params)
            if hook.kind == "override" and detail != expected:
                problem = f"parameters {list(detail)}, the plugin overrides with {list(expected)}"
            elif hook.kind == "call" and not set(expected) <= set(detail):
                problem = f"parameters {list(detail)} lack {sorted(set(expected) - set(detail))}"
        rows.append({"path": hook.path, "kind": hook.kind, "optional": hook.optional,
                     "ok": problem is None, "problem": problem})
    return rows


def load_hooks(harness_tree):
    sys.path.insert(0, harness_tree)
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "eagle_harness_hooks", os.path.join(harness_tree, "eagle_harness", "sglang", "hooks.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.HOOKS
    finally:
        sys.path.remove(harness_tree)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sglang_tree")
    ap.add_argument("harness_tree")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(a.sglang_tree, "sglang")):
        print(f"no sglang/ under {a.sglang_tree}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.harness_tree, "eagle_harness", "sglang", "hooks.py")):
        print(f"no eagle_harness/sglang/hooks.py under {a.harness_tree}", file=sys.stderr)
        return 2
    rows = check(a.sglang_tree, load_hooks(a.harness_tree))
    required_missing = [r for r in rows if not r["ok"] and not r["optional"]]
    for r in rows:
        mark = "ok " if r["ok"] else ("opt" if r["optional"] else "NO ")
        print(f"{mark} {r['kind']:8} {r['path']}" + ("" if r["ok"] else f"  -- {r['problem']}"))
    print(f"{len(rows)} hooks, {sum(r['ok'] for r in rows)} found, {len(required_missing)} required ones missing")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    return 1 if required_missing else 0


if __name__ == "__main__":
    sys.exit(main())
