"""Drop the transformers model code that SGLang never reaches from an unpacked site.
Usage: python3 trim_tf_models.py SITE [--dry-run]

transformers/models holds one folder per architecture (522 in 5.19.0). Every folder keeps its
configuration, tokenizer, processor and image/video/feature-extractor files (AutoConfig and
AutoTokenizer/AutoProcessor load them by the model_type of any checkpoint). What goes:
- every `modular_*.py`: the sources transformers generates modeling files from; its lazy import
  structure skips them (utils/import_utils.py, create_import_structure_from_path) and nothing imports
  them;
- `modeling_*.py` of a model that SGLang does not name: kept are the folders whose name appears as a
  word anywhere in the sglang package's Python (an import of `transformers.models.X`, a model_type
  string, its own model file's name, ...), the folders that define a name sglang imports from
  `transformers` or reads as `transformers.Name`, `auto`, and, transitively, every model folder
  whose modeling code a kept file imports (anywhere in the file, not only at module level).
So SGLang's native models, the vision/audio towers it builds from transformers classes, and its
transformers fallback for the architectures it names keep their code; `--model-impl transformers`
for an architecture SGLang never mentions would find no modeling code."""
import ast
import re
import sys
from pathlib import Path


def exported(path):
    """Names in a file's __all__."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
    except SyntaxError:
        return set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def imported_models(path, site, modeling_names):
    """Model folders whose modeling code a file imports (relative or absolute, at any depth): a
    `modeling_*` module of theirs, or a name their modeling files export through the package."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
    except SyntaxError:
        return set()
    rel = path.relative_to(site).with_suffix("").parts
    for node in list(ast.walk(tree)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # the lazy packages' __init__.py: `if TYPE_CHECKING: from .modeling_x import *`
    found = set()
    for node in ast.walk(tree):
        targets = []  # (module parts, imported name or None)
        if isinstance(node, ast.ImportFrom):
            base = [p for p in (node.module or "").split(".") if p]
            if node.level:
                base = list(rel[: len(rel) - node.level]) + base
            targets = [(base + [a.name], None) for a in node.names] + [(base, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [(a.name.split("."), None) for a in node.names]
        for parts, name in targets:
            if len(parts) < 3 or parts[:2] != ["transformers", "models"]:
                continue
            if len(parts) >= 4 and parts[3].startswith("modeling_"):
                found.add(parts[2])
            elif len(parts) == 3 and name in modeling_names.get(parts[2], ()):
                found.add(parts[2])
    return found


def sglang_names(site):
    """Lower-case words of sglang's Python, and the names it takes from `transformers`."""
    words, names = set(), set()
    for path in (site / "sglang").rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="ignore")
        words.update(re.findall(r"[a-z0-9_]+", (str(path.relative_to(site)) + "\n" + text).lower()))
        names.update(re.findall(r"\btransformers\.([A-Za-z_]\w*)", text))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "transformers":
                names.update(a.name for a in node.names)
    return words, names


def main():
    site = Path(sys.argv[1]).resolve()
    dry = "--dry-run" in sys.argv[2:]
    models_dir = site / "transformers" / "models"
    folders = {p.name: p for p in models_dir.iterdir() if p.is_dir() and p.name != "__pycache__"}
    words, names = sglang_names(site)
    keep = {"auto"} | {name for name in folders if name in words}
    for name, folder in folders.items():
        if any(names & exported(f) for f in folder.glob("*.py")):
            keep.add(name)
    # whatever stays imports modeling code of other folders: follow it to a fixpoint
    named = len(keep)
    modeling_names = {name: set().union(*(exported(f) for f in folder.glob("modeling_*.py")))
                      for name, folder in folders.items()}
    queue = [p for p in (site / "transformers").rglob("*.py") if not p.name.startswith("modular_")
             and (models_dir not in p.parents or p.parent.name in keep or not p.name.startswith("modeling_"))]
    seen = set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_models(path, site, modeling_names) - keep:
            if name in folders:
                keep.add(name)
                queue += list(folders[name].glob("modeling_*.py"))
    removed, dropped_models = 0, 0
    for name, folder in sorted(folders.items()):
        drop = list(folder.glob("modular_*.py"))
        if name not in keep:
            drop += list(folder.glob("modeling_*.py"))
            dropped_models += 1
        for path in drop:
            removed += path.stat().st_size
            if not dry:
                path.unlink()
    print(f"transformers/models: modeling code kept for {len(keep)} of {len(folders)} model folders ({named} "
          f"named by sglang, the rest imported by what stays), "
          f"dropped for {dropped_models}; modular_*.py dropped everywhere; {removed >> 20} MiB "
          f"{'would go' if dry else 'dropped'}")
    print("  kept", " ".join(sorted(keep)))


if __name__ == "__main__":
    main()
