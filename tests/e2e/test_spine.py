"""The spine end to end on real vLLM CPU engines: multi-turn reuse through the router, proven from
engine metrics, with answers identical to reuse off."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from tests.e2e.client import chat, metric, pulled_tokens, words

pytestmark = pytest.mark.engines

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_four_turns_reuse_the_previous_turns_kv(stack, stream):
    router, model_dir = stack["router"], stack["model_dir"]
    conv = f"spine-{stream}"
    messages = [{"role": "system", "content": words(model_dir, 200, 1)},
                {"role": "user", "content": words(model_dir, 500, 2 + stream)}]
    previous_total = None  # prompt + generated tokens decode held after the previous turn
    for turn in range(4):
        before = pulled_tokens(stack)
        bytes_before = metric(stack["prefill-0"], "vllm:nixl_bytes_transferred_sum")
        on = chat(router, messages, conversation=conv, stream=stream)
        pulled = pulled_tokens(stack) - before
        off = chat(router, messages, conversation=conv + "-off", stream=stream, reuse=False)
        assert on.status == off.status == 200
        assert on.token_ids and on.token_ids == off.token_ids, f"turn {turn + 1}: reuse changed the answer"
        assert on.text == off.text
        assert off.reused == 0 and off.outcome == "disabled"
        if turn == 0:
            assert on.outcome == "none" and on.reused == 0 and pulled == 0
        else:
            # Everything decode held is pulled back except the last generated token (whose KV was never computed).
            assert on.outcome == "hit"
            assert on.reused == previous_total - 1, (on.reused, previous_total)
            assert pulled == on.reused
            assert metric(stack["prefill-0"], "vllm:nixl_bytes_transferred_sum") > bytes_before
        prompt_tokens = len(requests.post(f"{stack['prefill-0']}/tokenize", json={
            "model": "tiny", "messages": messages, "add_generation_prompt": True}, timeout=30).json()["tokens"])
        previous_total = prompt_tokens + len(on.token_ids)
        if stream:
            assert all("kv_transfer_params" not in e for e in on.events)
        else:
            assert "kv_transfer_params" not in on.body
        messages = [*messages, {"role": "assistant", "content": on.text},
                    {"role": "user", "content": words(model_dir, 150, 10 + turn)}]


def test_edited_history_is_never_reused(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 400, 20)}]
    first = chat(router, messages, conversation="edited")
    edited = [{"role": "user", "content": words(model_dir, 400, 21)},  # the first message was rewritten
              {"role": "assistant", "content": first.text}, {"role": "user", "content": words(model_dir, 100, 22)}]
    before = pulled_tokens(stack)
    on = chat(router, edited, conversation="edited")
    assert on.status == 200 and on.outcome == "miss" and on.reused == 0  # another content address
    assert pulled_tokens(stack) == before
    assert on.token_ids == chat(router, edited, reuse=False).token_ids
    # The edited turn's own KV is stored in its place: continuing the edited conversation reuses it.
    again = chat(router, [*edited, {"role": "assistant", "content": on.text}, {"role": "user", "content": "next"}],
                 conversation="edited")
    assert again.outcome == "hit" and again.reused > 500


def test_completions_prompt_extension_is_reused(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    prompt = words(model_dir, 600, 30)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "conversation_id": "cmpl"}
    first = requests.post(f"{router}/v1/completions", json=body, timeout=120)
    assert first.status_code == 200 and "kv_transfer_params" not in first.json()
    body["prompt"] = prompt + first.json()["choices"][0]["text"] + " " + words(model_dir, 100, 31)
    second = requests.post(f"{router}/v1/completions", json=body, timeout=120)
    assert second.status_code == 200 and second.headers["X-TurnKV-Reuse-Outcome"] == "hit"
    assert int(second.headers["X-TurnKV-Reused-Tokens"]) > 500


def test_forged_client_kv_params_are_dropped(stack):
    router = stack["router"]
    forged = {"do_remote_prefill": True, "remote_engine_id": "decode-0", "remote_block_ids": [[1, 2, 3]],
              "remote_host": "10.9.9.9", "remote_port": 1, "remote_num_tokens": 4000}
    for stream in (False, True):
        reply = chat(router, [{"role": "user", "content": "hello you"}], stream=stream, kv_transfer_params=forged)
        assert reply.status == 200 and reply.reused == 0 and reply.text
        assert "kv_transfer_params" not in str(reply.body or reply.events)


@pytest.mark.parametrize("path, data, status, message", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", b'[1, 2]', 400, "must be a JSON object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "conversation_id": 5}', 400,
     "'conversation_id' must be a non-empty string"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "'prompt' is required"),
    ("/v1/chat/completions", b"", 400, "body is empty"),
])
def test_bad_requests_get_a_400_with_a_message(stack, path, data, status, message):
    resp = requests.post(stack["router"] + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status
    assert message in resp.json()["error"]["message"]


def test_oversized_body_is_refused(stack):
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 * 1024 * 1024) + b'"}]}'
    resp = requests.post(stack["router"] + "/v1/chat/completions", data=body, timeout=60)
    assert resp.status_code == 413 and "max_body_bytes" in resp.json()["error"]["message"]


def test_engine_errors_are_passed_on_as_4xx(stack):
    # vLLM refuses a prompt longer than max_model_len; the client gets the engine's 400, not a 500.
    long = [{"role": "user", "content": words(stack["model_dir"], 9000, 40)}]
    reply = chat(stack["router"], long)
    assert reply.status == 400 and "error" in reply.body


def test_health_models_metrics_and_cli(stack):
    router = stack["router"]
    health = requests.get(router + "/health", timeout=10).json()
    assert health["status"] == "ok" and {e["role"] for e in health["engines"]} == {"prefill", "decode"}
    assert requests.get(router + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    metrics = requests.get(router + "/metrics", timeout=10).text
    assert "turnkv_router_time_to_first_token_seconds_bucket" in metrics
    status = subprocess.run([sys.executable, "-m", "turnkv.cli", "local", "status", "--state-dir",
                             str(stack["state_dir"])], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "healthy" in status.stdout and "decode-0" in status.stdout
    logs = subprocess.run([sys.executable, "-m", "turnkv.cli", "local", "logs", "router", "-n", "5",
                           "--state-dir", str(stack["state_dir"])], capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0 and "router.log" in logs.stdout
