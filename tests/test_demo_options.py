"""`invoke demo` refuses bad options before its first step (the sandbox is not even started)."""
import pytest

from tests.helpers import invoke


@pytest.mark.parametrize("options, says", [
    (("--profile", "nosuch"), "unknown profile 'nosuch'"),
    (("--patchset", "nosuch"), "unknown patchset 'nosuch'"),
    (("--concurrency", "1,x"), "--concurrency takes comma-separated integers"),
    (("--requests", "0"), "--requests must be >= 1, got 0"),
    (("--output-len", "abc"), "--output-len takes an integer"),
])
def test_bad_options_stop_the_demo_before_any_step(options, says):
    result = invoke("demo", *options)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr
    assert "== invoke" not in result.stdout
