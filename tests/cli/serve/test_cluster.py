"""`ggrun serve --replicas` on a local Ray cluster (ray.init(num_cpus=2), two engine replicas of the synthetic
tiny llama under --numerics f32, one core each): concurrent requests through the one ingress are answered by
both replicas with the text one request gets alone, streamed and whole, behind the same key check; a client
that leaves a stream frees its slot on the replica at once; killing a
replica's actor while requests run on it loses none of them (the ingress sends them again to the other
replica), and Ray Serve brings the killed one back. Skipped without the extra ggrun[cluster]."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

from ggrun.cli.serve.cluster import REPLICA_HEADER, _load_error, replica_options, start  # noqa: E402
from ggrun.cli.serve.settings import ServeSettings  # noqa: E402

from .conftest import KEY, free_port, httpx  # noqa: E402

APP = "ggrun-test"
PROMPT = "The quick brown fox"
HEADERS = {"Authorization": f"Bearer {KEY}"}
LONG = 900  # tokens: the requests still run when a replica is killed


@pytest.fixture(scope="module")
def cluster(tiny_llama_path):
    """The ingress's URL: a local Ray of 2 CPUs running two engine replicas of one core each."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    s = ServeSettings(model=str(tiny_llama_path), port=free_port(), n_ctx=16384, n_parallel=4, threads=1,
                      numerics="f32", api_key=KEY, chat_template="chatml", replicas=2, max_replicas=2)
    try:
        start(s, APP)
        yield f"http://127.0.0.1:{s.port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, n_predict: int) -> tuple[int, str, str]:
    """(status, text, the replica that served it) of one native completion through the ingress."""
    with httpx.Client(base_url=url, headers=HEADERS, timeout=120, trust_env=False) as c:
        r = c.post("/completion", json={"prompt": PROMPT, "n_predict": n_predict, "ignore_eos": True, "temperature": 0})
    return r.status_code, r.json().get("content", r.text) if r.status_code == 200 else r.text, \
        r.headers.get(REPLICA_HEADER, "")


def concurrently(url: str, n: int, n_predict: int) -> list[tuple[int, str, str]]:
    """n completions at once, as `complete` returns them."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: complete(url, n_predict), range(n)))


def replica_names() -> set[str]:
    """The names (replica ids) of the engine replicas' live actors."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"].rsplit("#", 1)[-1] for a in actors if "#ggrun-engine#" in a["name"]}


def test_two_replicas_answer_concurrent_requests_streamed_and_whole(cluster):
    alone = complete(cluster, 16)
    assert alone[0] == 200
    results = concurrently(cluster, 8, 16)
    assert [(status, text) for status, text, _ in results] == [(200, alone[1])] * 8
    assert len({replica for _, _, replica in results}) == 2, results  # both replicas served

    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=msgs, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert len(parts) > 2 and "".join(parts) == whole.choices[0].message.content

    with httpx.Client(base_url=cluster, timeout=30, trust_env=False) as c:  # the same app: its key check
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200


def test_a_client_that_leaves_a_stream_frees_its_slot_on_the_replica(cluster):
    body = {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True, "temperature": 0, "stream": True}  # 4k tokens
    with httpx.Client(base_url=cluster, headers=HEADERS, timeout=60, trust_env=False) as c:
        with c.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200
            replica = r.headers[REPLICA_HEADER]
            next(r.iter_lines())  # generating; then the client goes away
        deadline = time.monotonic() + 3  # well before the slot's 4096 tokens would have ended it
        while time.monotonic() < deadline:  # /slots of that replica (either may answer) shows every slot free
            r = c.get("/slots")
            if r.headers[REPLICA_HEADER] == replica and not any(slot["is_processing"] for slot in r.json()):
                return
            time.sleep(0.1)
    raise AssertionError("the stream's slot was not freed")


def busy_replica(url: str) -> str:
    """A replica that /slots (answered by either) shows generating."""
    with httpx.Client(base_url=url, headers=HEADERS, timeout=30, trust_env=False) as c:
        for _ in range(200):
            r = c.get("/slots")
            if any(slot["n_decoded"] > 0 for slot in r.json()):
                return r.headers[REPLICA_HEADER]
    raise AssertionError("no replica was seen generating")


def test_killing_a_replica_loses_no_request(cluster):
    before = replica_names()
    assert len(before) == 2
    _, expected, _ = complete(cluster, LONG)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, cluster, LONG) for _ in range(8)]
        victim = busy_replica(cluster)
        ray.kill(ray.get_actor(next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                                    if a["name"].endswith("#" + victim)), namespace="serve"), no_restart=True)
        results = [f.result() for f in futures]
    assert [(status, text) for status, text, _ in results] == [(200, expected)] * 8
    assert victim not in {replica for _, _, replica in results}  # its requests were answered by another

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray Serve replaces the killed replica
        now = replica_names()
        if len(now) == 2 and victim not in now and \
                serve.status().applications[APP].deployments["ggrun-engine"].replica_states.get("RUNNING") == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the killed replica was not replaced: {replica_names()}")
    results = concurrently(cluster, 8, 16)
    assert all(status == 200 for status, _, _ in results)
    assert {replica for _, _, replica in results} == now


def test_replica_options_ask_for_a_gpu_or_cores_and_autoscale_between_the_bounds():
    cpu = replica_options(ServeSettings(threads=4, n_parallel=8, max_queue=16, replicas=2, max_replicas=2))
    assert cpu["ray_actor_options"] == {"num_cpus": 4} and cpu["num_replicas"] == 2
    assert cpu["max_ongoing_requests"] == 24 and "autoscaling_config" not in cpu
    gpu = replica_options(ServeSettings(n_gpu_layers=99, n_parallel=8, replicas=1, max_replicas=4))
    assert gpu["ray_actor_options"] == {"num_gpus": 1, "num_cpus": 1} and "num_replicas" not in gpu
    assert gpu["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 4,
                                         "target_ongoing_requests": 8}


def test_a_replica_load_error_is_read_from_ray_serves_account():
    message = ("The deployment failed to start 2 times in a row.\nTraceback (most recent call last):\n"
               "  File \"cluster.py\", line 74, in __init__\n"
               "ggrun.cli.serve.cluster.ReplicaLoadError: bad input: m.gguf: no such file\n")
    assert _load_error(message) == "bad input: m.gguf: no such file"
    assert _load_error("Failed to update the deployments") == ""
