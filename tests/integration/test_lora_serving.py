"""Multi-LoRA through the shared cluster (docs/lora.md): adapters made offline with PEFT are loaded at run time over
the HTTP API (POST /v1/load_lora_adapter, on every engine), requests of two adapters and of the base model in one
burst each give HF + PEFT fp32's greedy tokens (over HTTP's model field and gRPC's lora_name; a short prompt the
decode computes, a long one through the prefill and the KV transfer), and again once their prompts are cached (a
hit crossing adapters would change them); /v1/models lists the adapters with their parent; unknown adapters are a
404 / NOT_FOUND naming them; the load and unload endpoints' refusals are 400s naming the field (404 for an unknown
name); an unloaded adapter is gone. Every adapter is unloaded at the end: the cluster is shared."""
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import pytest
import redis

from tandem.services.client import generate, make_request
from tandem.shared.cluster_state.registry import KEY_PREFIX
from tandem.v1 import common_pb2, common_pb2_grpc
from tests.integration.helpers import metric_samples
from tests.integration.lora_helpers import PeftReference, make_adapters
from tests.prompts import LONG_TEXT, prompt_token_ids

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
CAPITAL = "What is the capital of France?"  # (a chat turn of 37 tokens: the decode computes it)


@pytest.fixture(scope="module")
def adapters(cluster, model_dir, tmp_path_factory):
    """{name: directory} of the adapters, loaded on the cluster for this module and unloaded after it."""
    paths = make_adapters(model_dir, tmp_path_factory.mktemp("lora"))
    for name, path in paths.items():
        r = post(cluster, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' added successfully.", r.text
    yield paths
    for name in paths:
        post(cluster, "/unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def peft(model_dir, adapters):
    return PeftReference(model_dir, adapters)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    """{name: prompt ids}: a short chat turn, and 76 raw tokens (past --local-prefill-tokens: a prefill computes it
    and ships its KV to the decode)."""
    return {"capital": prompt_token_ids(tokenizer, "chat", CAPITAL),
            "printing": tokenizer(LONG_TEXT[:400], add_special_tokens=False).input_ids}


def post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.openai_base_url + path, json=body, timeout=300)


def complete(cluster, model: str | None, ids: list[int]) -> dict:
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0} | ({"model": model} if model else {})
    r = post(cluster, "/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_burst_mixing_adapters_and_the_base_gives_hf_peft_tokens(cluster, adapters, peft, prompts, tokenizer):
    names = [None, *adapters]
    jobs = [(name, prompt) for name in names for prompt in prompts]
    expected = {(name, p): peft.greedy(name, prompts[p], MAX_TOKENS) for name, p in jobs}
    assert len({tuple(v) for v in expected.values()}) == len(jobs)  # (the adapters change the answers)

    def http(job):
        name, prompt = job
        return complete(cluster, name or MODEL, prompts[prompt])

    def grpc_chat(name):  # (the capital prompt is a chat turn: the gateway's template gives the same ids)
        request = make_request(CAPITAL, max_tokens=MAX_TOKENS, temperature=0.0)
        request.lora_name = name
        return generate(cluster.gateway_address, request, timeout=300)

    for burst in ("cold", "cached"):  # (the second finds every prompt in the prefix caches: none may cross adapters)
        with ThreadPoolExecutor(len(jobs) + len(adapters)) as pool:  # (every request in flight at once)
            answers = [pool.submit(http, job) for job in jobs]
            over_grpc = [pool.submit(grpc_chat, name) for name in adapters]
            answers, over_grpc = [f.result() for f in answers], [f.result() for f in over_grpc]
        for job, body in zip(jobs, answers):
            choice = body["choices"][0]
            assert choice["text"] == tokenizer.decode(expected[job], skip_special_tokens=True), (burst, job)
            assert body["model"] == (job[0] or MODEL)
        for name, completion in zip(adapters, over_grpc):
            assert completion.token_ids == expected[(name, "capital")], (burst, name)
    cached = complete(cluster, "sql", prompts["printing"])["usage"]
    assert cached["prompt_tokens_details"]["cached_tokens"] >= 64, cached  # (an adapter's own prefix does hit)
    decisions = metric_samples(cluster.metrics_urls["gateway"], "tandem:router_lora_decisions_total")
    assert {dict(labels)["lora_name"] for labels in decisions} == set(adapters), decisions


def test_models_lists_the_adapters_with_their_parent(cluster, adapters):
    models = httpx.get(cluster.openai_base_url + "/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [MODEL, *sorted(adapters)]
    assert models[0]["parent"] is None
    for card in models[1:]:
        assert card["parent"] == MODEL and card["root"] == adapters[card["id"]] and card["object"] == "model"


def test_an_unknown_adapter_is_not_found_naming_it(cluster, adapters):
    for path, body in (("/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        r = post(cluster, path, body | {"model": "no-such-adapter"})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["param"] == "model" and "no-such-adapter" in error["message"]
    request = make_request("Hi", max_tokens=2)
    request.lora_name = "no-such-adapter"
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.gateway_address, request, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in e.value.details()


def test_load_and_unload_refuse_bad_input_by_field(cluster, adapters, tmp_path):
    refusals = [("/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
                ("/load_lora_adapter", {"lora_path": adapters["sql"]}, 400, "lora_name"),
                ("/load_lora_adapter", {"lora_name": "has space", "lora_path": adapters["sql"]}, 400, "lora_name"),
                ("/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]}, 400, "lora_name"),
                ("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, 400, "lora_path"),
                ("/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["sql"], "load_inplace": True}, 400,
                 "load_inplace"),
                ("/unload_lora_adapter", {}, 400, "lora_name"),
                ("/unload_lora_adapter", {"lora_name": "no-such-adapter"}, 404, "lora_name")]  # fmt: skip
    for path, body, status, param in refusals:
        r = post(cluster, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    assert "adapter_config.json" in post(cluster, *refusals[4][:2]).json()["error"]["message"]
    r = httpx.post(cluster.openai_base_url + "/load_lora_adapter", timeout=30,  # (a lone surrogate, JSON-escaped)
                   headers={"content-type": "application/json"},
                   content=b'{"lora_name": "x", "lora_path": "/adapters/a\\ud800b"}')
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), r.text
    assert "x" not in [m["id"] for m in httpx.get(cluster.openai_base_url + "/models", timeout=30).json()["data"]]


def test_an_unloaded_adapter_is_gone_and_can_be_loaded_again(cluster, adapters, prompts):
    ids = prompts["capital"]
    before = complete(cluster, "poet", ids)["choices"][0]["text"]
    r = post(cluster, "/unload_lora_adapter", {"lora_name": "poet"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'poet' removed successfully."
    assert post(cluster, "/completions", {"model": "poet", "prompt": ids, "max_tokens": 2}).status_code == 404
    assert "poet" not in [m["id"] for m in httpx.get(cluster.openai_base_url + "/models", timeout=30).json()["data"]]
    assert post(cluster, "/load_lora_adapter", {"lora_name": "poet", "lora_path": adapters["poet"]}).status_code == 200
    assert complete(cluster, "poet", ids)["choices"][0]["text"] == before


def test_the_base_models_names_choose_the_base_model_in_both_apis_and_no_adapter_takes_them(cluster, adapters):
    """gRPC's lora_name "" or the base model's served name is the base model, as HTTP's model is (and
    Client.generate takes lora_name); loading an adapter under the base model's name is refused."""
    from tandem.services.client import Client

    with Client(cluster.gateway_address) as client:
        base = client.generate("Hi", max_tokens=4, temperature=0.0).token_ids
        for name in ("", MODEL):
            assert client.generate("Hi", max_tokens=4, temperature=0.0, lora_name=name).token_ids == base, name
        assert client.generate("Hi", max_tokens=4, temperature=0.0, lora_name="sql").token_ids != base
    r = post(cluster, "/load_lora_adapter", {"lora_name": MODEL, "lora_path": adapters["sql"]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name") and MODEL in r.text, r.text
    models = httpx.get(cluster.openai_base_url + "/models", timeout=30).json()["data"]
    assert [m["id"] for m in models].count(MODEL) == 1


def test_embeddings_and_tokenization_refuse_an_adapter_by_name(cluster, adapters):
    base = cluster.openai_base_url.removesuffix("/v1")
    for url, body in ((cluster.openai_base_url + "/embeddings", {"input": "Hi"}),
                      (base + "/tokenize", {"prompt": "Hi"}), (base + "/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(url, json=body | {"model": "sql"}, timeout=60)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "model"), (url, r.text)
        assert "LoRA adapter" in r.json()["error"]["message"]
        assert httpx.post(url, json=body | {"model": "no-such-model"}, timeout=60).status_code == 404


def instance_call(address: str, method: str, message):
    with grpc.insecure_channel(address) as channel:
        return getattr(common_pb2_grpc.InstanceStub(channel), method)(message, timeout=60)


def wait_records(cluster, name: str, listed: set[str], timeout_s: float = 10) -> None:
    """Wait until the engines whose records list adapter name are those of cluster.addresses named in listed."""
    client, deadline = redis.Redis.from_url(cluster.redis_url), time.monotonic() + timeout_s
    try:
        while True:
            records = [json.loads(v) for k in client.keys(f"{KEY_PREFIX}:*") if (v := client.get(k))]
            now = {n for n, a in cluster.addresses.items() for r in records
                   if r["address"] == a and name in r.get("lora_adapters", {})}  # fmt: skip
            if now == listed:
                return
            assert time.monotonic() < deadline, (name, now, listed)
            time.sleep(0.2)
    finally:
        client.close()


def test_an_automatic_load_never_takes_files_changed_on_disk(cluster, adapters, prompts, tmp_path):
    """The cluster serves an adapter; one engine drops it (as an engine does when reading it again finds other files:
    --max-cpu-loras) and its files change on disk; the gateway's automatic load there, for the next request, passes
    the cluster's digest: the engine refuses the new files (nothing loaded), and the request fails saying so, rather
    than the tiers serving two versions."""
    path = tmp_path / "moving"
    shutil.copytree(adapters["sql"], path)
    request = common_pb2.LoadLoRAAdapterRequest(lora_name="moving", lora_path=str(path))
    try:
        digests = {instance_call(a, "LoadLoRAAdapter", request).adapter.digest for a in cluster.addresses.values()}
        instance_call(cluster.addresses["decode0"], "UnloadLoRAAdapter",
                      common_pb2.UnloadLoRAAdapterRequest(lora_name="moving"))  # fmt: skip
        wait_records(cluster, "moving", {"prefill0"})
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 2 * config["lora_alpha"]}))
        r = post(cluster, "/completions", {"model": "moving", "prompt": prompts["capital"], "max_tokens": 2})
        assert r.status_code == 400, r.text
        (digest,) = digests
        message = r.json()["error"]["message"]
        assert digest in message and "changed on disk" in message, message
        listed = instance_call(cluster.addresses["decode0"], "ListLoRAAdapters", common_pb2.ListLoRAAdaptersRequest())
        assert "moving" not in [a.name for a in listed.adapters]
    finally:
        post(cluster, "/unload_lora_adapter", {"lora_name": "moving"})
