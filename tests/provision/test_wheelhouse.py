"""`invoke wheelhouse build`: exactly the wheels a stack needs, each with its sha256."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkit.provision import wheelhouse
from toolkit.provision.stack import normalize

pytestmark = pytest.mark.slow


def wheel_name_version(file: str) -> tuple[str, str]:
    name, version = file.split("-")[:2]
    return normalize(name), version


def test_manifest_covers_every_pin_with_checked_hashes(cpu_ref_wheelhouse, cpu_ref):
    files = {wheel_name_version(w.file): w for w in cpu_ref_wheelhouse.wheels}
    for pin in cpu_ref.pins:
        assert any(n == pin.name and v.split("+")[0] == pin.version for n, v in files), pin
    # only the pinned CUDA 13.0 compiler parts: nothing from a newer CUDA release slipped in
    cuda = [v for (n, v) in files if n.startswith("nvidia-cuda") or n == "nvidia-nvvm"]
    assert cuda and all(v.startswith("13.0.") for v in cuda)
    on_disk = json.loads((Path(cpu_ref_wheelhouse.folder) / "manifest.json").read_text())
    assert on_disk["stack"] == "cpu-ref" and on_disk["python"] == cpu_ref_wheelhouse.python
    assert len(on_disk["wheels"]) == len(cpu_ref_wheelhouse.wheels)
    assert all(re.fullmatch(r"[0-9a-f]{64}", w["sha256"]) for w in on_disk["wheels"])
    wheelhouse.check_files(wheelhouse.load(cpu_ref_wheelhouse.folder))


def test_a_corrupted_wheel_is_caught_before_sending(tmp_path):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"original")
    manifest = wheelhouse.Manifest("cpu-ref", "3.11", "manylinux_2_36_x86_64",
                                   [wheelhouse.WheelFile("a-1.0-py3-none-any.whl",
                                                         wheelhouse.sha256_file(tmp_path / "a-1.0-py3-none-any.whl"), 8)])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest.to_json()))
    wheelhouse.check_files(wheelhouse.load(tmp_path))
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"tampered")
    with pytest.raises(wheelhouse.WheelhouseError, match="does not match the manifest"):
        wheelhouse.check_files(wheelhouse.load(tmp_path))


def test_platform_tags_expand_to_older_manylinux():
    tags = wheelhouse.expand_platform("manylinux_2_36_x86_64")
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert wheelhouse.expand_platform("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_host_wheel_list_hashes_each_wheel_once_and_again_when_it_changes(tmp_path):
    import hashlib

    from toolkit.core import hostrun
    from toolkit.core.transport import LocalTransport

    wheel = tmp_path / "a-1.0-py3-none-any.whl"
    wheel.write_bytes(b"first")
    transport = LocalTransport()
    listed = [hostrun.run_script(transport, "provision_wheels", {"dir": str(tmp_path), "create": True})]
    listed.append(hostrun.run_script(transport, "provision_wheels", {"dir": str(tmp_path), "create": True}))
    wheel.write_bytes(b"second, longer")
    listed.append(hostrun.run_script(transport, "provision_wheels", {"dir": str(tmp_path), "create": True}))
    assert [x["hashed"] for x in listed] == [1, 0, 1]
    assert listed[2]["wheels"] == {wheel.name: hashlib.sha256(b"second, longer").hexdigest()}
    missing = hostrun.run_script(transport, "provision_wheels", {"dir": str(tmp_path / "none"), "create": False})
    assert missing == {"dir": str(tmp_path / "none"), "exists": False, "wheels": {}, "hashed": 0}
    assert not (tmp_path / "none").exists()
