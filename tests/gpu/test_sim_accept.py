"""gpu/sim_accept.py on SGLang's real spec_utils.py (the 0.5.11 wheel, hash-checked): the per-request
draw keeps SGLang's distribution of one request's accept length and makes the requests of a step
independent; the rewrite and its undo leave the file as it was; other releases are refused untouched."""
import importlib.util
import os
import statistics

import pytest
import torch

from toolkit.patch import wheels

from .scripts import ROOT

spec = importlib.util.spec_from_file_location("sim_accept", ROOT / "gpu" / "sim_accept.py")
sim_accept = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_accept)

STEPS = 3   # the lab's EAGLE-3 servers: --speculative-num-steps 3, 4 tokens a verify


def spec_utils(release):
    text = wheels.pristine("sglang", release).read(sim_accept.SPEC_UTILS)
    return text.decode() if isinstance(text, bytes) else text


def function(text, acc_len, method="multinomial"):
    """The module's generate_simulated_accept_index (with the rewrite's helper before it), run on the
    CPU (the one place SGLang's own hard-codes "cuda" is where it allocates the index; the test gives
    it the input's device)."""
    start, end = sim_accept._span(text)
    if sim_accept.MARK in text:
        start = text.index(sim_accept.MARK)
    source = text[start:end].replace('device="cuda"', "device=accept_index.device")
    names = {"torch": torch, "os": os, "SIMULATE_ACC_LEN": acc_len, "SIMULATE_ACC_METHOD": method}
    exec(compile(source, "spec_utils", "exec"), names)
    return names["generate_simulated_accept_index"]


def draw(fn, bs, acc_len, method="multinomial"):
    """One verify step of bs requests: (each request's accept length, the index, the drafts)."""
    accept_index = (torch.arange(bs, dtype=torch.int32) * (STEPS + 1)).view(-1, 1).repeat(1, STEPS + 1)
    predict = torch.zeros(bs * (STEPS + 1), dtype=torch.int32)
    drafts = torch.zeros(bs, dtype=torch.int32)
    index = fn(accept_index, predict, drafts, bs, STEPS, acc_len, method)
    lengths = (index >= 0).sum(dim=1)
    return lengths, index, drafts, predict


@pytest.fixture(scope="module")
def pristine():
    return spec_utils("0.5.11")


def test_sglang_draws_one_length_for_the_whole_step(pristine):
    # the premise: every request of a step gets the same accept length
    torch.manual_seed(0)
    fn = function(pristine, 2.5)
    for _ in range(20):
        lengths, _, _, _ = draw(fn, 48, 2.5)
        assert len(set(lengths.tolist())) == 1


def test_per_request_draws_are_independent_and_well_formed(pristine):
    torch.manual_seed(1)
    fn = function(sim_accept.rewrite(pristine), 2.5)
    lengths, index, drafts, predict = draw(fn, 256, 2.5)
    assert len(set(lengths.tolist())) >= 3
    assert set(lengths.tolist()) <= {1, 2, 3, 4}
    for row, n in enumerate(lengths.tolist()):
        first = row * (STEPS + 1)
        assert index[row].tolist() == [first + k for k in range(n)] + [-1] * (STEPS + 1 - n)
    assert drafts.tolist() == [n - 1 for n in lengths.tolist()]
    assert set(predict.tolist()) == {100}
    assert index.dtype == torch.int32


@pytest.mark.parametrize("acc_len,method", [(2.5, "multinomial"), (1.6, "multinomial"), (2.5, "match-expected"),
                                            (1.6, "match-expected")])
def test_one_requests_distribution_is_sglangs(pristine, acc_len, method):
    """The same marginal: SGLang's per-step draws over many steps against per-request draws."""
    torch.manual_seed(2)
    stock = function(pristine, acc_len, method)
    ours = function(sim_accept.rewrite(pristine), acc_len, method)
    per_step = [draw(stock, 1, acc_len, method)[0].item() for _ in range(4000)]
    per_request = torch.cat([draw(ours, 100, acc_len, method)[0] for _ in range(40)]).tolist()
    for k in (1, 2, 3, 4):
        assert per_step.count(k) / len(per_step) == pytest.approx(per_request.count(k) / len(per_request), abs=0.03)
    assert statistics.mean(per_step) == pytest.approx(statistics.mean(per_request), abs=0.05)


