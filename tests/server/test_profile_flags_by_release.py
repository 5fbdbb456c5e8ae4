"""Every flag a shipped SGLang profile passes is one that each supported release's server takes.

0.5.23 renamed CUDA-graph flags (`--cuda-graph-max-bs` became `--cuda-graph-max-bs-decode` and
`-prefill`; argparse then refuses the old name as ambiguous): the lab's servers died at start on the
first 0.5.23 call (docs/evidence/release-0.5.23/1-first-starts). A profile that passed such a flag
would stop `invoke server start` on every host of that release."""
import pytest

from tests.helpers import sglang_options
from toolkit.core.inventory import Host
from toolkit.server import profiles

RELEASES = ("0.5.11", "0.5.17", "0.5.23")


@pytest.fixture(scope="module")
def options():
    return {release: sglang_options(release) for release in RELEASES}


def sglang_profiles():
    return sorted(name for name, p in profiles.load_profiles().items() if p.get("kind", "sglang") == "sglang")


def test_the_options_read_from_the_wheels_are_the_releases_own(options):
    # what makes the check below able to fail: a flag one release has and another lacks
    assert "--cuda-graph-max-bs" in options["0.5.11"] and "--cuda-graph-max-bs" in options["0.5.17"]
    assert "--cuda-graph-max-bs" not in options["0.5.23"] and "--cuda-graph-max-bs-decode" in options["0.5.23"]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("profile", sglang_profiles())
def test_every_flag_of_a_shipped_profile_exists_in_the_release(options, profile, release):
    host = Host(name="h", transport="local", python="python3", state_dir="/tmp/state")
    plan = profiles.resolve(host, profile, {"model": "/m", "draft_model": "/d"})
    flags = [arg for arg in plan.argv[3:] if arg.startswith("--")]
    assert flags, profile
    assert [f for f in flags if f not in options[release]] == [], (profile, release)
