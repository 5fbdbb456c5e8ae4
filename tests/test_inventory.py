"""Inventory: built-in hosts, hosts/*.toml, TOOLKIT_INVENTORY, --host parsing, bad input."""
import dataclasses
import socket

import pytest

from tests.helpers import invoke
from toolkit.core.inventory import InventoryError, resolve_hosts
from toolkit.core.transport import LOOPBACK_ONLY_ENV, TransportError


def test_default_is_the_sandbox():
    [host] = resolve_hosts(None)
    assert host.name == "sandbox" and host.address == "127.0.0.1" and host.transport == "ssh"


def test_several_hosts_and_labels(monkeypatch, tmp_path):
    extra = tmp_path / "lab.toml"
    extra.write_text('[gpu-a]\naddress = "gpu-a.example"\nlabels = ["lab"]\nvenv = "/v"\n'
                     '[gpu-b]\naddress = "gpu-b.example"\nlabels = ["lab"]\nvenv = "/v"\n')
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(extra))
    assert [h.name for h in resolve_hosts("local, @lab")] == ["local", "gpu-a", "gpu-b"]
    assert resolve_hosts("gpu-a")[0].toolkit_state_dir == "/v/.toolkit"


def test_a_host_named_twice_is_taken_once_in_its_first_place(monkeypatch, tmp_path):
    """`-H sandbox,sandbox` must not run two commands on one host side by side (the second one's
    patch apply then fails on the first one's changes)."""
    extra = tmp_path / "lab.toml"
    extra.write_text('[gpu-a]\naddress = "gpu-a.example"\nlabels = ["lab"]\nvenv = "/v"\n'
                     '[gpu-b]\naddress = "gpu-b.example"\nlabels = ["lab"]\nvenv = "/v"\n')
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(extra))
    assert [h.name for h in resolve_hosts("sandbox,sandbox")] == ["sandbox"]
    assert [h.name for h in resolve_hosts("gpu-b, local, @lab, gpu-b")] == ["gpu-b", "local", "gpu-a"]
    assert [h.name for h in resolve_hosts("@sandbox,sandbox")] == ["sandbox"]


def record_dials(monkeypatch) -> list:
    """Every name this process asks to resolve and every address it connects a socket to; each fails."""
    seen = []

    def getaddrinfo(host, *args, **kwargs):
        seen.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "name lookups are off in this test")

    def connect(self, address):
        seen.append(address[0])
        raise ConnectionRefusedError("connections are off in this test")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return seen


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_example_blackwell_host_is_listed_but_never_dialled(monkeypatch, tmp_path, guarded):
    """The tests run with TOOLKIT_LOOPBACK_ONLY (tests/conftest.py): a command that reaches for the
    example host is refused before its name is looked up. Unguarded, the same call does look it up:
    what the guard stops."""
    [host] = resolve_hosts("blackwell-01")
    assert host.address == "blackwell-01.example" and host.gpus == 8
    # key files that exist, so that the unguarded call gets as far as dialling
    (tmp_path / "known_hosts").write_text("")
    (tmp_path / "key").write_text("")
    host = dataclasses.replace(host, key=str(tmp_path / "key"), known_hosts=str(tmp_path / "known_hosts"))
    if not guarded:
        monkeypatch.delenv(LOOPBACK_ONLY_ENV)
    seen = record_dials(monkeypatch)
    with pytest.raises(TransportError) as info:
        host.connect().run("true")
    if guarded:
        assert seen == [] and "refused to dial blackwell-01.example:22" in str(info.value)
    else:
        assert seen == ["blackwell-01.example"] and "cannot reach blackwell-01.example:22" in str(info.value)


def test_the_command_line_refuses_to_dial_the_example_host_under_the_guard():
    done = invoke("facts", "--host", "blackwell-01", timeout=120)
    assert done.returncode != 0
    assert "refused to dial blackwell-01.example:22: TOOLKIT_LOOPBACK_ONLY is set" in done.stderr


def test_unknown_host_names_the_known_ones():
    with pytest.raises(InventoryError, match="unknown host 'nope'; known hosts: .*sandbox"):
        resolve_hosts("nope")


def test_unknown_key_in_a_host_file_is_an_error(monkeypatch, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[h]\naddress = "h.example"\nadress_typo = 1\n')
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(bad))
    with pytest.raises(InventoryError, match="adress_typo"):
        resolve_hosts("h")


def test_broken_toml_is_an_error_naming_the_file(monkeypatch, tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[h\n")
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(bad))
    with pytest.raises(InventoryError) as refused:
        resolve_hosts("sandbox")
    # where the file is, and how it got in: a name alone is not enough to find it
    assert str(refused.value).startswith(f"cannot read inventory {bad} (from TOOLKIT_INVENTORY): ")


def _inventory(monkeypatch, tmp_path, text):
    path = tmp_path / "lab.toml"
    path.write_text(text)
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(path))


def test_host_without_address_is_refused_at_load_naming_host_and_file(monkeypatch, tmp_path):
    _inventory(monkeypatch, tmp_path, '[gpu-a]\nport = 2322\nuser = "ml"\nkey = "k"\nvenv = "/v"\n')
    with pytest.raises(InventoryError, match=r"lab.toml: host 'gpu-a' has no address"):
        resolve_hosts("gpu-a")
    _inventory(monkeypatch, tmp_path, '[gpu-a]\naddress = "  "\nvenv = "/v"\n')
    with pytest.raises(InventoryError, match=r"lab.toml: host 'gpu-a' has no address"):
        resolve_hosts("sandbox")  # the whole inventory is checked, whichever host is asked for
    _inventory(monkeypatch, tmp_path, '[box]\ntransport = "local"\nvenv = "/v"\n')
    assert resolve_hosts("box")[0].address == ""  # a local host needs none


def test_a_value_of_the_wrong_kind_names_its_key(monkeypatch, tmp_path):
    cases = {'port = "twenty-two"': "port must be an integer, got 'twenty-two'",
             "port = 70000": "port must be 1-65535, got 70000",
             "port = true": "port must be an integer, got True",
             "gpus = 8.0": "gpus must be an integer, got 8.0",
             'labels = "lab"': "labels must be a list of strings, got 'lab'",
             "labels = [1]": r"labels must be a list of strings, got \[1\]",
             "venv = 3": "venv must be a string, got 3"}
    for line, message in cases.items():
        _inventory(monkeypatch, tmp_path, f'[gpu-a]\naddress = "gpu-a.example"\n{line}\n')
        with pytest.raises(InventoryError, match=f"lab.toml: host 'gpu-a': {message}"):
            resolve_hosts("gpu-a")
