"""Run host-side code in one round trip and get its JSON answer back.

Host-side work is done by standard-library-only modules in `toolkit/hostside/`; they import
each other with real (package-relative) imports. A call ships, as one zip (package
`toolkit_hostside`), only `__init__`, `_lib` and the modules its entry imports, transitively,
found by parsing the sources (`closure_of`; `toolkit/server/refmodel.py` is one of the modules).
Each entry's zip is built in memory once per process with fixed timestamps, so the same sources
always give the same bytes and the same sha256. A call
sends a small bootstrap on stdin to the host's Python (`python3 -`) with the zip and the
arguments embedded as base64, as Ansible's AnsiballZ does: the bootstrap checks the zip's
sha256, writes it to a temporary file (in /dev/shm when the temporary folder's disk is
full), puts that on `sys.path` (zipimport), runs
`toolkit_hostside.<name>.main(args)`, removes the file, and prints one marked JSON line that
`parse_result` reads back. Nothing is installed on the host, and one step costs exactly one
round trip. This is the only way host code is shipped.
"""
from __future__ import annotations

import ast
import base64
import functools
import hashlib
import io
import json
import logging
import zipfile
from importlib import resources

from toolkit.core.transport import CommandResult, Transport

log = logging.getLogger(__name__)

RESULT_MARKER = "@@TOOLKIT-RESULT@@"
PACKAGE = "toolkit_hostside"
# Modules of `toolkit` (outside hostside/) that also run on hosts, shipped in the same package:
# {name in the zip: the package that holds it here}.
EXTRA_MODULES = {"refmodel": "toolkit.server"}
ZIP_DATE = (1980, 1, 1, 0, 0, 0)   # the earliest a zip can say: the archive never depends on file times
# The line of the bootstrap that runs the entry; everything above it has made the zip importable.
# (tests/patch/faults.py inserts its fault points just before it.)
ENTRY_LINE = "    _lib.run_entry(_NAME, _FUNCTION, _ARGS, _MARKER)\n"

BOOTSTRAP = '''\
# toolkit host code (toolkit.core.hostrun): runs %(package)s.%(name)s.%(function)s from the zip below.
# Standard library only; the zip is checked against its sha256 before it is used.
import base64
import hashlib
import json
import os
import sys
import tempfile

_NAME, _FUNCTION, _MARKER = %(name)r, %(function)r, %(marker)r
_ARGS = %(args)r
_SHA256 = %(sha)r


def _fail(text):
    sys.stdout.write("\\n" + _MARKER + json.dumps({"_error": text}) + "\\n")
    sys.stdout.flush()
    sys.exit(1)


def _unpack(encoded):
    try:
        data = base64.b64decode(encoded)
    except (TypeError, ValueError) as exc:
        _fail("the toolkit's host code zip arrived corrupt (%%s); nothing ran" %% exc)
    found = hashlib.sha256(data).hexdigest()
    if found != _SHA256:
        _fail("the toolkit's host code zip arrived corrupt (sha256 %%s, sent %%s); nothing ran" %% (found, _SHA256))
    failures = []
    for folder in (None, "/dev/shm"):   # memory, when the temporary folder's disk is full or read-only
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix="toolkit-hostside-", suffix=".zip", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            sys.path.insert(0, path)
            return path
        except OSError as exc:
            failures.append("%%s: %%s" %% (folder or tempfile.gettempdir(), exc))
            if path:
                os.unlink(path)
    _fail("cannot write the toolkit's host code zip (%%s); nothing ran" %% "; ".join(failures))


_ZIP = _unpack(%(zip)r)
try:
    try:
        from %(package)s import _lib
    except ImportError as exc:
        _fail("this host's Python (%%s, %%s) cannot import the toolkit's host code from its zip (zipimport): %%s;"
              " nothing ran" %% (sys.executable, sys.version.split()[0], exc))
''' + ENTRY_LINE + '''\
finally:
    os.unlink(_ZIP)
'''


class HostScriptError(RuntimeError):
    """The host-side script failed or answered nothing readable."""

    def __init__(self, message: str, result: CommandResult | None = None):
        super().__init__(message)
        self.result = result


class ClosureError(RuntimeError):
    """A host module imports in a way the closure cannot follow, or an entry names no module."""


# Calls that import by name (functions of importlib and friends, and the builtin `__import__`): followed when the
# name is a literal, refused when it is computed. Code run from text (`exec`, `eval`, `compile`) is refused.
IMPORT_CALLS = {"__import__", "import_module", "find_spec", "spec_from_file_location", "reload", "run_module",
                "run_path", "exec_module", "load_module"}
CODE_CALLS = {"exec", "eval", "compile"}
# Modules that reach files of the package without an import statement.
HIDDEN_LOADERS = {"pkgutil", "runpy", "zipimport", "importlib.resources", "importlib.machinery"}
# The one dynamic import allowed: the entry dispatcher, which imports the closure's own root.
DISPATCHER = ("_lib", "run_entry")
ALWAYS = ("__init__", "_lib")   # the bootstrap imports these before the entry


def host_files() -> dict[str, bytes]:
    """{path in the zip: source bytes}: every module of toolkit/hostside/ and EXTRA_MODULES."""
    files = {}
    for entry in resources.files("toolkit.hostside").iterdir():
        if entry.name.endswith(".py"):
            files[f"{PACKAGE}/{entry.name}"] = entry.read_bytes()
    for name, package in EXTRA_MODULES.items():
        files[f"{PACKAGE}/{name}.py"] = resources.files(package).joinpath(f"{name}.py").read_bytes()
    return files


