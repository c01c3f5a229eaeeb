"""The OpenAI-compatible HTTP API, driven by the official `openai` client and raw HTTP.

One worker process and a router process (`pagedserve serve --role router`) with an API key;
each test states one behaviour of the HTTP API a client relies on.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import grpc
import httpx
import openai
import pydantic
import pytest
from worker_process import WorkerProcess, free_port

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router.openai_protocol import MAX_HEADER_REQUEST_ID_LENGTH

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
PROMPT = "The capital of France is"


class RouterProcess:
    """`python -m launcher.cli serve --role router` on loopback, ready once /health answers 200."""

    def __init__(self, workers: list[str], *flags: str, wait_for_workers: bool = True):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        command = [sys.executable, "-m", "launcher.cli", "serve", "--role", "router", "--host", "127.0.0.1",
                   "--port", str(self.grpc_port), "--http-port", str(self.http_port),
                   "--workers", *workers, *flags]
        self.log_file = open(REPO / f".router-{self.http_port}.log", "w+")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(f"{self.url}/health", timeout=1).status_code
                if status == 200 or (status == 503 and not wait_for_workers):
                    return
            time.sleep(0.2)
        raise TimeoutError(self.log())

    def log(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read()[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log_file.close()
        os.unlink(self.log_file.name)


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess(["--logits-processors", "worker.length_temperature:LengthTemperature"]) as w:
        yield w


@pytest.fixture(scope="module")
def router(worker):
    r = RouterProcess([worker.address], "--api-key", API_KEY)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def grpc_text(router: RouterProcess, request: pb.GenerateRequest) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")])
        return "".join(c.text for r in responses for c in r.choices)


def post(router: RouterProcess, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kw.setdefault("timeout", 60)
    return httpx.post(f"{router.url}{path}", json=body, headers=headers | kw.pop("headers", {}), **kw)


def test_models_lists_the_served_model(client, model):
    assert model == "smollm2-135m-instruct"
    assert [m.id for m in client.models.list().data] == [model]


def test_retrieving_a_model_whose_id_holds_a_slash_reaches_the_handler(router, model):
    """Hugging Face ids (org/name) are model ids too: not a 404 of the router's path table."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{router.url}/v1/models/{model}", headers=headers).json()["id"] == model
    r = httpx.get(f"{router.url}/v1/models/org/{model}", headers=headers)
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found" and f"'org/{model}'" in error["message"]


def test_completion_equals_grpc_greedy_output_with_usage(client, router, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = grpc_text(router, pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(
        temperature=0, max_tokens=12)))
    assert completion.choices[0].text == expected and expected
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


