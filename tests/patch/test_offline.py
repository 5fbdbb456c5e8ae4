"""Offline parts: patchset validation, the wheel's RECORD check, compiling stacks (no host)."""
import importlib.util
import shutil
import zipfile

import pytest

from toolkit.patch import compiler, patching, patchsets, wheels
from toolkit.core import hostrun
from toolkit.patch.patchsets import PatchsetError

from .conftest import DATA, GOOD, add_patchset


def test_list_orders_patchsets_and_reads_requires(patchsets_dir):
    known = patching.load_patchsets()
    assert patchsets.sort_stack(known, known) == ["one-file", "pair-base", "pair-top", "twenty", "clash", "three"]
    assert known["pair-top"].requires == ["pair-base"]
    assert patchsets.requirement_closure("pair-top", known) == ["pair-base", "pair-top"]


def test_check_reports_files_hunks_and_lines(patchsets_dir):
    result = patching.check("pair-top")
    assert result.ok, result.error
    assert result.stack == ["pair-base", "pair-top"]
    assert result.patchsets[1].totals("0.5.11") == {"files": 2, "hunks": 2, "added": 2, "removed": 1}
    assert result.versions == ["0.5.11"]
    assert {f.path: f.by for f in result.files["0.5.11"]} == {
        "sglang/srt/utils/json_response.py": "pair-top", "sglang/srt/utils/rpd_utils.py": "pair-top"}


def test_compiled_image_matches_patched_text(patchsets_dir, sglang_wheel):
    known = patching.load_patchsets()
    image = compiler.compile_stack([known["pair-base"], known["pair-top"]], "0.5.11", use_cache=False)
    content = image.files["sglang/srt/utils/json_response.py"].content.decode()
    assert "PAIR_LEVEL = 'top'" in content and "PAIR_LEVEL = 'base'" not in content
    assert image.files["sglang/srt/utils/json_response.py"].pristine_sha256 == \
        sglang_wheel.record["sglang/srt/utils/json_response.py"]


def test_conflict_between_patchsets_is_found_offline(patchsets_dir):
    assert patching.check("clash").ok  # alone it applies
    result = patching.check()  # the whole stack: clash sits on top of one-file
    assert not result.ok
    assert "clash/0.5.11/0001-clash.patch does not apply on top of pristine + one-file" in result.error
    assert "sglang/srt/utils/auth.py" in result.error


@pytest.mark.parametrize("name, message", [("escape", "leaves the package"), ("binary", "binary hunks")])
def test_bad_patches_are_rejected(patchsets_dir, name, message):
    add_patchset(patchsets_dir, name)
    result = patching.check(name)
    assert not result.ok and message in result.error


def test_git_style_binary_marker_and_absolute_paths_are_rejected(tmp_path):
    bad = tmp_path / "x.patch"
    bad.write_text("diff --git a/sglang/a.bin b/sglang/a.bin\nindex 1..2 100644\nBinary files a/sglang/a.bin and"
                   " b/sglang/a.bin differ\n")
    with pytest.raises(PatchsetError, match="binary"):
        patchsets.read_patch(bad, "sglang")
    for path in ("/etc/passwd", "sglang/../../x.py", "other/x.py", "sglang/./x.py"):
        with pytest.raises(PatchsetError, match="leaves the package"):
            patchsets.check_path(path, "sglang", "t")


def test_missing_requirement_and_unknown_names_are_clear(patchsets_dir):
    shutil.rmtree(patchsets_dir / "pair-base")
    with pytest.raises(PatchsetError, match="pair-top requires 'pair-base'"):
        patching.load_patchsets()


def test_wheel_file_that_does_not_match_record_is_refused(sglang_wheel, tmp_path):
    bad = tmp_path / sglang_wheel.path.name
    with zipfile.ZipFile(sglang_wheel.path) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "sglang/srt/utils/auth.py":
                data += b"# tampered\n"
            dst.writestr(item, data)
    wheel = wheels.Wheel(bad, "sglang", "0.5.11")
    assert wheel.read("sglang/version.py") == sglang_wheel.read("sglang/version.py")
    with pytest.raises(wheels.WheelError, match="does not match the wheel's RECORD"):
        wheel.read("sglang/srt/utils/auth.py")


def test_damaged_image_cache_is_recompiled(patchsets_dir):
    known = patching.load_patchsets()
    stack = [known["one-file"]]
    first = compiler.compile_stack(stack, "0.5.11")
    wheel = wheels.pristine("sglang", "0.5.11")
    cache = compiler._cache_path(compiler.cache_key(stack, "0.5.11", wheel.sha256))
    cache.write_text(cache.read_text().replace(first.files["sglang/srt/utils/auth.py"].sha256, "0" * 64))
    again = compiler.compile_stack(stack, "0.5.11")
    assert again.files["sglang/srt/utils/auth.py"].sha256 == first.files["sglang/srt/utils/auth.py"].sha256


