"""`server logs --rank N`: rank-prefixed lines of a TP>1 server, everything for a one-rank server."""
from toolkit.hostside import server_ctl

TP2 = ["[2026-11-29 09:00:00 TP0] Load weight end\n", "[2026-11-29 09:00:00 TP1] Load weight end\n",
       "[2026-11-29 09:00:01] The server is fired up and ready to roll!\n"]
TP1 = ["[2026-11-29 09:04:13] Decode batch, #running-req: 32\n", "INFO:     127.0.0.1 - \"POST /v1/chat\" 200\n"]


def test_rank_filter_keeps_only_that_ranks_lines():
    assert server_ctl._rank_rows(TP2, 1) == [TP2[1]]
    assert server_ctl._rank_rows(TP2, None) == TP2


def test_rank_zero_of_a_single_rank_server_is_the_whole_log():
    # SGLang with --tp-size 1 prints no "TP0" prefix (seen on the H200: docs/evidence/gpu-toolkit)
    assert server_ctl._rank_rows(TP1, 0) == TP1
    assert server_ctl._rank_rows(TP1, 1) == []
