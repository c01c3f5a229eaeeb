"""The OpenAI-compatible HTTP API, driven by the official `openai` client and raw HTTP.

One worker process and a router process (`pagedserve serve --role router`) with an API key;
each test states one behaviour of the HTTP API a client relies on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from worker_process import WorkerProcess, free_port

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc

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
    with WorkerProcess() as w:
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


def test_completion_equals_grpc_greedy_output_with_usage(client, router, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = grpc_text(router, pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(
        temperature=0, max_tokens=12)))
    assert completion.choices[0].text == expected and expected
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streamed_completion_equals_unstreamed_and_ends_with_usage(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


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


@pytest.mark.parametrize("field,value,status,param", [
    ("temperature", -1, 400, "temperature"), ("top_p", 1.5, 400, "top_p"), ("max_tokens", 0, 400, "max_tokens"),
    ("n", 0, 400, "n"), ("top_k", 0, 400, "top_k"), ("presence_penalty", 5, 400, "presence_penalty"),
    ("logprobs", 50, 400, "logprobs"), ("temperature", "hot", 400, "temperature"), ("prompt", "", 400, "prompt"),
    ("model", "gpt-17", 404, "model"), ("stop", [1, 2], 400, "stop"),
])
def test_bad_field_gets_status_and_json_error_naming_it(router, model, field, value, status, param):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4} | {field: value}
    r = post(router, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (field if status == 400 else value) in error["message"]
    assert error["param"] == param
    assert post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_prompt_over_max_model_len_is_400(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": [1] * 5000, "max_tokens": 2})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,prompt,field", [
    ("/v1/completions", {"prompt": PROMPT}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "max_completion_tokens"),
])
def test_max_tokens_past_the_context_is_400_naming_the_limit(router, model, path, prompt, field):
    r = post(router, path, {"model": model, field: 10**9} | prompt)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}=1000000000 is too large")
    assert "maximum context length is 2048 tokens" in error["message"]
    assert " in the completion" in error["message"]


def test_chat_without_max_tokens_is_not_cut_at_16_tokens(client, model):
    chat = client.chat.completions.create(model=model, temperature=0,
                                          messages=[{"role": "user", "content": "Count from 1 to 10."}])
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens > 16


def test_completion_without_max_tokens_stops_at_16_tokens(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def post_raw(router: RouterProcess, body: bytes, content_type: str = "application/json", **headers: str
             ) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", content=body, timeout=60, headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": content_type} | headers)


def test_malformed_json_is_400(router):
    r = post_raw(router, b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_an_integer_too_long_to_read_is_400_naming_it(router):
    r = post_raw(router, b'{"prompt": "Hi", "max_tokens": ' + b"7" * 5000 + b"}")
    assert r.status_code == 400, r.text
    assert "an integer of 5000 digits" in r.json()["error"]["message"]


@pytest.mark.parametrize("charset", ["klingon", "latin-1", "utf-16"])
def test_a_charset_other_than_utf8_is_415_naming_it(router, charset):
    r = post_raw(router, b'{"prompt": "Hi", "max_tokens": 1}', f"application/json; charset={charset}")
    assert r.status_code == 415, r.text
    assert f"charset={charset}" in r.json()["error"]["message"] and "UTF-8" in r.json()["error"]["message"]


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", '"utf-8"', "utf8"])
def test_utf8_may_be_named_as_the_charset(router, charset):
    r = post_raw(router, b'{"prompt": "Hi", "max_tokens": 1}', f"application/json; charset={charset}")
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_utf8_is_400(router):
    r = post_raw(router, b'{"prompt": "caf\xe9", "max_tokens": 1}')
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"], r.text


def test_a_body_that_cannot_be_decompressed_is_400(router):
    r = post_raw(router, b"not gzip at all", **{"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "content-encoding: gzip" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field,literal", [
    ("temperature", b"1e999"), ("top_p", b"-1e999"), ("presence_penalty", b"NaN"),
    ("repetition_penalty", b"Infinity"), ("min_p", b"1" + b"0" * 400), ("frequency_penalty", b"1" + b"0" * 30),
])
def test_a_number_out_of_a_float_field_range_is_400_naming_the_field(router, field, literal):
    r = post_raw(router, b'{"prompt": "Hi", "max_tokens": 1, "' + field.encode() + b'": ' + literal + b"}")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "integer" not in error["message"], error


def test_oversized_body_is_413(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": "x" * (9 * 2**20)})
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(router, model):
    for key in (None, "wrong"):
        r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT}, key=key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_request_id_is_echoed(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2},
             headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"


def test_tokenize_then_detokenize_round_trips(router):
    tokens = post(router, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 5
    assert post(router, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT


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


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 2**31), ("n", 2**40), ("priority", -2**40), ("seed", 2**64),
    ("stop_token_ids", [2**40]), ("prompt", [2**70]), ("prompt", ["Hi", [5, 2**40]]),
])
def test_integer_too_large_for_its_field_is_400_naming_it(router, model, field, value):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2} | {field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field) and "out of range" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "Hi \\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
])
def test_lone_surrogate_in_text_is_400(router, path, body):
    r = httpx.post(f"{router.url}{path}", content=body,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content"),
    ({"role": "wizard", "content": "hi"}, "messages[0].role"),
    ({"role": "user"}, "messages[0].content"),
])
def test_malformed_chat_message_is_400_naming_it(router, model, message, param):
    r = post(router, "/v1/chat/completions", {"model": model, "messages": [message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_unsupported_openai_feature_is_refused_not_ignored(router, model, extra, param):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | extra
    r = post(router, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_error_object_has_openai_types_and_string_or_null_code(router, model):
    error = post(router, "/v1/completions", {"model": "gpt-17", "prompt": PROMPT}).json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    error = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "n": 0}).json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None


def test_admission_size_error_names_no_bogus_param(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 200, "n": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


def test_chat_errors_name_the_fields_the_client_sent(router, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    r = post(router, "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": 21})
    assert r.json()["error"]["param"] == "top_logprobs", r.text
    r = post(router, "/v1/chat/completions", body | {"max_completion_tokens": 0})
    assert r.json()["error"]["param"] == "max_completion_tokens", r.text


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


def test_an_error_about_one_prompt_of_a_batch_names_it(router, model):
    r = post(router, "/v1/completions", {"model": model, "prompt": ["Hi", "x " * 9000], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text


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


def test_deeply_nested_json_is_400(router):
    r = httpx.post(f"{router.url}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


def test_malformed_http_is_a_400_without_an_error_in_the_log(router):
    import socket
    with socket.create_connection(("127.0.0.1", router.http_port)) as raw:
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01b\r\n\r\n")
        assert raw.recv(100).split(b" ")[1] == b"400"
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert "malformed HTTP request refused" in router.log() and "ERROR aiohttp" not in router.log()
