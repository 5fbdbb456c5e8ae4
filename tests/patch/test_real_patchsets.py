"""The project's own patchsets (patchsets/: sm120, dyn-disable, ...) through the engine, on real files."""
from pathlib import Path

import pytest

from toolkit.core import paths
from toolkit.patch import patching, patchsets

from .conftest import NEWEST, NEXT

REAL = sorted(p.name for p in paths.PATCHSETS_DIR.glob("*") if (p / "patchset.toml").is_file())


@pytest.fixture
def real_patchsets(monkeypatch):
    monkeypatch.delenv("TOOLKIT_PATCHSETS", raising=False)
    monkeypatch.setenv("TOOLKIT_PATCH_LOCK_TIMEOUT", "60")
    return patching.load_patchsets()


@pytest.mark.skipif(not REAL, reason="no patchsets in patchsets/ yet")
def test_the_whole_stack_compiles_and_byte_compiles(real_patchsets):
    result = patching.check()
    assert result.ok, result.error
    known = patching.load_patchsets()
    from toolkit.patch import compiler

    stack = patchsets.sort_stack(known, known)
    image = compiler.compile_stack([known[n] for n in stack], known[stack[0]].versions[0])
    for path, f in image.files.items():
        if path.endswith(".py") and f.content is not None:
            compile(f.content, path, "exec")


@pytest.mark.parametrize("name", REAL)
def test_apply_verify_revert(real_patchsets, host, site, sglang_wheel, name):
    known = real_patchsets
    for required in patchsets.requirement_closure(name, known):
        applied = patching.apply(host, required)
        assert applied.round_trips <= 3
    verdict = patching.verify(host)
    assert verdict.ok, [f for f in verdict.files if f.status not in ("pristine", "patched")]
    assert {f.by for f in verdict.files if f.status == "patched"} <= set(patchsets.requirement_closure(name, known))
    assert patching.apply(host, name).changed == 0
    undone = patching.revert(host)
    assert undone.record_ok
    for path in known[name].touched():
        data = (site / path).read_bytes() if (site / path).exists() else None
        assert data == (sglang_wheel.read(path) if sglang_wheel.has(path) else None), path


NEXT_REAL = sorted(p.name for p in paths.PATCHSETS_DIR.glob("*") if (p / NEXT / "").is_dir())
NEWEST_REAL = sorted(p.name for p in paths.PATCHSETS_DIR.glob("*") if (p / NEWEST / "").is_dir())


def _apply_verify_revert(known, host, wheel, name, release):
    site = next(Path(host.venv).glob("lib/python*/site-packages"))
    touched = known[name].touched(release)
    assert patching.apply(host, name).changed == len(touched)
    verdict = patching.verify(host)
    assert verdict.ok and {f.by for f in verdict.files if f.status == "patched"} == {name}
    for path in touched:
        data = (site / path).read_bytes()
        assert data != (wheel.read(path) if wheel.has(path) else None), path
        if path.endswith(".py"):
            compile(data, path, "exec")
    assert patching.apply(host, name).changed == 0
    undone = patching.revert(host)
    assert undone.record_ok
    for path in touched:
        data = (site / path).read_bytes() if (site / path).exists() else None
        assert data == (wheel.read(path) if wheel.has(path) else None), path


@pytest.mark.parametrize("name", NEXT_REAL)
def test_apply_verify_revert_on_the_second_release(real_patchsets, next_host, next_wheel, name):
    """A host with SGLang 0.5.17 (real wheel, real sshd): NAME's 0.5.17 diffs apply, byte-compile,
    verify, are a no-op the second time, and revert back to RECORD."""
    _apply_verify_revert(real_patchsets, next_host, next_wheel, name, NEXT)


@pytest.mark.parametrize("name", NEWEST_REAL)
def test_apply_verify_revert_on_the_newest_release(real_patchsets, newest_host, newest_wheel, name):
    """The same on a host with SGLang 0.5.23."""
    _apply_verify_revert(real_patchsets, newest_host, newest_wheel, name, NEWEST)
