"""Drop FlashInfer's experimental/ package from an unpacked site, keeping the modules that a
module outside it imports at module level (and what those import at module level, transitively),
with their packages' __init__.py. Usage: python3 trim_fi_experimental.py SITE"""
import ast
import sys
from pathlib import Path

site = Path(sys.argv[1])
root = site / "flashinfer"
exp = root / "experimental"


def module_of(path):
    return ".".join(path.relative_to(site).with_suffix("").parts).removesuffix(".__init__")


def top_level_imports(path):
    """flashinfer.experimental modules imported by statements at module level (not in a function)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
    except SyntaxError:
        return set()
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = set()
    nodes = list(tree.body)
    while nodes:  # module level, including inside if/try blocks, not inside functions or classes
        node = nodes.pop()
        if isinstance(node, (ast.If, ast.Try)):
            nodes += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(base)
                found.add(f"{base}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "flashinfer.experimental" or m.startswith("flashinfer.experimental.")}


def file_of(module):
    rel = Path(*module.split("."))
    for candidate in (site / rel.with_suffix(".py"), site / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


keep, queue = set(), []
for path in root.rglob("*.py"):
    if exp not in path.parents:
        queue += top_level_imports(path)
while queue:
    module = queue.pop()
    path = file_of(module)
    if path is None or path in keep:
        continue
    keep.add(path)
    queue += top_level_imports(path)
    parent = module.rpartition(".")[0]
    if parent.startswith("flashinfer.experimental"):
        queue.append(parent)
removed = 0
for path in sorted(exp.rglob("*"), reverse=True):
    if path.is_file() and path not in keep:
        removed += path.stat().st_size
        path.unlink()
    elif path.is_dir() and not any(path.iterdir()):
        path.rmdir()
print(f"flashinfer/experimental: kept {len(keep)} modules imported at module level, dropped {removed >> 20} MiB")
for path in sorted(keep):
    print("  kept", path.relative_to(site))