def test_a_steps_mean_spreads_as_independent_requests_do(pristine):
    # what auto's probe sees at 48 requests: the step's mean accept length
    torch.manual_seed(3)
    stock = function(pristine, 1.6)
    ours = function(sim_accept.rewrite(pristine), 1.6)
    stock_means = [draw(stock, 48, 1.6)[0].float().mean().item() for _ in range(300)]
    our_means = [draw(ours, 48, 1.6)[0].float().mean().item() for _ in range(300)]
    assert statistics.pstdev(our_means) < 0.25 * statistics.pstdev(stock_means)
    assert all(m == int(m) for m in stock_means)   # one integer per step: 1.0, 2.0, 3.0 ...


def test_apply_and_undo_on_a_tree(tmp_path, pristine):
    path = tmp_path / sim_accept.SPEC_UTILS
    path.parent.mkdir(parents=True)
    path.write_text(pristine)
    assert sim_accept.mode(tmp_path) == "per-step"
    assert sim_accept.apply(tmp_path, "per-request") == "per-request"
    rewritten = path.read_text()
    assert sim_accept.apply(tmp_path, "per-request") == "per-request"   # once only
    assert path.read_text() == rewritten
    assert (path.parent / ("spec_utils.py" + sim_accept.SAVED)).read_text() == pristine
    assert sim_accept.apply(tmp_path, "per-step") == "per-step"
    assert path.read_text() == pristine
    assert sim_accept.apply(tmp_path, "per-step") == "per-step"
    assert sim_accept.mode(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("release", ["0.5.17", "0.5.23"])
def test_another_releases_function_is_refused_untouched(tmp_path, release, capsys):
    text = spec_utils(release)
    path = tmp_path / sim_accept.SPEC_UTILS
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert sim_accept.main(["per-request", str(tmp_path), str(tmp_path / "empty")]) == 1
    assert path.read_text() == text
    assert not (path.parent / ("spec_utils.py" + sim_accept.SAVED)).exists()
    out = capsys.readouterr()
    assert "not SGLang 0.5.11's" in out.err
    assert "no sglang (skipped)" in out.out


def test_the_cli_refuses_a_bad_verb(capsys):
    assert sim_accept.main(["sideways", "/nowhere"]) == 2
    assert "per-request" in capsys.readouterr().err


def test_a_file_named_in_the_environment_moves_the_mean(tmp_path, monkeypatch, pristine):
    """What a driver's acceptance phases rest on: the server reads its mean from the file while the
    file holds a positive number, and its own SGLANG_SIMULATE_ACC_LEN otherwise."""
    control = tmp_path / "acc"
    monkeypatch.setenv(sim_accept.ACC_LEN_FILE_ENV, str(control))
    fn = function(sim_accept.rewrite(pristine), 2.5)
    torch.manual_seed(4)

    def mean_length():
        return torch.cat([draw(fn, 200, 2.5)[0] for _ in range(10)]).float().mean().item()

    assert mean_length() == pytest.approx(2.5, abs=0.1)          # no file: the server's own
    for value, ns in (("1.2", 1), ("3.4", 2)):
        control.write_text(value + "\n")
        os.utime(control, ns=(ns * 10**9, ns * 10**9))             # a new mtime, as a new phase has
        expected = statistics.mean(draw(function(pristine, float(value)), 1, float(value))[0].item()
                                   for _ in range(2000))
        assert mean_length() == pytest.approx(expected, abs=0.1)
    control.write_text("fast")
    os.utime(control, ns=(3 * 10**9, 3 * 10**9))
    assert mean_length() == pytest.approx(2.5, abs=0.1)          # not a number: the server's own
    control.unlink()
    assert mean_length() == pytest.approx(2.5, abs=0.1)


def test_an_unknown_method_is_refused_by_its_name(pristine):
    fn = function(sim_accept.rewrite(pristine), 2.5)
    with pytest.raises(ValueError, match="'sideways'"):
        draw(fn, 4, 2.5, method="sideways")