def test_synthetic_patchsets_are_what_edit_and_refresh_make_from_the_wheel(tmp_path, monkeypatch, sglang_wheel):
    """make_synthetic.py run afresh (edit + refresh on the real wheel) writes byte for byte the
    committed test data: the authoring round trip is deterministic and the data is not stale."""
    spec = importlib.util.spec_from_file_location("make_synthetic", DATA.parent / "make_synthetic.py")
    make_synthetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_synthetic)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / sglang_wheel.path.name).symlink_to(sglang_wheel.path)
    monkeypatch.setenv("TOOLKIT_CACHE", str(cache))
    out = tmp_path / "made"
    out.mkdir()
    make_synthetic.build(out)
    made = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert {p.parts[0] for p in made} == set(GOOD)
    for rel in made:
        assert (out / rel).read_bytes() == (DATA / rel).read_bytes(), rel


def test_crlf_patch_file_is_named_as_such(tmp_path):
    good = DATA / "one-file" / "0.5.11" / "0001-one-file.patch"
    crlf = tmp_path / "0001-one-file.patch"
    crlf.write_bytes(good.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(PatchsetError, match="CRLF \\(Windows\\) line endings") as refused:
        patchsets.read_patch(crlf, "sglang")
    assert "renames" not in str(refused.value) and f"sed -i 's/\\r$//' {crlf}" in str(refused.value)
    crlf.write_bytes(crlf.read_bytes().replace(b"\r\n", b"\n"))  # the advised fix
    assert patchsets.read_patch(crlf, "sglang").files[0].path == "sglang/srt/utils/auth.py"


def test_host_code_keeps_to_python_3_8_grammar():
    import ast

    ast.parse(hostrun.build_payload("patch_apply", {}), feature_version=(3, 8))
    for path, source in hostrun.host_files().items():
        ast.parse(source, path, feature_version=(3, 8))


def test_a_patchset_in_the_old_one_release_layout_is_refused_with_the_move_command(patchsets_dir):
    old = patchsets_dir / "old-style"
    old.mkdir()
    shutil.copyfile(DATA / "one-file" / "0.5.11" / "0001-one-file.patch", old / "0001-old-style.patch")
    (old / "patchset.toml").write_text('name = "old-style"\nsummary = "s"\npackage = "sglang"\nversions = ["0.5.11"]\n'
                                       'order = 5\nrequires = []\npatches = ["0001-old-style.patch"]\n')
    with pytest.raises(PatchsetError) as refused:
        patching.load_patchsets()
    assert f"`mkdir {old}/0.5.11 && git mv {old}/*.patch {old}/0.5.11/`" in str(refused.value)
    (old / "0.5.11").mkdir()
    (old / "0001-old-style.patch").rename(old / "0.5.11" / "0001-old-style.patch")
    toml = old / "patchset.toml"
    toml.write_text(toml.read_text().replace('versions = ["0.5.11"]\n', "").replace('patches = ["0001-old-style.patch"]\n',
                                                                                  ""))
    assert patching.load_patchsets()["old-style"].releases == {"0.5.11": ["0001-old-style.patch"]}
    assert patching.check("old-style").ok


def _toy_wheel(folder, version):
    """A minimal valid wheel of the package toy-pkg, for pip to find without an index."""
    dist = f"toy_pkg-{version}.dist-info"
    with zipfile.ZipFile(folder / f"toy_pkg-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr("toy_pkg/__init__.py", "")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: toy-pkg\nVersion: {version}\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", f"toy_pkg/__init__.py,,\n{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n")


def test_fetch_of_a_release_the_index_lacks_says_so_and_names_what_it_has(tmp_path, monkeypatch):
    """Real pip over a local links folder (no network): a missing release is not a network fault."""
    links = tmp_path / "links"
    links.mkdir()
    for version in ("1.0", "1.1"):
        _toy_wheel(links, version)
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    assert wheels.fetch("toy-pkg", "1.1").name == "toy_pkg-1.1-py3-none-any.whl"
    with pytest.raises(wheels.WheelError) as missing:
        wheels.fetch("toy-pkg", "9.9.9")
    assert str(missing.value) == ("the package index has no toy-pkg 9.9.9 (a wheel, no dependencies); its latest "
                                  "releases there: 1.0, 1.1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(wheels.WheelError) as unreadable:
        wheels.fetch("toy-pkg", "1.0")
    assert "put the wheel into" in str(unreadable.value)