@pytest.mark.parametrize("include_usage", [True, False])
def test_with_include_usage_every_chunk_has_usage_null_but_the_last(router, model, include_usage):
    """OpenAI's wire format, which strict clients (typed SDKs) rely on."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": include_usage}}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
        chunks = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                  if line.startswith("data: {")]
    if include_usage:
        assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    else:
        assert not any("usage" in c for c in chunks)


def test_a_bad_include_usage_is_400_naming_it_inside_stream_options(router, model):
    response = post(router, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": "yes"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options.include_usage"


def test_streamed_completion_equals_unstreamed_and_ends_with_usage(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_return_token_ids_gives_each_choice_the_token_ids_of_its_text(client, model, smollm_tokenizer):
    """vLLM's extension, through the official client's extra_body: the ids the text decodes from,
    whole in a response and piece by piece in a stream."""
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True}))
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == whole.usage.completion_tokens
    assert smollm_tokenizer.decode(ids, skip_special_tokens=True) == whole.choices[0].text
    assert [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]] == ids


def test_token_ids_are_left_out_unless_asked_for(client, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "token_ids" not in completion.choices[0].model_extra


def test_chat_completion_equals_grpc_chat_output(client, router, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    request = pb.GenerateRequest(params=pb.SamplingParameters(temperature=0, max_tokens=16))
    request.chat.messages.add(role="user", content="What is the capital of France?")
    assert chat.choices[0].message.content == grpc_text(router, request)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0


def test_streamed_chat_equals_unstreamed(client, model):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_n_choices_and_seed_reproducible(client, model):
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, seed=11, temperature=1.0)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, seed=11, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]


def test_logprobs_returned_for_chat(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_stop_string_ends_the_completion(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = whole.strip().split()[1]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == whole[:whole.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_extra_sampling_fields_accepted(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8,
                                         "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 6,
                                         "ignore_eos": True, "priority": 1, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": ["Hi", "x " * 9000]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-17"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),
])
def test_a_refused_request_gets_an_openai_error_naming_its_field_and_the_server_serves_on(
        router, model, path, body, status, param):
    """Wiring only: which body gets which error is specified in test_openai_protocol.py."""
    r = post(router, path, {"model": model, "max_tokens": 2} | body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_stream_options_of_null_or_empty_are_accepted_without_a_stream(router, model):
    for options in (None, {}):
        r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2,
                                             "stream_options": options})
        assert r.status_code == 200, r.text


def test_chat_without_max_tokens_is_not_cut_at_16_tokens(client, model):
    chat = client.chat.completions.create(model=model, temperature=0,
                                          messages=[{"role": "user", "content": "Count from 1 to 10."}])
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens > 16


def test_a_chat_continuing_its_last_message_is_the_completion_of_that_rendered_prompt(router, client, model):
    """vLLM's continue_final_message through the official client's extra_body: the prompt is the
    chat rendered with the assistant turn left open (as /tokenize renders it), and the answer is
    what a completion of that prompt gives."""
    partial = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    rendering = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(router, "/tokenize", {"model": model, "messages": partial} | rendering).json()["tokens"]
    assert post(router, "/detokenize", {"model": model, "tokens": tokens}).json()["prompt"].endswith(
        "My favourite color is")       # left open: no end of turn after it
    completion = client.completions.create(model=model, prompt=tokens, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=model, messages=partial, max_tokens=8, temperature=0,
                                          extra_body=rendering)
    assert chat.usage.prompt_tokens == len(tokens)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_a_chat_without_max_tokens_whose_choices_cannot_all_fit_is_400_naming_n(router, model):
    """Each choice of a chat without max_tokens reserves 1,024 output tokens; 128 choices of
    them are more than the worker's pool holds."""
    r = post(router, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                              "n": 128})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "n", r.text
    assert "with max_tokens unset, 1024 output tokens are reserved for each of the n=128 choices" in error["message"]


def test_completion_without_max_tokens_stops_at_16_tokens(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def post_raw(router: RouterProcess, body: bytes, content_type: str = "application/json", **headers: str
             ) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", content=body, timeout=60, headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": content_type} | headers)


def test_oversized_body_is_413(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": "x" * (9 * 2**20)})
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]


def test_a_content_length_past_the_limit_is_413_before_any_body_is_sent(router):
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 99999999999\r\n\r\n")
        reply = b""
        while chunk := raw.recv(4096):       # to the end: the server closes the connection
            reply += chunk
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "Content-Length 99999999999" in reply
    assert "Connection: close" in reply


def completion_body(model) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()


@pytest.mark.parametrize("coding", ["gzip", "deflate", "gzip, identity"])
def test_a_compressed_body_is_read_as_its_content_encoding_says(router, model, coding):
    compress = zlib.compress if coding == "deflate" else gzip.compress
    r = post_raw(router, compress(completion_body(model)), **{"Content-Encoding": coding})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("coding", ["br", "zstd", "foo", "gzip, br"])
def test_a_content_encoding_the_server_cannot_decode_is_415_naming_it(router, model, coding):
    r = post_raw(router, completion_body(model), **{"Content-Encoding": coding})
    error = r.json()["error"]
    assert r.status_code == 415 and error["param"] == "Content-Encoding", r.text
    assert coding.split(", ")[-1] in error["message"] and r.headers["X-Request-Id"]


