"""Which modules of a package pull in a given top-level module, read from source (dev machine, stdlib).

    python3 gpu/import_reach.py SITE sglang cutlass [--chain sglang.srt.models.deepseek_v2 ...]

`import_sweep.py` imports a site and so needs its Python and compiled modules; this reads the source
only. A module "needs" NAME when importing it imports NAME: it imports NAME at its top level (outside
functions and `if TYPE_CHECKING:`), or imports at its top a module of the package that needs it, or
sits in a package whose `__init__` needs it. Imports under a module-level `if` or `try` count (`if
_is_hip: import aiter` too), so this says which modules may import NAME; `--unconditional` counts only
imports outside any `if` / `try`, which says which modules must. Printed:
- how many modules need NAME;
- the modules that import one of those only inside a function (those are reached only when the
  function runs: which of them a server runs is for the reader to say);
- for each `--chain` module, the shortest path of top-level imports down to the import of NAME.
Relative imports are resolved; `from a import b` counts as importing `a.b` when `a.b` is a module.
"""
import argparse
import ast
import collections
import os
import sys


def module_files(site, package):
    files = {}
    for folder, _, names in os.walk(os.path.join(site, package)):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, site)[:-3].replace(os.sep, ".")
                files[module.removesuffix(".__init__")] = path
    return files


def imports_of(module, path, unconditional=False):
    """(top-level, inside-a-function) import targets of one file, as dotted names; with
    `unconditional`, imports under an `if` or `try` are left out."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError):
        return [], []
    base = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    top, lazy = [], []

    def targets(node):
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        parts = base.split(".")
        origin = ".".join(parts[:len(parts) - node.level + 1] + [node.module or ""]).strip(".") \
            if node.level else node.module or ""
        return [origin] + [f"{origin}.{alias.name}" for alias in node.names]

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(child, True)
            elif unconditional and isinstance(child, (ast.If, ast.Try)):
                continue
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                walk(ast.Module(body=child.orelse, type_ignores=[]), in_function)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                (lazy if in_function else top).extend(targets(child))
            else:
                walk(child, in_function)

    walk(tree, False)
    return top, lazy


class Reach:
    def __init__(self, site, package, name, unconditional=False):
        self.name = name
        self.files = module_files(site, package)
        self.top, self.lazy = {}, {}
        for module, path in self.files.items():
            self.top[module], self.lazy[module] = imports_of(module, path, unconditional)
        self.needs = self._closure()

    def known(self, target):
        """The package's module a target names (its longest dotted prefix that is one), or None."""
        while target and target not in self.files:
            target = target.rpartition(".")[0]
        return target or None

    def imports_name(self, module):
        return any(t == self.name or t.startswith(self.name + ".") for t in self.top[module])

    def _steps(self, module):
        """The package's modules that importing `module` imports first: its top-level targets and
        the packages above it."""
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        return [k for k in [self.known(t) for t in self.top[module]] + parents if k and k != module]

    def _closure(self):
        needs = {m for m in self.files if self.imports_name(m)}
        changed = True
        while changed:
            changed = False
            for module in self.files:
                if module not in needs and any(step in needs for step in self._steps(module)):
                    needs.add(module)
                    changed = True
        return needs

    def lazily_reached(self, under):
        """{module under `under` that does not need NAME itself: the modules it imports inside a
        function that do}."""
        out = {}
        for module in sorted(self.files):
            if module.startswith(under) and module not in self.needs:
                hits = sorted({k for k in map(self.known, self.lazy[module]) if k in self.needs})
                if hits:
                    out[module] = hits
        return out

    def chain(self, module):
        """[module, ..., the module whose top imports NAME], shortest by top-level imports; [] if none."""
        if module not in self.needs:
            return []
        previous, queue = {module: None}, collections.deque([module])
        while queue:
            current = queue.popleft()
            if self.imports_name(current):
                path = []
                while current:
                    path.append(current)
                    current = previous[current]
                return path[::-1]
            for step in self._steps(current):
                if step in self.needs and step not in previous:
                    previous[step] = current
                    queue.append(step)
        return []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", help="folder holding the package (an unpacked site)")
    parser.add_argument("package", help="top-level package to read, e.g. sglang")
    parser.add_argument("name", help="top-level module asked about, e.g. cutlass")
    parser.add_argument("--lazy-under", default="", help="list lazy importers only under this prefix")
    parser.add_argument("--chain", action="append", default=[], help="print how this module reaches NAME")
    parser.add_argument("--unconditional", action="store_true",
                        help="count only imports outside any if / try (must import, not may)")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.site, args.package)):
        parser.error(f"no package {args.package!r} in {args.site}")
    reach = Reach(args.site, args.package, args.name, args.unconditional)
    verb = "import" if args.unconditional else "may import"
    print(f"{len(reach.needs)} of {len(reach.files)} modules of {args.package} {verb} {args.name} when imported")
    for module, hits in reach.lazily_reached(args.lazy_under).items():
        print(f"inside a function: {module} -> {', '.join(hits)}")
    for module in args.chain:
        path = reach.chain(module)
        print(f"chain {module}: " + (" -> ".join(path) + f" -> {args.name}" if path else f"does not import {args.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
