"""Host code travels as a zip with real imports (toolkit.core.hostrun), each call's zip holding only what its entry
imports, and the linter guards its names."""
import ast
import base64
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from toolkit.core import hostrun
from toolkit.core.inventory import resolve_hosts
from toolkit.core.paths import PROJECT_ROOT
from toolkit.core.transport import LocalTransport

from tests.hostrun_entries import called_entries

# The toolkit's own calls, read from its sources, and the tests' `echo`.
ENTRIES = sorted(called_entries()[0] | {("echo", "main")})


@pytest.fixture(params=["sandbox", "local"])
def transport(request, sandbox_env):
    with resolve_hosts(request.param)[0].connect() as t:
        yield t


def test_host_modules_import_their_siblings_on_the_host_in_one_round_trip(transport, tmp_path):
    # rollout_ctl imports rollout_hostlib, which imports patch_hostlib, locks and _lib
    before = transport.round_trips
    answer = hostrun.run_script(transport, "rollout_ctl", {"action": "status", "state_dir": str(tmp_path)})
    assert answer == {"journal": None}
    assert transport.round_trips == before + 1


def test_every_host_module_imports_from_the_zip_alone_in_an_isolated_python(tmp_path):
    """Standard library and the zip only: no toolkit on the path, no site-packages, no PYTHONPATH."""
    archive = tmp_path / "host.zip"
    archive.write_bytes(hostrun.host_zip())
    names = sorted(Path(p).stem for p in hostrun.host_files())
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
            "[importlib.import_module('toolkit_hostside.' + n) for n in sys.argv[2:]]; "
            "print(sorted(m for m in sys.modules if m.startswith('toolkit')))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(archive), *names],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "'toolkit_hostside.refmodel'" in done.stdout and "'toolkit'" not in done.stdout