def _dotted(node: ast.expr) -> str:
    """`importlib.util.find_spec` for that attribute chain; the last name for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


class _ImportFinder(ast.NodeVisitor):
    """The package modules that one module imports, or a ClosureError for an import it cannot follow."""

    def __init__(self, module: str, modules: set[str]):
        self.module, self.modules, self.found, self.scope = module, modules, set(), []

    def refuse(self, node: ast.AST, why: str):
        raise ClosureError(f"{PACKAGE}/{self.module}.py:{node.lineno}: {why}; the zip of a host call holds only"
                           " the modules its entry imports by a name written in the source (hostrun.closure_of)")

    def add(self, node: ast.AST, name: str):
        if name not in self.modules:
            self.refuse(node, f"imports {PACKAGE}.{name}, which is no host module")
        self.found.add(name)

    def absolute(self, node: ast.AST, dotted: str, names=()):
        top, _, rest = dotted.partition(".")
        if top == "toolkit":
            self.refuse(node, f"imports {dotted}, which is not on a host")
        if dotted in HIDDEN_LOADERS:
            self.refuse(node, f"imports {dotted}, which loads modules the parser cannot see")
        if top != PACKAGE:
            return
        if rest:
            self.add(node, rest.split(".")[0])
        for name in names:
            if name in self.modules:
                self.add(node, name)

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self.absolute(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        names = [alias.name for alias in node.names]
        if node.level == 0:
            self.absolute(node, node.module or "", names)
        elif node.level > 1:
            self.refuse(node, "imports from above the package")
        elif node.module:
            self.add(node, node.module.split(".")[0])
        else:   # from . import x: modules, or names of __init__ (always shipped)
            self.found.update(name for name in names if name in self.modules)

    def visit_FunctionDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call):
        name = _dotted(node.func)
        if isinstance(node.func, ast.Name) and name in CODE_CALLS:
            self.refuse(node, f"runs code from text ({name}()), whose imports the parser cannot see")
        if name.rsplit(".", 1)[-1] in IMPORT_CALLS:
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.absolute(node, first.value)
            elif (self.module, self.scope[-1] if self.scope else None) != DISPATCHER:
                self.refuse(node, f"calls {name}() with a name computed at run time")
        self.generic_visit(node)


def module_imports(module: str, source: bytes, modules: set[str]) -> set[str]:
    """The modules of `modules` (names in the package) that `module`'s source imports, anywhere in it."""
    finder = _ImportFinder(module, modules)
    finder.visit(ast.parse(source, f"{PACKAGE}/{module}.py"))
    return finder.found


def closure_of(files: dict[str, bytes], name: str) -> list[str]:
    """Sorted names of the modules a call of entry `name` needs: `__init__`, `_lib`, `name` and what they import,
    transitively; `files` as `host_files` gives them."""
    sources = {path[len(PACKAGE) + 1:-3]: data for path, data in files.items()}
    if name not in sources:
        raise ClosureError(f"no host module {name!r} (toolkit/hostside/ or hostrun.EXTRA_MODULES)")
    todo, seen = [*ALWAYS, name], set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(module_imports(module, sources[module], set(sources)))
    return sorted(seen)


@functools.cache
def _built(name: str | None) -> tuple[bytes, str, str]:
    """(zip, its sha256, its base64) of entry `name`'s closure (None: every module), once per process."""
    files = host_files()
    if name is not None:
        keep = {f"{PACKAGE}/{module}.py" for module in closure_of(files, name)}
        files = {path: data for path, data in files.items() if path in keep}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in sorted(files.items()):
            info = zipfile.ZipInfo(path, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data, compresslevel=9)
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    log.debug("host code zip for %s: %d files, %d bytes, sha256 %s", name or "every module", len(files),
              len(data), sha)
    return data, sha, base64.b64encode(data).decode()


def host_zip(name: str | None = None) -> bytes:
    """The zip a call of entry `name` ships (None: every host module); the same sources give the same bytes."""
    return _built(name)[0]


def zip_sha256(name: str | None = None) -> str:
    return _built(name)[1]


def build_payload(name: str, args: dict | None = None, function: str | None = "main") -> str:
    """The Python text that runs `toolkit_hostside.<name>.<function>(args)` on a host from stdin.

    Its zip holds `closure_of(host_files(), name)`. With `function` None it only imports the entry and answers
    {"imported": [the package's modules then loaded]}: tests use it to prove the zip is enough.

    With `args` None, the function is called with the command line's arguments instead
    (`python3 FILE A B` calls `function("A", "B")`) and its return value is the exit code:
    that is how a payload kept in a file on the host (the rollout guard) runs."""
    encoded = None if args is None else base64.b64encode(json.dumps(args).encode()).decode()
    _, sha, text = _built(name)
    return BOOTSTRAP % {"package": PACKAGE, "name": name, "function": function, "marker": RESULT_MARKER,
                        "args": encoded, "sha": sha, "zip": text}


def parse_result(result: CommandResult, name: str) -> dict:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            answer = json.loads(line[len(RESULT_MARKER):])
            if isinstance(answer, dict) and answer.get("_error"):
                raise HostScriptError(f"host-side {name} failed: {answer['_error']}", result)
            return answer
    raise HostScriptError(
        f"host-side {name} answered nothing (exit {result.exit_code}):\n{result.tail()}", result)


def run_script(transport: Transport, name: str, args: dict | None = None, *,
               python: str = "python3", timeout: float | None = None,
               env: dict[str, str] | None = None, function: str | None = "main") -> dict:
    """Run `toolkit_hostside.<name>.<function>(args)` on the host; return its dict."""
    payload = build_payload(name, args or {}, function)
    result = transport.run(f"{python} -", stdin=payload, timeout=timeout, env=env)
    return parse_result(result, name)
