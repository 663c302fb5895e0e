"""`esft serve-reward` as users run it: a real server process on loopback, real HTTP clients (httpx,
esft.rewards.remote_reward, an ES run), a tiny reward model built from a config."""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tiny_model import subprocess_env
from test_cli import esft, read_jsonl
from esft.rewards.models import RewardModel
from esft.rewards.remote import RewardServiceError, remote_reward
from esft.rewards.runner import RewardRunner

KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["2 + 2 =", [{"role": "user", "content": "Name a colour."}], "x", "A longer prompt than the others:"]
COMPLETIONS = [" 4", [{"role": "assistant", "content": "Blue."}], "yz", " and a longer completion too"]


def start_server(model_dir: Path, *flags: str, port: int = 0, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m esft.cli serve-reward --model DIR ...`; returns the process and its URL once /health answers."""
    env = {**subprocess_env(), "ESFT_TEST_KEY": KEY, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "esft.cli", "serve-reward", "--model", str(model_dir), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # "esft serve-reward: DIR (dtype float32, device cpu) on http://127.0.0.1:PORT"
    assert " on http://127.0.0.1:" in line, f"server did not start: {line}{proc.stderr.read() if proc.poll() is not None else ''}"
    url = line.rsplit(" on ", 1)[1].strip()
    health = httpx.get(f"{url}/health", headers=AUTH, timeout=30)
    assert health.status_code == 200, health.text
    return proc, url


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM, then the exit status and stderr (a server that ignores SIGTERM fails the test)."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the server did not stop within 15 s of SIGTERM") from None
    return proc.returncode, stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()


@pytest.fixture(scope="module")
def server(tiny_reward_model_dir):
    """One server for the module: batches of 16, a key, small limits (4 KiB bodies, 64 completions)."""
    proc, url = start_server(tiny_reward_model_dir, "--batch-size", "16", "--api-key-env", "ESFT_TEST_KEY",
                             "--max-body-mb", str(4 / 1024), "--max-request-items", "64")
    yield url
    code, stderr = stop(proc)
    assert code == 0 and "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def in_process(tiny_reward_model_dir):
    """The served model in this process, on the device the server chose (--device auto: CUDA where there is one)."""
    return RewardModel(str(tiny_reward_model_dir))


def test_http_scores_equal_in_process_scores(server, in_process):
    expected = in_process(PROMPTS, COMPLETIONS)
    remote = remote_reward(server, api_key=KEY, batch_size=3)  # two requests for four completions
    assert remote(PROMPTS, COMPLETIONS) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert remote.__name__ == f"remote:{server.removeprefix('http://')}" and remote.stats["requests"] == 2
    # OpenRLHF's /get_reward scores each query (the full text) as it is
    answer = httpx.post(f"{server}/get_reward", headers=AUTH, json={"query": ["2 + 2 = 4", "xyz"], "prompts": ["2 + 2 =", "x"],
                                                                    "labels": ["4", ""]}).json()
    assert answer["rewards"] == pytest.approx([expected[0], expected[2]], rel=1e-5, abs=1e-5)
    info = health(server)
    assert {k: info[k] for k in ("status", "dtype", "device", "batch_size")} == {"status": "ok", "dtype": "float32", "device": in_process.info()["device"], "batch_size": 16}
    assert info["model"] == in_process.model_id


def test_several_urls_are_load_balanced_and_a_dead_one_goes_last(server, in_process):
    dead = f"http://127.0.0.1:{free_port()}"
    remote = remote_reward([dead, server], api_key=KEY, retries=0)
    for _ in range(4):
        assert remote(["a"], ["b"]) == pytest.approx(in_process(["a"], ["b"]), rel=1e-5, abs=1e-5)
    # the first call tried the dead URL, then the live one; later calls go to the live one first
    assert remote.stats["requests"] == 4 + 1 and remote.stats["retries"] == 1 and remote.stats["failed_calls"] == 0
    remote.close()


def test_a_service_that_never_answers_times_out_and_is_retried():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (backlog), never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        remote = remote_reward(url, timeout=0.3, retries=1, backoff=0.1)
        started = time.monotonic()
        with pytest.raises(RewardServiceError, match=r"did not answer in 2 attempts .*/score: no answer \(ReadTimeout"):
            remote(["a"], ["b"])
        assert 0.6 <= time.monotonic() - started < 5 and remote.stats["requests"] == 2
        with pytest.raises(RewardServiceError, match="not retried for 10s"):  # the cooldown: fails at once
            remote(["a"], ["b"])
        assert remote.stats["requests"] == 2 and remote.stats["fast_failures"] == 1


def test_concurrent_clients_are_each_answered_once_and_share_batches(server, in_process):
    texts = [f"prompt {i} " + "x" * (i % 7) for i in range(24)]
    expected = dict(zip(texts, in_process(texts, [""] * len(texts))))
    before = health(server)
    requests = [[texts[(i + j) % len(texts)] for j in range(1 + i % 3)] for i in range(72)]  # 72 requests of 1-3 texts

    def client(batch: list[list[str]]) -> list[tuple[list[str], list[float]]]:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            return [(texts_, http.post(f"{server}/score", json={"prompts": texts_, "completions": [""] * len(texts_)}).json()["rewards"])
                    for texts_ in batch]

    with ThreadPoolExecutor(8) as pool:  # 8 clients, 9 requests each, all at once
        answers = [answer for part in pool.map(client, [requests[i::8] for i in range(8)]) for answer in part]
    assert len(answers) == len(requests)
    for texts_, rewards in answers:
        assert rewards == pytest.approx([expected[t] for t in texts_], rel=1e-5, abs=1e-5)
    after = health(server)
    assert after["requests_served"] - before["requests_served"] == len(requests)  # each answered exactly once
    assert after["completions_scored"] - before["completions_scored"] == sum(len(r) for r in requests)
    assert after["max_batch_requests"] > 1 and after["batches"] - before["batches"] < len(requests)  # coalesced
    assert after["max_batch_completions"] <= 16


@pytest.mark.parametrize("name, request_kwargs, status, detail", [
    ("not JSON", dict(content=b'{"prompts": ["a", ', headers={"Content-Type": "application/json"}), 400, "not valid JSON"),
    ("not an object", dict(json=[1, 2]), 422, "body: Input should be a valid dictionary"),
    ("wrong type", dict(json={"prompts": ["a"], "completions": [3]}), 422, "completions.0"),
    ("missing field", dict(json={"prompts": ["a"]}), 422, "completions: Field required"),
    ("wrong lengths", dict(json={"prompts": ["a", "b"], "completions": ["c"]}), 422, "2 prompt(s) for 1 completion(s)"),
    ("bad message", dict(json={"prompts": [[{"role": "user"}]], "completions": ["c"]}), 422, "content: Field required"),
    ("too many", dict(json={"prompts": ["a"] * 65, "completions": ["b"] * 65}), 413, "65 completions in one request, over the limit of 64"),
    ("oversize", dict(json={"prompts": ["a" * 5000], "completions": ["b"]}), 413, "over the limit of 4096 bytes"),
    ("oversize, streamed", dict(content=iter([b'{"prompts": ["', b"a" * 5000, b'"], "completions": ["b"]}']),
                                headers={"Content-Type": "application/json"}), 413, "over the limit of 4096 bytes"),
    ("form data", dict(data={"prompts": "a"}), 415, "Content-Type: application/json"),
    ("no token", dict(json={"prompts": ["a"], "completions": ["b"]}, headers={}), 401, "missing or wrong API key"),
    ("wrong token", dict(json={"prompts": ["a"], "completions": ["b"]}, headers={"Authorization": "Bearer nope"}), 401, "API key"),
])
def test_malformed_requests_get_a_4xx_with_a_one_line_message(server, name, request_kwargs, status, detail):
    request_kwargs = dict(request_kwargs)
    headers = {**AUTH, **request_kwargs.pop("headers", {})} if "token" not in name else request_kwargs.pop("headers")
    response = httpx.post(f"{server}/score", headers=headers, timeout=30, **request_kwargs)
    assert response.status_code == status, response.text
    assert detail in response.json()["detail"] and "\n" not in response.json()["detail"]
    assert "Traceback" not in response.text
    assert httpx.get(f"{server}/health", headers=headers if "token" in name else AUTH).status_code == (401 if "token" in name else 200)


def test_a_failing_forward_pass_is_a_500_with_a_message_and_the_server_goes_on(tmp_path):
    """A real broken model (its embedding has 100 rows; the tokenizer has 258 tokens: a space is
    token 100+), served by the real app through starlette's in-process client."""
    from fastapi.testclient import TestClient

    from esft.rewards.serve import create_app
    from tiny_model import build_tiny_reward_model

    broken = RewardModel(str(build_tiny_reward_model(tmp_path)))
    broken.load()
    broken.model.resize_token_embeddings(100)
    with TestClient(create_app(broken, batch_size=4), raise_server_exceptions=False) as client:
        ok = {"prompts": ["ab"], "completions": ["c!"]}  # printable ASCII: tokens below 100
        assert client.post("/score", json=ok).status_code == 200
        failing = client.post("/score", json={"prompts": ["a b"], "completions": ["c"]})
        assert failing.status_code == 500 and failing.json()["detail"].startswith(
            "internal error: IndexError: token id 222 is past the model's 100 embedding rows")  # checked before the lookup
        assert "Traceback" not in failing.text and "\n" not in failing.json()["detail"]
        assert client.post("/score", json=ok).status_code == 200 and client.get("/health").json()["requests_served"] == 2


def test_an_es_run_on_the_embedded_model_scored_by_the_service(server, in_process, tmp_path):
    prompts = ["2 + 2 =", "3 + 5 =", "7 - 4 =", "9 - 1 =", "1 + 8 ="]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    before = health(server)["requests_served"]
    os.environ["ESFT_REWARD_API_KEY"] = KEY  # the client's key, inherited by the run
    try:
        proc, _ = esft("train", "--reward-url", server, "--train-data", "train.jsonl", "--eval-data", "train.jsonl", "--iterations", "2",
                       "--population-size", "2", "--batch-size", "2", "--max-tokens", "6", "--no-progress", "--logging", "none",
                       "--run-name", "run", cwd=tmp_path)
    finally:
        del os.environ["ESFT_REWARD_API_KEY"]
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "runs/run/metrics.jsonl")
    name = f"rewards/remote:{server.removeprefix('http://')}/mean"
    assert all(row["reward/errors"] == 0 and name in row for row in rows[1:])
    samples = read_jsonl(tmp_path / "runs/run/eval/iteration-2/train.jsonl")
    rewards = [s["reward"] for s in samples]
    assert len(set(rewards)) > 1  # a real signal, not a constant
    assert rewards == pytest.approx(in_process([s["prompt"] for s in samples], [s["completion"] for s in samples]), rel=1e-5, abs=1e-5)
    assert rows[-1]["eval/train/reward"] == pytest.approx(sum(rewards) / len(rewards))
    # 2 evaluations + 2 iterations x 2 members, one request each: the run was scored by this server
    assert health(server)["requests_served"] - before == 2 + 2 * 2


def test_a_killed_server_costs_failures_a_restarted_one_is_picked_up_a_full_one_is_retried(tiny_reward_model_dir, in_process):
    port = free_port()
    proc, url = start_server(tiny_reward_model_dir, port=port)
    rows = [{"prompt": p} for p in ("a", "bb", "ccc")]
    remote = remote_reward(url, retries=2, backoff=0.1, cooldown=60)
    runner = RewardRunner([remote], failure_reward=-7.0)
    assert runner.score(rows, ["1", "2", "3"]).errors == 0
    proc.kill()  # mid-run: the next batch finds nobody
    proc.wait()
    scores = runner.score(rows, ["1", "2", "3"])
    assert (scores.errors, scores.failures, scores.total) == (3, 3, [-7.0] * 3)  # counted, failure reward
    # the batch call tried 3 times (retries=2); the runner's sample-by-sample retries failed at once
    assert remote.stats["requests"] == 1 + 3 and remote.stats["failed_calls"] == 1 and remote.stats["fast_failures"] == 3
    with pytest.raises(RewardServiceError, match=rf"could not reach the reward service in 3 attempts .*{port}/score: cannot connect \(ConnectError"):
        remote_reward(url, retries=2, backoff=0.1)(["a"], ["b"])

    patient = remote_reward(url, retries=40, backoff=0.25, max_backoff=0.5)  # up to ~20 s of retries
    result = {}
    caller = threading.Thread(target=lambda: result.update(rewards=patient(["a", "bb"], ["1", "2"])))
    caller.start()
    time.sleep(0.5)  # the call is retrying against a closed port ...
    # ... until the server is back (this one queues at most one request: see below)
    restarted, _ = start_server(tiny_reward_model_dir, "--max-queue", "1", "--batch-size", "1", port=port)
    caller.join(timeout=60)
    assert result["rewards"] == pytest.approx(in_process(["a", "bb"], ["1", "2"]), rel=1e-5, abs=1e-5)
    assert patient.stats["retries"] >= 1

    # a full queue answers 503 (Retry-After), and the client retries those
    texts = [f"{i} " + "long text " * 100 for i in range(24)]
    with ThreadPoolExecutor(24) as pool:
        raw = list(pool.map(lambda t: httpx.post(f"{url}/score", json={"prompts": [t], "completions": [""]}, timeout=60), texts))
    busy = [r for r in raw if r.status_code == 503]
    assert busy and all(r.status_code == 200 for r in raw if r not in busy)
    assert all("queue full" in r.json()["detail"] and r.headers["Retry-After"] == "1" for r in busy)
    assert health(url)["rejected_queue_full"] == len(busy)
    retrying = remote_reward(url, batch_size=1, concurrency=12, retries=20, backoff=0.05, max_backoff=0.2)
    assert retrying(texts, [""] * 24) == pytest.approx(in_process(texts, [""] * 24), rel=1e-5, abs=1e-5)
    for client in (remote, patient, retrying):
        client.close()
    code, stderr = stop(restarted)
    assert code == 0 and "esft serve-reward: stopped" in stderr and "Traceback" not in stderr


def test_bad_server_settings_are_one_line_errors(tiny_reward_model_dir, tmp_path):
    from test_cli import assert_user_error, esft_process as esft  # processes: a server that started would keep serving

    proc, _ = esft("serve-reward", "--model", str(tiny_reward_model_dir), "--api-key-env", "ESFT_NO_SUCH_VARIABLE", cwd=tmp_path)
    assert_user_error(proc, "--api-key-env: the environment variable ESFT_NO_SUCH_VARIABLE is not set")
    proc, _ = esft("serve-reward", "--model", str(tiny_reward_model_dir), "--max-request-seconds", "0", cwd=tmp_path)
    assert_user_error(proc, "--max-request-seconds: must be > 0, got 0.0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, _ = esft("serve-reward", "--model", str(tiny_reward_model_dir), "--port", str(port), cwd=tmp_path)
    assert_user_error(proc, f"--port: cannot listen on 127.0.0.1:{port} (Address already in use)")


LARGE = 8000
"""Completions in the large request (the server's --max-request-items raised to it): 500 forward passes of 16, which
must outlast --max-request-seconds 4 on any machine (2,000 took 3.4 s on a 2-core EPYC VM on 2026-12-07, under the
bound, and the test failed there)."""


def test_a_large_request_does_not_starve_small_ones_and_a_gone_client_s_work_is_dropped(tiny_reward_model_dir, in_process):
    """Issue 52: a large request (LARGE completions of 300 characters: 500 forward passes) is scored a
    forward pass at a time, in turn with the others: 1-item requests made meanwhile are answered in a
    pass or two; a client that gives up (or sends and closes at once) leaves nothing scored after it;
    --max-request-seconds answers 503."""
    proc, url = start_server(tiny_reward_model_dir, "--batch-size", "16", "--max-request-seconds", "4",
                             "--max-request-items", str(LARGE))
    large = {"prompts": [f"{i} " + "long text " * 30 for i in range(LARGE)], "completions": [""] * LARGE}

    # a client that gives up after 2 s: its remaining completions are dropped, the model goes idle
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/score", json=large, timeout=2.0)
    deadline = time.monotonic() + 10
    while health(url)["requests_abandoned"] == 0:
        assert time.monotonic() < deadline, "the abandoned request was not dropped"
        time.sleep(0.1)
    first = health(url)
    while True:  # until a second passes without a forward pass (the one running at the drop ends)
        time.sleep(1.0)
        idle = health(url)
        if idle["batches"] == first["batches"]:
            break
        first = idle
        assert time.monotonic() < deadline + 10, "the model is still scoring the abandoned request"
    assert idle["requests_active"] == 0 and 0 < idle["batches"] * 16 < LARGE  # nothing scored after the drop
    assert idle["completions_dropped"] == LARGE - idle["batches"] * 16 and idle["completions_scored"] == 0

    # two clients that send a large request and close the connection at once (the probe's 99 s
    # case): the next request waits for at most the forward pass running, not for both
    body = json.dumps(large).encode()
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as gone:
            gone.sendall(head.encode() + body)
    time.sleep(0.5)
    started = time.monotonic()
    assert httpx.post(f"{url}/score", json={"prompts": ["after"], "completions": ["!"]}, timeout=30).status_code == 200
    assert time.monotonic() - started < 2.5
    deadline = time.monotonic() + 10
    while health(url)["requests_abandoned"] < 3:
        assert time.monotonic() < deadline, health(url)
        time.sleep(0.1)
    dropped = health(url)["completions_dropped"] - idle["completions_dropped"]
    assert 2 * LARGE - 2 * 16 * 4 <= dropped <= 2 * LARGE  # a few passes at most before each drop was noticed

    # small requests beside a large one: each waits a forward pass or two, not the large request
    answer = {}

    def post_large():
        started = time.monotonic()
        answer["response"] = httpx.post(f"{url}/score", json=large, timeout=60)
        answer["seconds"] = time.monotonic() - started

    big = threading.Thread(target=post_large)
    big.start()
    time.sleep(0.5)
    latencies = []
    with httpx.Client(timeout=30) as http:
        for i in range(8):
            started = time.monotonic()
            rewards = http.post(f"{url}/score", json={"prompts": [f"small {i}"], "completions": ["!"]}).json()["rewards"]
            latencies.append(time.monotonic() - started)
            assert rewards == pytest.approx(in_process([f"small {i}"], ["!"]), rel=1e-5, abs=1e-5)
    big.join(timeout=30)
    # the large one took the whole bound and was refused: 503 naming the setting and what was scored
    response = answer["response"]
    assert response.status_code == 503 and response.headers["Retry-After"] == "1", response.text
    assert re.fullmatch(rf"scoring took over 4 s \(--max-request-seconds; \d+ of {LARGE} completions scored\); send fewer "
                        r"completions per request, or retry later", response.json()["detail"])
    assert 4 <= answer["seconds"] < 10
    # a small request waits a forward pass or two (0.03 to 0.2 s on the machines seen), not the large request
    assert max(latencies) < 2.5 and sorted(latencies)[4] < 1.0, latencies
    after = health(url)
    assert after["requests_timed_out"] == 1 and after["requests_served"] == 9 and after["requests_active"] == 0
    code, stderr = stop(proc)
    assert code == 0 and "Traceback" not in stderr, stderr


def test_every_request_gets_a_share_of_every_forward_pass(in_process):
    """The scheduler on the real model: one request of 200 completions, then 40 of one completion,
    batches of 16. Each pass gives every request a share (at least one completion, in turn): the
    small ones are answered within the first passes, and the large one is scored in every pass,
    not starved by the stream; every reward is the in-process one."""
    import asyncio

    from esft.rewards.serve_schedule import Scheduler

    large = [f"{i} " + "text " * (i % 9) for i in range(200)]
    small = [f"small {i}" for i in range(40)]
    expected = dict(zip(large + small, in_process(large + small, [""] * 240)))

    async def main():
        scheduler = Scheduler(in_process, batch_size=16, max_queue=64, max_seconds=60)
        runner = asyncio.create_task(scheduler.run())
        never = asyncio.get_running_loop().create_future()  # these clients stay
        finished = {}

        async def client(name, texts):
            rewards = await scheduler.score(texts, never)
            finished[name] = (scheduler.stats.batches, rewards)

        clients = [asyncio.create_task(client("large", large))]
        await asyncio.sleep(0)  # the large one is first in the rotation
        clients += [asyncio.create_task(client(text, [text])) for text in small]
        await asyncio.gather(*clients)
        runner.cancel()
        scheduler.fail_waiting()
        return finished

    finished = asyncio.run(main())
    for name, (_, rewards) in finished.items():
        texts = large if name == "large" else [name]
        assert rewards == pytest.approx([expected[t] for t in texts], rel=1e-5, abs=1e-5)
    # pass 1: 16 of the large one (alone); 2: 1 of it + 15 small ones (a share of 1 each, in turn);
    # 3: 16 small ones (the large one is left out and goes first next); 4: 1 + the last 9 + 6
    last_small = max(batches for name, (batches, _) in finished.items() if name != "large")
    assert last_small <= 4
    # 240 completions in passes of 16: every pass full, none wasted on the large one waiting
    assert finished["large"][0] == 15
