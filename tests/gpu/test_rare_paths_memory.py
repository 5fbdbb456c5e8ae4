"""The #33 item 4 memory check: its prompt must reach the GPU (a request the server refuses
measured nothing in the 2026-12-02 call: 8196 tokens against the big pair's 4096 context), and the
bracket from an earlier call is read as written."""
import asyncio

import pytest
from aiohttp import web

from tests.gpu.scripts import load_gpu_script, on_loopback_server

rare = load_gpu_script("rare_paths_device")
make_models = load_gpu_script("make_models")

SPECIALS = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|eot_id|>": 4}


def test_the_prompt_and_its_answer_fit_the_big_pairs_context():
    context = make_models.llama_config(SPECIALS)["max_position_embeddings"]
    assert rare.MEMORY_PROMPT + rare.MEMORY_ANSWER <= context


def test_the_prompt_fills_the_chunk_the_server_is_started_with():
    flags = rare.memory_server("eagle3-v2", 0.9, "0").flags
    chunk = int(flags[flags.index("--chunked-prefill-size") + 1])
    assert chunk == rare.MEMORY_CHUNK
    assert chunk - 16 <= rare.MEMORY_PROMPT <= chunk


def test_without_a_bracket_the_whole_range_is_searched_and_its_top_tried():
    assert rare.memory_bracket(None) == (0.80, 0.97, False)


def test_a_bracket_from_an_earlier_call_marks_its_top_as_already_failed():
    assert rare.memory_bracket("0.9275,0.9381") == (0.9275, 0.9381, True)


@pytest.mark.parametrize("text", ["0.95,0.9", "0,0.9", "0.9,1.0", "0.9"])
def test_a_bracket_that_is_not_lo_below_hi_inside_0_1_is_refused(text):
    with pytest.raises(ValueError):
        rare.memory_bracket(text)


@pytest.mark.parametrize("status, error", [(400, "HarnessError"), (500, "RuntimeError"), (200, None)])
def test_a_refused_request_is_a_harness_error_not_an_answer(status, error):
    # the 2026-12-02 call took SGLang's 400 ("longer than the model's context length") for survival
    async def generate(request):
        return web.json_response({"text": "ok"} if status == 200 else {"error": {"message": "too long"}},
                                 status=status)

    def run():
        return on_loopback_server([("POST", "/generate", generate)],
                                  lambda s, srv: rare.post(s, srv, {"input_ids": [1]}))

    if error is None:
        assert asyncio.run(run()) == {"text": "ok"}
    else:
        with pytest.raises(RuntimeError) as got:
            asyncio.run(run())
        assert type(got.value).__name__ == error and str(status) in str(got.value)