def test_a_corrupt_gzip_body_is_400_saying_so(router, model):
    r = post_raw(router, gzip.compress(completion_body(model))[:-12], **{"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]["message"], r.text


def test_a_gzip_body_past_the_limit_once_decompressed_is_413(router, model):
    bomb = gzip.compress(b" " * (9 * 2**20) + completion_body(model))
    r = post_raw(router, bomb, **{"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "once decompressed" in r.json()["error"]["message"], r.text


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(router, model):
    for key in (None, "wrong"):
        r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT}, key=key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_request_id_is_echoed(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2},
             headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"


def test_a_request_id_a_batch_could_not_name_its_requests_after_is_400_naming_the_header(router, model):
    longest = "r" * MAX_HEADER_REQUEST_ID_LENGTH
    batch = {"model": model, "prompt": [PROMPT, PROMPT], "max_tokens": 1}
    assert post(router, "/v1/completions", batch, headers={"X-Request-Id": longest}).status_code == 200
    r = post(router, "/v1/completions", batch, headers={"X-Request-Id": longest + "r"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "X-Request-Id"
    assert error["message"].startswith(f"X-Request-Id has {MAX_HEADER_REQUEST_ID_LENGTH + 1} characters")


def test_tokenize_then_detokenize_round_trips(router):
    tokens = post(router, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 5
    assert post(router, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_opens_the_assistant_turn_unless_told_not_to(router, smollm_tokenizer, add_generation_prompt):
    ids = post(router, "/tokenize", {"messages": ASK, "add_generation_prompt": add_generation_prompt}).json()["tokens"]
    text = smollm_tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ids == smollm_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_overload_is_429_with_retry_after(worker):
    busy = RouterProcess([worker.address], "--max-concurrent-requests", "1", "--max-queue-len", "0")
    try:
        with httpx.Client(timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
            with http.stream("POST", f"{busy.url}/v1/completions", json=body) as long_running:
                assert long_running.status_code == 200
                r = http.post(f"{busy.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        busy.stop()


def test_no_worker_is_503():
    lonely = RouterProcess([f"127.0.0.1:{free_port()}"], wait_for_workers=False)
    try:
        r = httpx.post(f"{lonely.url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        lonely.stop()


def test_admission_size_error_names_no_bogus_param(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 200, "n": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


def test_a_model_is_retrieved_by_name(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_completion_top_logprobs_include_the_sampled_token(client, model):
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=5,
                                       logprobs=1).choices[0]
    for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
        assert token in top


def test_bearer_scheme_is_case_insensitive(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1}, key=None,
             headers={"Authorization": f"bearer {API_KEY}"})
    assert r.status_code == 200, r.text


def router_gauge(router: RouterProcess, name: str) -> float:
    for line in httpx.get(f"{router.url}/metrics").text.splitlines():
        if line.startswith(f"pagedserve_router_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_non_streaming_request_is_aborted_when_its_client_goes_away(router, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(router, "/v1/completions", body, timeout=1.5)
    deadline = time.monotonic() + 20
    while router_gauge(router, "requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert router_gauge(router, "requests_running") == 0


def test_a_batch_of_prompts_gives_each_prompt_its_choices_in_order(client, model):
    prompts = [PROMPT, "Once upon a time", [504, 3458, 282]]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert [c.text for c in batch.choices[2 * i:2 * i + 2]] == [alone.choices[0].text] * 2
    assert batch.usage.completion_tokens == 6 * 4


def test_a_streamed_batch_equals_the_unstreamed_one(client, model):
    prompts = [PROMPT, "Once upon a time"]
    whole = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    texts = ["", ""]
    usage = None
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices] and usage.completion_tokens == 8


def test_a_batch_larger_than_the_pool_completes_though_its_prompts_wait_past_the_queue_limit(worker):
    """The pool budget here (--overcommit 0.05 of 2,048 tokens) holds one prompt's reservation
    at a time, so the third prompt waits for the first two, past --max-queue-wait:
    it waits for its own batch, and the batch completes instead of failing with a 429."""
    small = RouterProcess([worker.address], "--overcommit", "0.05", "--max-queue-wait", "1")
    try:
        reply = httpx.post(f"{small.url}/v1/completions", timeout=120, json={
            "prompt": [PROMPT, "Once upon a time", "Hello"], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert [c["index"] for c in reply.json()["choices"]] == [0, 1, 2]
        assert reply.json()["usage"]["completion_tokens"] == 180
        assert "queued_s=" in small.log()
        waits = [float(w) for w in re.findall(r"queued_s=([0-9.]+)", small.log())]
        assert max(waits) > 1, f"no prompt waited past the queue limit: {waits}"
    finally:
        small.stop()


def test_cors_headers_reach_errors_and_event_streams(worker):
    browser = RouterProcess([worker.address], "--allowed-origins", "http://ok.example")
    try:
        origin = {"Origin": "http://ok.example"}
        error = httpx.post(f"{browser.url}/v1/completions", json={"prompt": ""}, headers=origin)
        assert error.status_code == 400 and error.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{browser.url}/v1/completions", json=body, headers=origin) as events:
            assert events.headers["Access-Control-Allow-Origin"] == "http://ok.example"
            assert events.headers["Vary"] == "Origin"
    finally:
        browser.stop()


@pytest.mark.parametrize("headers,status", [
    ({"Authorization": "Bearer k\xc3\xa9y".encode("latin-1")}, 401), ({"X-Request-Id": b"bad\xff"}, 400),
])
def test_odd_header_bytes_get_a_client_error(router, model, headers, status):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    auth = {} if "Authorization" in headers else {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{router.url}/v1/completions", json=body, headers=auth | headers, timeout=60)
    assert r.status_code == status and r.json()["error"]["message"], r.text


def test_malformed_http_is_a_400_without_an_error_in_the_log(router):
    with socket.create_connection(("127.0.0.1", router.http_port)) as raw:
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01b\r\n\r\n")
        assert raw.recv(100).split(b" ")[1] == b"400"
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert "malformed HTTP request refused" in router.log() and "ERROR aiohttp" not in router.log()


# ------------------------------------------------------------------ structured outputs

class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int
    role: Literal["admin", "user", "guest"]
    home: City
    hobbies: list[str] = pydantic.Field(max_length=2)


PEOPLE_PROMPTS = ["A user of a web shop.", "The admin of a forum.", "A guest at a wedding.", "A person from Paris.",
                  "A retired teacher.", "A young programmer.", "Someone who loves cats.", "A chess champion.",
                  "A tourist in Rome.", "The mayor of a small town."]


def test_chat_completions_parse_returns_a_pydantic_object_for_each_of_ten_prompts(client, model):
    def parse(prompt: str) -> Person:
        completion = client.beta.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": f"Describe this person as JSON: {prompt}"}],
            response_format=Person, temperature=0, max_tokens=200)
        return completion.choices[0].message.parsed
    with ThreadPoolExecutor(len(PEOPLE_PROMPTS)) as pool:
        people = list(pool.map(parse, PEOPLE_PROMPTS))
    assert all(isinstance(p, Person) for p in people)


def test_a_streamed_json_schema_output_with_two_choices_validates_in_each(client, model):
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], n=2, seed=4,
        temperature=0.8, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        Person.model_validate_json(text)


def test_a_schema_too_complex_for_the_grammar_engine_is_a_400_not_a_broken_success(client, model):
    wide = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(600)}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON"}], max_tokens=20,
                                       temperature=0, response_format={"type": "json_schema",
                                                                       "json_schema": {"name": "x", "schema": wide}})
    assert "the grammar engine stopped at output token" in refused.value.body["message"]
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text


def test_structured_outputs_regex_and_choice_constrain_completions(client, model):
    regex = client.completions.create(model=model, prompt="Call me at", max_tokens=20, temperature=1.0, seed=1,
                                      extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"choice": [" blue", " green"]}})
    assert choice.choices[0].text in (" blue", " green")


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "objec"}}})
    assert refused.value.body["param"] == "response_format.json_schema.schema"
    assert "Invalid type" in refused.value.body["message"]


def test_logit_bias_through_the_openai_client_bans_and_forces_tokens(client, model, router):
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = httpx.post(f"{router.url}/tokenize", json={"prompt": greedy.choices[0].text}).json()["tokens"][0]
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=1,
                                       logit_bias={"1000": 100})
    ids = httpx.post(f"{router.url}/tokenize", json={"prompt": forced.choices[0].text}).json()["tokens"]
    assert ids == [1000] * 4


# The unit in $defs, as pydantic writes an enum field: "required" nests each tool's schema, and
# its references must still resolve.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"$ref": "#/$defs/Unit"}},
           "required": ["city", "unit"], "additionalProperties": False,
           "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_come_back_with_arguments_that_follow_the_schema(client, model, tool_choice):
    import jsonschema
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=0, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_deltas_add_up_to_the_unstreamed_call(client, model, tool_choice):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name = arguments = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, arguments, finish) == (whole.function.name, whole.function.arguments, "tool_calls")


def test_a_named_call_cut_short_by_max_tokens_is_a_tool_call_streamed_or_not(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=5,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    arguments = "".join(delta.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **kwargs)
                        for choice in chunk.choices for delta in choice.delta.tool_calls or ())
    assert whole.message.tool_calls[0].function.arguments == arguments and arguments


def test_tool_choice_auto_on_a_model_of_no_known_syntax_is_a_400_naming_the_known_ones(client, model):
    """SmolLM2-135M-Instruct's chat template knows no tools."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=5)
    body = refused.value.body
    assert body["param"] == "tool_choice"
    assert "is of no family whose syntax is known (hermes: " in body["message"] and "llama3_json: " in body["message"]
    assert "send tool_choice \"required\"" in body["message"]


# A Hermes-style chat template (Qwen2.5's shape, written for the test): the tools in <tools>, a
# call in <tool_call> tags.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nFor a call, return "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, smollm_tokenizer):
    """An OpenAI client of a router over a worker of a small random model whose chat template
    is Hermes-style (SmolLM2's tokenizer, dummy weights): tool_choice "auto" parses its syntax.
    Its outputs are forced with structured_outputs, since its weights are random."""
    from transformers import LlamaConfig
    path = tmp_path_factory.mktemp("hermes")
    LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                eos_token_id=smollm_tokenizer.eos_token_id).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": HERMES_TEMPLATE}))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    with WorkerProcess(["--model", str(path), "--load-format", "dummy"]) as worker:
        router = RouterProcess([worker.address])
        try:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield client, client.models.list().data[0].id
        finally:
            router.stop()


HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
               '</tool_call>')


def test_tool_choice_auto_turns_a_hermes_models_call_into_tool_calls(hermes):
    client, model = hermes
    forced = {"structured_outputs": {"regex": re.escape("Let me check.\n" + HERMES_CALL)}}
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=80,
                                            extra_body=forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}


def test_tool_choice_auto_streams_a_hermes_models_text_then_its_call(hermes):
    client, model = hermes
    forced = {"structured_outputs": {"regex": re.escape("Checking.\n" + HERMES_CALL)}}
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=80,
                                                stream=True, extra_body=forced):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_tool_choice_auto_leaves_a_hermes_models_plain_answer_as_content(hermes):
    client, model = hermes
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=20,
                                            extra_body={"structured_outputs": {"regex": "It is sunny\\."}}).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny.", None, "stop")


def test_the_tools_reach_a_hermes_models_prompt(hermes):
    client, model = hermes
    with_tools = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1,
                                                extra_body={"structured_outputs": {"regex": "x"}})
    without = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 40


def test_tokenize_renders_a_chat_with_its_tools_as_a_chat_completion_does(hermes):
    client, model = hermes
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    asked = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1,
                                           extra_body={"structured_outputs": {"regex": "x"}})
    tokens = httpx.post(f"{url}/tokenize", json={"model": model, "messages": ASK, "tools": TOOLS}).json()
    assert tokens["count"] == asked.usage.prompt_tokens


# ------------------------------------------------------------------ prompt logprobs

SCORED = "The lighthouse keeper climbed the spiral stairs every evening at dusk"


def teacher_forced_logprobs(hf_smollm, ids: list[int]):
    """transformers' logprob of each token but the first given those before it."""
    import torch
    with torch.no_grad():
        logprobs = hf_smollm(torch.tensor([ids])).logits[0].log_softmax(-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_transformers_does(
        client, model, router, hf_smollm):
    scored = client.completions.create(model=model, prompt=SCORED, echo=True, logprobs=2, max_tokens=0)
    [choice] = scored.choices
    ids = httpx.post(f"{router.url}/tokenize", json={"prompt": SCORED}).json()["tokens"]
    assert choice.text == SCORED and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(teacher_forced_logprobs(hf_smollm, ids), abs=1e-4)
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])     # + the prompt token


def test_lm_eval_loglikelihood_requests_get_each_prompts_logprobs_then_one_token(router, model, hf_smollm):
    """lm-eval's local-completions shape: a batch of token-id prompts, echo, logprobs 1, max_tokens 1."""
    prompts = [post(router, "/tokenize", {"prompt": text}).json()["tokens"] for text in (SCORED, PROMPT)]
    body = {"model": model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "seed": 1234}
    choices = post(router, "/v1/completions", body).json()["choices"]
    for choice, ids in zip(choices, prompts):
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(ids) + 1 and logprobs[0] is None
        assert logprobs[1:-1] == pytest.approx(teacher_forced_logprobs(hf_smollm, ids), abs=1e-4)


def test_grpc_prompt_logprobs_give_each_prompt_token_its_logprob_and_top_ones(router):
    request = pb.GenerateRequest(text=SCORED, params=pb.SamplingParameters(max_tokens=0, prompt_logprobs=1))
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")]))
    entries = [entry for response in responses for entry in response.prompt_logprobs]
    ids = httpx.post(f"{router.url}/tokenize", json={"prompt": SCORED}).json()["tokens"]
    assert [entry.sampled.token_id for entry in entries] == ids
    assert not entries[0].sampled.HasField("logprob") and not entries[0].top
    assert all(entry.sampled.HasField("logprob") and len(entry.top) == 1 for entry in entries[1:])
    assert responses[-1].choices[0].finish_reason == pb.FINISH_REASON_LENGTH


# ------------------------------------------------------------------ custom logits processors

def test_a_logits_processor_selected_through_the_openai_client_changes_the_sampling_as_specified(client, model):
    prompt_tokens = client.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    # length_temperature at scale = prompt length doubles the temperature: 0.6 samples as 1.2.
    scaled = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.6, seed=3,
                                       extra_body={"logits_processors": ["length_temperature"],
                                                   "vllm_xargs": {"length_scale": prompt_tokens}})
    reference = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.2, seed=3)
    assert scaled.choices[0].text == reference.choices[0].text


def test_a_logits_processor_the_worker_did_not_load_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"logits_processors": ["nope"]})
    body = refused.value.body
    assert body["message"].startswith("logits_processors[0]: 'nope' is not loaded on the workers (loaded: "
                                      "length_temperature")
    assert body["param"] == "logits_processors"