def test_the_zip_is_the_same_bytes_whatever_the_file_times(tmp_path):
    """Built from two copies of the package whose files have different times: one sha256."""
    digests = []
    for copy, stamp in (("a", 1_000_000_000), ("b", 1_700_000_000)):
        root = tmp_path / copy
        shutil.copytree(PROJECT_ROOT / "toolkit", root / "toolkit",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for path in root.rglob("*.py"):
            os.utime(path, (stamp, stamp))
        code = ("from toolkit.core import hostrun; "
                "print(hostrun.zip_sha256(), hostrun.zip_sha256('patch_apply'), hostrun.zip_sha256('echo'))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(root)))
        assert done.returncode == 0, done.stderr
        digests.append(done.stdout.split())
    assert digests[0] == digests[1] == [hostrun.zip_sha256(), hostrun.zip_sha256("patch_apply"),
                                        hostrun.zip_sha256("echo")]
    assert len(set(digests[0])) == 3   # three different zips
    for entry in (None, "patch_apply"):
        dates = {info.date_time for info in zipfile.ZipFile(io.BytesIO(hostrun.host_zip(entry))).infolist()}
        assert dates == {hostrun.ZIP_DATE}


def test_a_corrupted_zip_is_refused_before_anything_runs(transport, tmp_path):
    payload = hostrun.build_payload("rollout_ctl", {"action": "arm", "state_dir": str(tmp_path)})
    start = payload.index("_ZIP = _unpack('") + len("_ZIP = _unpack('") + 5000
    flipped = "B" if payload[start] != "B" else "C"
    result = transport.run("python3 -", stdin=payload[:start] + flipped + payload[start + 1:])
    with pytest.raises(hostrun.HostScriptError, match="host code zip arrived corrupt .*nothing ran"):
        hostrun.parse_result(result, "rollout_ctl")
    assert result.exit_code == 1 and not (tmp_path / "rollout").exists()


def test_a_python_that_cannot_zipimport_is_named_with_a_clear_error(transport, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, zipimport\nsys.path_hooks.remove(zipimport.zipimporter)\n")
    with pytest.raises(hostrun.HostScriptError,
                       match=r"this host's Python \(.*\) cannot import the toolkit's host code from its zip"):
        hostrun.run_script(transport, "echo", {}, env={"PYTHONPATH": str(tmp_path)})


def test_the_temporary_zip_is_removed_after_the_run(tmp_path):
    hostrun.run_script(LocalTransport(), "echo", {}, env={"TMPDIR": str(tmp_path)})
    with pytest.raises(hostrun.HostScriptError, match="KeyError"):
        hostrun.run_script(LocalTransport(), "echo", {"raise": "x"}, env={"TMPDIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


def test_a_full_temporary_folder_falls_back_to_memory(tmp_path):
    """A host whose /tmp is full (a 4 KiB tmpfs over it, in a mount namespace of its own) still runs
    host code: the zip goes to /dev/shm, and is removed there afterwards."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not os.path.isdir("/dev/shm"):
        pytest.skip("needs root, unshare and /dev/shm to mount a full /tmp")

    before = set(os.listdir("/dev/shm"))
    # rollout_ctl's zip (about 15 KB) does not fit in 4 KiB; echo's (under 2 KB) would. A filled /tmp would not do:
    # Python's tempfile would then pick /var/tmp.
    state = tmp_path / "state"
    payload = hostrun.build_payload("rollout_ctl", {"action": "status", "state_dir": str(state)})
    # from / : the checkout itself may live under /tmp (a CI clone), which the full tmpfs hides
    command = "unshare -m sh -c 'mount -t tmpfs -o size=4096 tmpfs /tmp && cd / && exec python3 -'"
    answer = hostrun.parse_result(LocalTransport().run(command, stdin=payload), "rollout_ctl")
    assert answer == {"journal": None}
    assert set(os.listdir("/dev/shm")) == before
    nowhere = command.replace("exec python3", "mount -t tmpfs -o size=4096 tmpfs /dev/shm && exec python3")
    with pytest.raises(hostrun.HostScriptError, match=r"cannot write the toolkit's host code zip \(/tmp: .*No space"
                                                      r".*; /dev/shm: .*No space.*\); nothing ran"):
        hostrun.parse_result(LocalTransport().run(nowhere, stdin=payload), "rollout_ctl")


def test_a_payload_kept_in_a_file_runs_with_the_command_line_as_arguments(tmp_path):
    """The rollout guard's way: `python3 guard.py FOLDER` -> guard_main(FOLDER), its return the exit code."""
    guard = tmp_path / "guard.py"
    guard.write_text(hostrun.build_payload("rollout_hostlib", None, "guard_main"))
    done = subprocess.run(["python3", str(guard), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")   # no journal: nothing to guard


def _zip_modules(entry):
    return sorted(Path(p).stem for p in zipfile.ZipFile(io.BytesIO(hostrun.host_zip(entry))).namelist())


def test_a_call_ships_only_the_modules_its_entry_imports():
    assert _zip_modules("echo") == ["__init__", "_lib", "echo"]
    # rollout_ctl -> rollout_hostlib -> patch_hostlib -> locks; not server_ctl, facts, patch_apply...
    assert _zip_modules("rollout_ctl") == ["__init__", "_lib", "locks", "patch_hostlib", "rollout_ctl",
                                           "rollout_hostlib"]
    assert len(_zip_modules(None)) == len(hostrun.host_files()) > len(_zip_modules("rollout_ctl"))
    assert hostrun.host_zip("echo") in base64.b64decode(
        hostrun.build_payload("echo", {}).split("_ZIP = _unpack('")[1].split("'")[0])


def test_the_toolkit_calls_are_all_traced_to_their_entry_modules():
    found, unresolved = called_entries()
    assert unresolved == []
    # the wrapper patchhost.run(transport, script, ...) is followed to its callers' literals
    assert {("patch_probe", "main"), ("patch_apply", "main"), ("rollout_hostlib", "guard_main"),
            ("refmodel", "make")} <= found


@pytest.mark.parametrize("entry, function", ENTRIES, ids=[f"{e}.{f}" for e, f in ENTRIES])
def test_each_entry_imports_everything_it_needs_from_its_own_zip(entry, function):
    """A real `python3 -` imports the entry from the zip its calls ship (function None: import only), with every
    module it imports at module level; the function it is called with exists."""
    answer = hostrun.run_script(LocalTransport(), entry, {}, function=None)
    assert f"toolkit_hostside.{entry}" in answer["imported"]
    assert {m.rpartition(".")[2] for m in answer["imported"]} <= set(_zip_modules(entry)) | {"toolkit_hostside"}
    module = ast.parse(hostrun.host_files()[f"toolkit_hostside/{entry}.py"])
    assert function in {node.name for node in module.body if isinstance(node, ast.FunctionDef)}


@pytest.fixture
def extra_module(monkeypatch):
    """Adds a made-up host module with the given source; the zips are rebuilt with it, and again afterwards."""
    real = hostrun.host_files()

    def add(source):
        monkeypatch.setattr(hostrun, "host_files", lambda: {**real, "toolkit_hostside/made_up.py": source.encode()})
        hostrun._built.cache_clear()

    yield add
    hostrun._built.cache_clear()


def test_an_import_hidden_from_the_parser_fails_the_import_check_not_a_host(extra_module):
    extra_module("import importlib\n\ngetattr(importlib, 'import_' + 'module')('toolkit_hostside.locks')\n\n\n"
                 "def main(args):\n    return {}\n")
    assert _zip_modules("made_up") == ["__init__", "_lib", "made_up"]   # the parser did not see it
    with pytest.raises(hostrun.HostScriptError, match="No module named 'toolkit_hostside.locks'"):
        hostrun.run_script(LocalTransport(), "made_up", {}, function=None)


@pytest.mark.parametrize("source, refusal", [
    ("import importlib\n\n\ndef main(args):\n    return importlib.import_module('toolkit_hostside.' + args['m'])\n",
     r"made_up.py:5: calls importlib.import_module\(\) with a name computed at run time"),
    ("def main(args):\n    return __import__(args['m'])\n", r"made_up.py:2: calls __import__\(\) with a name"),
    ("def main(args):\n    exec(args['code'])\n", r"made_up.py:2: runs code from text \(exec\(\)\)"),
    ("import pkgutil\n", r"made_up.py:1: imports pkgutil, which loads modules the parser cannot see"),
    ("from toolkit.core import hostrun\n", r"made_up.py:1: imports toolkit.core, which is not on a host"),
    ("from .. import x\n", r"made_up.py:1: imports from above the package"),
    ("from .nowhere import x\n", r"made_up.py:1: imports toolkit_hostside.nowhere, which is no host module"),
])
def test_an_import_the_parser_cannot_follow_is_refused_before_anything_is_sent(extra_module, source, refusal):
    extra_module(source)
    with pytest.raises(hostrun.ClosureError, match=refusal):
        hostrun.build_payload("made_up", {})


@pytest.mark.parametrize("source", [
    "from . import locks\n", "from .locks import FileLock\n", "import toolkit_hostside.locks\n",
    "from toolkit_hostside import locks\n", "import importlib\nimportlib.import_module('toolkit_hostside.locks')\n",
    "def f():\n    from .locks import FileLock\n",
])
def test_every_form_of_static_import_is_followed(extra_module, source):
    extra_module(source)
    assert "locks" in _zip_modules("made_up")
    assert "patch_hostlib" not in _zip_modules("made_up")


def test_an_entry_that_is_no_host_module_is_refused():
    with pytest.raises(hostrun.ClosureError, match="no host module 'nowhere'"):
        hostrun.build_payload("nowhere", {})


def _ruff() -> str:
    found = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("ruff is not installed here (it is in the dev extras: pip install -e '.[dev]')")
    return found


def test_a_host_module_using_a_name_it_does_not_import_fails_the_linter(tmp_path):
    """The mistake the old concatenation hid (provision_step used `os` without importing it)."""
    ruff = _ruff()
    tree = tmp_path / "tree"
    shutil.copytree(PROJECT_ROOT / "toolkit" / "hostside", tree / "toolkit" / "hostside",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tree)
    lint = [ruff, "check", "--no-cache", "--output-format", "concise", "."]
    clean = subprocess.run(lint, capture_output=True, text=True, cwd=tree, timeout=120)
    assert clean.returncode == 0, clean.stdout
    module = tree / "toolkit" / "hostside" / "provision_step.py"
    module.write_text(module.read_text().replace("import shutil\n", "", 1))
    broken = subprocess.run(lint, capture_output=True, text=True, cwd=tree, timeout=120)
    assert broken.returncode == 1
    assert "provision_step.py" in broken.stdout and "F821 Undefined name `shutil`" in broken.stdout


def test_the_whole_tree_passes_the_linter():
    done = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300)
    assert done.returncode == 0, done.stdout
