"""Which host entries the toolkit calls, read from its sources (not a hand-written list).

Every call of `hostrun.run_script` / `hostrun.build_payload` in toolkit/ names its entry module
with a string literal, or passes on a parameter of the function it sits in (`patchhost.run(transport,
script, args)`); then the calls of that function are read the same way, until every name is a
literal. A call whose entry cannot be traced to a literal is listed as unresolved.
"""
from __future__ import annotations

import ast
from pathlib import Path

from toolkit.core.paths import PROJECT_ROOT

# (module stem, function): (parameter naming the entry, parameter naming the function, its default)
TARGETS = {("hostrun", "run_script"): ("name", "function", "main"),
           ("hostrun", "build_payload"): ("name", "function", "main")}


def _parameters(function: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)]


def _argument(call: ast.Call, params: list[str], name: str | None):
    """The node passed for parameter `name` of the called function (None when left at its default)."""
    if name is None:
        return None
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    index = params.index(name)
    return call.args[index] if index < len(call.args) else None


def _calls(tree: ast.Module, stem: str):
    """(call, (module, function) it calls by name or as `module.function`, enclosing function or None)."""
    imported = {alias.asname or alias.name: (node.module.rsplit(".", 1)[-1], alias.name)
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                for alias in node.names}

    def walk(node, enclosing):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else enclosing
            if isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    yield child, (func.value.id, func.attr), enclosing
                elif isinstance(func, ast.Name):
                    yield child, imported.get(func.id, (stem, func.id)), enclosing
            yield from walk(child, inner)

    yield from walk(tree, None)


def called_entries(root: Path = PROJECT_ROOT / "toolkit") -> tuple[set[tuple[str, str | None]], list[str]]:
    """({(entry module, function)}, [unresolved call sites]) over the .py files of `root` outside hostside/."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))
             if "hostside" not in path.relative_to(root).parts}
    signatures = {(path.stem, node.name): _parameters(node)
                  for path, tree in trees.items() for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    targets = dict(TARGETS)
    while True:
        found, unresolved, wrappers = set(), [], {}
        for path, tree in trees.items():
            for call, callee, enclosing in _calls(tree, path.stem):
                if callee not in targets:
                    continue
                name_param, function_param, default = targets[callee]
                params = signatures[callee]
                entry = _argument(call, params, name_param)
                function = _argument(call, params, function_param)
                if isinstance(function, ast.Constant):
                    function = function.value
                elif function is None:
                    function = default
                outer = _parameters(enclosing) if enclosing else []
                if isinstance(entry, ast.Constant) and isinstance(entry.value, str):
                    if isinstance(function, ast.Name):
                        unresolved.append(f"{path.name}:{call.lineno}: function {function.id}")
                    else:
                        found.add((entry.value, function))
                elif isinstance(entry, ast.Name) and entry.id in outer:
                    passed = function.id if isinstance(function, ast.Name) and function.id in outer else None
                    if isinstance(function, ast.Name) and passed is None:
                        unresolved.append(f"{path.name}:{call.lineno}: function {function.id}")
                    # hostrun's own run_script passes its parameters on to build_payload: the same target
                    elif (path.stem, enclosing.name) not in TARGETS:
                        wrappers[(path.stem, enclosing.name)] = (entry.id, passed, function if passed is None
                                                                  else default)
                else:
                    unresolved.append(f"{path.name}:{call.lineno}: {ast.unparse(entry) if entry else 'no entry'}")
        if all(key in targets for key in wrappers):
            return found, unresolved
        targets.update(wrappers)
