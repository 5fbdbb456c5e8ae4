"""Every shipped host (hosts/*.toml) with every shipped profile (profiles/*.toml), rendered the way a
user does it: `invoke server start PROFILE --host HOST --dry-run` (no host is contacted; the example
hosts do not resolve). A typo in a shipped file fails here."""
from __future__ import annotations

import re
import subprocess
import textwrap
import tomllib

import pytest

from tests.helpers import invoke
from toolkit.core.paths import HOSTS_DIR, PROFILES_DIR, PROJECT_ROOT

SHIPPED_HOSTS = {name: table for path in sorted(HOSTS_DIR.glob("*.toml"))
                 for name, table in tomllib.loads(path.read_text()).items()}
SHIPPED_PROFILES = sorted(path.stem for path in PROFILES_DIR.glob("*.toml"))


def dry_run(profile: str, hosts: str, **env) -> subprocess.CompletedProcess:
    return invoke("server", "start", profile, "--host", hosts, "--dry-run", env=env,
                  unset=("TOOLKIT_INVENTORY", "TOOLKIT_PROFILES"), timeout=120)


@pytest.mark.parametrize("profile", SHIPPED_PROFILES)
def test_every_shipped_profile_renders_for_every_shipped_host(profile):
    done = dry_run(profile, ",".join(SHIPPED_HOSTS))
    assert done.returncode == 0, done.stderr
    scripts = done.stdout.split("#!/usr/bin/env bash")[1:]
    assert len(scripts) == len(SHIPPED_HOSTS)
    for name, table in SHIPPED_HOSTS.items():
        assert f"# {name}: " in done.stderr and "Nothing started" in done.stderr
        settings = table.get("server", {})
        script = next(s for s in scripts if f"on host {name}," in s)
        if settings.get("model"):
            assert f" {settings['model']} " in script.replace("\\\n", " ")
        if "tp_size" in settings and "sglang.launch_server" in script:
            # the host's TP size reaches SGLang (a misspelt key was refused before; this is the value used)
            assert re.search(rf"--tp-size {settings['tp_size']}\b", script)


def test_a_misspelt_host_key_fails_that_check(tmp_path):
    """What the check above catches: the `tp = 8` that hosts/blackwell.toml once had."""
    name = next(n for n, table in SHIPPED_HOSTS.items() if "tp_size" in table.get("server", {}))
    source = next(p for p in HOSTS_DIR.glob("*.toml") if name in tomllib.loads(p.read_text()))
    broken = tmp_path / "hosts.toml"
    broken.write_text(re.sub(r"^tp_size = ", "tp = ", source.read_text(), flags=re.M))
    done = dry_run("baseline", name, TOOLKIT_INVENTORY=str(broken))
    assert done.returncode == 2 and "unknown keys in [server]: tp;" in done.stderr


def test_the_readme_inventory_example_renders(tmp_path):
    """README's first-host walk-through starts from an inventory entry: it must be one the toolkit takes."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    example = textwrap.dedent(re.search(r"```toml\n(.*?)```", readme, re.S).group(1))
    name = tomllib.loads(example).popitem()[0]
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(example)
    done = dry_run("eagle3-v2-dyn", name, TOOLKIT_INVENTORY=str(inventory))
    assert done.returncode == 0, done.stderr
    assert re.search(r"--tp-size 8\b", done.stdout) and "SGLANG_SPEC_DISABLE_THRESHOLD" in done.stdout
