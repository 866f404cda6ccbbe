"""turnkv's connector starting up and moving KV on a stand-in of the native vllm-neuron platform, against a fake of
NIXL's C++ agent (``tests.unit.fake_nixl``) under NIXL's real Python API.

Two engines as a trn2 pair runs them (``turnkv.engine_args`` for ``flavor="neuron"``: kv_buffer_device ``cuda``,
LIBFABRIC, bi-directional), each a rank of turnkv's pull worker built by upstream vLLM's constructor, its KV cache
allocated by vLLM's own ``allocate_kv_cache`` in the layout vllm-neuron declares (``turnkv.neuron.KV_LAYOUT``), and
registered by the worker's ``register_kv_caches``. Decode handshakes with prefill through upstream's side-channel
listener on 127.0.0.1 and pulls two blocks with ``start_load_kv``; then prefill reads decode's retained blocks back
(the bi-directional second turn). The checks: what was registered (memory type, device id, regions), the READ's
descriptors (block b of layer l at base_l + b * block_len on both sides), the bytes that moved, the notifications,
and the refusals NIXL makes reaching the connector as a failed read (the request recomputes).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import socket
import threading
import time
import types

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

import msgspec
import torch

from tests.unit import fake_nixl
from tests.unit.neuron_standin import NativeNeuronPlatform, attention_backend
from turnkv import engine_args, neuron, platforms, versions

#: The Neuron image ships vLLM 0.29 (``turnkv.versions.IMAGE_VLLM``): its NIXL worker is the one that runs on a trn2
#: node, so the engine tests run there (``make test`` runs this module in the 0.29 venv). vLLM 0.32's worker takes
#: each region's memory type from its tensor's device, which host memory standing in for HBM cannot imitate.
NEURON_VLLM = pytest.mark.skipif(
    importlib.import_module("vllm").__version__.split("+")[0] != versions.IMAGE_VLLM["neuron"],
    reason=f"the Neuron image's vLLM is {versions.IMAGE_VLLM['neuron']} (run in its venv: make test does)")

LAYERS, KV_HEADS, HEAD_DIM, BLOCKS = 2, 4, 64, 16


def neuron_spec(role: engine_args.Role, engine_id: str, **tunables: object) -> engine_args.EngineSpec:
    return engine_args.EngineSpec(role=role, engine_id=engine_id, model="m", port=8000, side_channel_port=5600,
                                  backends=neuron.NIXL_BACKENDS, flavor="neuron", tunables=tunables)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The engines' vLLM configs by name, made once (on this machine's platform: vLLM's own config checks need it);
    ``/tp2`` ones at tensor parallelism 2 (a trn2 engine runs TP 16: every rank takes the same path)."""
    import json

    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "vocab_size": 1000, "torch_dtype": "bfloat16"}))
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    made = {}
    engines = ((engine_args.Role.PREFILL, "prefill-0", 1, {}), (engine_args.Role.DECODE, "decode-0", 1, {}),
               (engine_args.Role.DECODE, "decode-host-tier", 1, {"host_kv_budget_mib": 64}),
               (engine_args.Role.PREFILL, "prefill-0", 2, {}), (engine_args.Role.DECODE, "decode-0", 2, {}))
    for role, engine, tp, tunables in engines:
        spec = neuron_spec(role, engine, **tunables)
        transfer = KVTransferConfig(**engine_args.kv_transfer_config(spec))
        config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=spec.block_size),
                            kv_transfer_config=transfer, parallel_config=ParallelConfig(tensor_parallel_size=tp))
        config.cache_config.kv_cache_layout = neuron.KV_LAYOUT  # what the engine core resolves for the plugin
        made[engine if tp == 1 else f"{engine}/tp2"] = config
    return made


@contextlib.contextmanager
def on_neuron(runtime: str = "neuron"):
    """vLLM's NIXL worker module as it runs under the native plugin, with NIXL's C++ agent faked on ``runtime``."""
    import nixl._api as nixl_api
    import vllm.platforms
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils as nixl_utils

    platform = NativeNeuronPlatform()
    fabric = fake_nixl.Fabric(runtime)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm.platforms, "_current_platform", platform)
        mp.setenv(platforms.ALLOW_ENV, "neuron")
        # The device table is built at import from the platform's get_nixl_supported_devices: build it again.
        table = importlib.reload(nixl_utils)._NIXL_SUPPORTED_DEVICE
        mp.setattr(base_worker, "_NIXL_SUPPORTED_DEVICE", table)
        mp.setattr(base_worker, "current_platform", platform)
        mp.setattr(base_worker, "get_current_attn_backends", lambda *a, **k: [attention_backend()])
        mp.setattr(base_worker, "get_tensor_model_parallel_rank", lambda: 0)
        mp.setattr(base_worker, "get_tensor_model_parallel_world_size", lambda: 1)
        mp.setattr(nixl_api, "nixlBind", fake_nixl.FakeBindings(nixl_api.nixlBind, fabric))
        try:
            yield fabric
        finally:
            mp.undo()
            importlib.reload(nixl_utils)


@pytest.fixture
def neuron_fabric():
    with on_neuron() as fabric:
        yield fabric


def start_engine(config, engine_id: str, kv_heads: int = KV_HEADS):
    """What a worker process does at start: build the connector's worker, allocate the KV cache, register it
    (``kv_heads``: this rank's share of the model's KV heads)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    from connector.pull import TurnkvPullConnector

    spec = FullAttentionSpec(block_size=config.cache_config.block_size, num_kv_heads=kv_heads, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(layers, spec)],
                                                BLOCKS * LAYERS * spec.page_size_bytes)
    connector = TurnkvPullConnector(config, KVConnectorRole.WORKER, kv_config)
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout())
    connector.register_kv_caches(caches)
    return types.SimpleNamespace(connector=connector, worker=connector.connector_worker, caches=caches,
                                 engine_id=engine_id)


def core(fabric: fake_nixl.Fabric, engine) -> fake_nixl.FakeNixlCore:
    return fabric.agents[engine.worker.nixl_wrapper.name]


def calls(agent: fake_nixl.FakeNixlCore, name: str) -> list:
    return [args for call, args in agent.calls if call == name]


@contextlib.contextmanager
def side_channel(*ranks):
    """Upstream's handshake listener serving the metadata of an engine's tensor-parallel ``ranks`` (in rank order) on
    127.0.0.1, as its scheduler process does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()
    payload = {(0, rank): msgspec.msgpack.Encoder().encode(engine.worker.xfer_handshake_metadata)
               for rank, engine in enumerate(ranks)}
    thread = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                              args=(payload, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield port
    finally:
        stop.set()
        thread.join(5)


def offer(engine, request_id: str):
    """The holder's scheduler telling its worker that ``request_id``'s blocks wait to be read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    meta.reqs_in_batch = {request_id}
    meta.reqs_to_send = {request_id: time.perf_counter() + 60}
    engine.worker.start_load_kv(meta)


def pull(reader, holder, port: int, local: list[int], remote: list[int], request_id: str, remote_request_id: str,
         tp_size: int = 1):
    """The reader's scheduler handing its worker one READ (as for a remote prefill), then the next steps."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(request_id, (local,), {
        "remote_block_ids": (remote,), "remote_engine_id": holder.engine_id, "remote_request_id": remote_request_id,
        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": tp_size})
    reader.worker.start_load_kv(meta)  # the first read of an engine handshakes in the background
    deadline = time.monotonic() + 30
    while holder.engine_id not in reader.worker._remote_agents and time.monotonic() < deadline:
        time.sleep(0.02)
    reader.worker.start_load_kv(NixlConnectorMetadata())  # the next step posts the READs whose handshake finished


def fill(engine, seed: int) -> None:
    """Distinct bytes in every block of every layer (as int16, so no NaN pattern makes equal bytes compare unequal)."""
    for i, cache in enumerate(engine.caches.values()):
        flat = torch.arange(cache.numel(), dtype=torch.int32).add_(seed * 7919 + i * 104729)
        cache.view(torch.int16).copy_(flat.to(torch.int16).view(cache.shape))


def block(engine, layer: str, b: int) -> torch.Tensor:
    return engine.caches[layer][b].view(torch.int16)


def expected_pairs(reader, holder, local: list[int], remote: list[int]) -> list:
    """The READ's (local, remote) descriptors: block b of layer l at base_l + b * block_len, on both sides."""
    pairs = []
    for name in reader.caches:
        mine, theirs = reader.caches[name], holder.caches[name]
        length = mine[0].nbytes
        device = neuron.NIXL_DEVICE_ID
        pairs += [((mine.data_ptr() + a * length, length, device), (theirs.data_ptr() + b * length, length, device))
                  for a, b in zip(local, remote, strict=True)]
    return pairs


@NEURON_VLLM
def test_start_up_registers_the_kv_cache_as_neuron_device_memory(configs, neuron_fabric):
    engine = start_engine(configs["decode-0"], "decode-0")
    agent = core(neuron_fabric, engine)
    assert calls(agent, "createBackend") == [("LIBFABRIC", {})]  # the backend engine_args names, nothing else
    # One VRAM registration on LIBFABRIC of the one allocation every layer's view lies in, device id 0.
    storages = {(c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()) for c in engine.caches.values()}
    assert calls(agent, "registerMem") == [
        (neuron.NIXL_MEMORY_TYPE, [(a, n, neuron.NIXL_DEVICE_ID) for a, n in sorted(storages)], ["LIBFABRIC"])]
    (base, size), = storages
    for cache in engine.caches.values():
        assert base <= cache.data_ptr() and cache.data_ptr() + cache.nbytes <= base + size
    # The local descriptor list: every block of every layer, region-major, block b at base_l + b * block_len.
    (agent_name, mem, rows, backends), = calls(agent, "prepXferDlist")
    assert (agent_name, mem, backends) == ("", neuron.NIXL_MEMORY_TYPE, ["LIBFABRIC"])
    assert rows == [(c.data_ptr() + b * c[0].nbytes, c[0].nbytes, neuron.NIXL_DEVICE_ID)
                    for c in engine.caches.values() for b in range(BLOCKS)]
    assert engine.worker.kv_cache_layout == neuron.KV_LAYOUT
    assert engine.worker.backend_name == neuron.ATTENTION_BACKEND
    assert engine.worker.nixl_memory_type == neuron.NIXL_MEMORY_TYPE


@NEURON_VLLM
def test_decodes_host_tier_stays_off_on_the_neuron_image(configs, neuron_fabric, caplog):
    """``turnkv.neuron.HOST_TIER_NOTE``: vLLM 0.29's NIXL worker has no per-region layout, so a decode configured
    with a host budget registers its device cache only, and says so (the granted-bytes gauge reads 0)."""
    engine = start_engine(configs["decode-host-tier"], "decode-host-tier")
    assert [mem for mem, _, _ in calls(core(neuron_fabric, engine), "registerMem")] == [neuron.NIXL_MEMORY_TYPE]
    rank, configured, granted, why = engine.worker._turnkv_host_tier
    assert (rank, configured, granted) == (0, 64 << 20, 0) and "vLLM 0.29" in why
    assert any("HOST TIER OFF" in r.getMessage() for r in caplog.records)


@NEURON_VLLM
def test_without_a_neuron_runtime_start_up_stops_naming_the_fix(configs):
    """NIXL's LIBFABRIC plugin offers VRAM only where it finds a Neuron runtime; elsewhere NIXL refuses the KV cache
    with NIXL_ERR_BACKEND, and the engine stops saying what the node lacks instead."""
    with on_neuron(runtime="system") as fabric:
        with pytest.raises(RuntimeError, match="refused to register") as refused:
            start_engine(configs["decode-0"], "decode-0")
        (agent,) = fabric.agents.values()
        assert calls(agent, "prepXferDlist") == []  # nothing after the refused registration
    message = str(refused.value)
    assert "VRAM on LIBFABRIC" in message and "NIXL_ERR_BACKEND" in message and "doctor --flavor neuron" in message
    assert type(refused.value.__cause__).__name__ == "nixlBackendError"


@NEURON_VLLM
def test_a_pull_then_the_bidirectional_read_back_move_exactly_the_offered_blocks(configs, neuron_fabric):
    prefill = start_engine(configs["prefill-0"], "prefill-0")
    decode = start_engine(configs["decode-0"], "decode-0")
    fill(prefill, 1)
    fill(decode, 2)
    before = {name: cache.clone() for name, cache in decode.caches.items()}

    # Turn 1: decode pulls prefill's blocks 5 and 9 into its blocks 3 and 7.
    with side_channel(prefill) as port:
        offer(prefill, "p-1")
        pull(decode, prefill, port, [3, 7], [5, 9], "d-1", "p-1")
    reads = calls(core(neuron_fabric, decode), "makeXferReq")
    assert len(reads) == 1
    op, remote_agent, pairs, notif = reads[0]
    assert op == "READ" and remote_agent == prefill.worker.nixl_wrapper.name and notif == b"p-1:1"
    assert pairs == expected_pairs(decode, prefill, [3, 7], [5, 9])
    # The remote list decode prepared is prefill's registered blocks, as the handshake described them.
    remote_lists = [rows for agent, mem, rows, _ in calls(core(neuron_fabric, decode), "prepXferDlist") if agent]
    assert remote_lists == [[(c.data_ptr() + b * c[0].nbytes, c[0].nbytes, neuron.NIXL_DEVICE_ID)
                             for c in prefill.caches.values() for b in range(BLOCKS)]]
    destinations = sorted((local[0], local[0] + local[1]) for local, _ in pairs)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(destinations)), "overlapping writes"
    for name in decode.caches:
        assert torch.equal(block(decode, name, 3), block(prefill, name, 5))
        assert torch.equal(block(decode, name, 7), block(prefill, name, 9))
        untouched = [b for b in range(BLOCKS) if b not in (3, 7)]
        assert torch.equal(decode.caches[name][untouched].view(torch.int16), before[name][untouched].view(torch.int16))
    assert decode.worker.get_finished()[1] == {"d-1"}  # received
    assert prefill.worker.get_finished()[0] == {"p-1"}  # sent: prefill's blocks may be freed

    # Turn 2 (bi-directional): prefill reads decode's retained blocks 3 and 7 back into its blocks 0 and 1.
    with side_channel(decode) as port:
        offer(decode, "d-1")
        pull(prefill, decode, port, [0, 1], [3, 7], "p-2", "d-1")
    (op, remote_agent, pairs, notif), = calls(core(neuron_fabric, prefill), "makeXferReq")
    assert op == "READ" and remote_agent == decode.worker.nixl_wrapper.name and notif == b"d-1:1"
    assert pairs == expected_pairs(prefill, decode, [0, 1], [3, 7])
    for name in prefill.caches:
        assert torch.equal(block(prefill, name, 0), block(decode, name, 3))
        assert torch.equal(block(prefill, name, 1), block(decode, name, 7))
    assert prefill.worker.get_finished()[1] == {"p-2"}
    assert decode.worker.get_finished()[0] == {"d-1"}


@NEURON_VLLM
def test_at_tensor_parallelism_each_decode_rank_reads_its_prefill_rank(configs):
    """TP 2 on both sides (a trn2 engine runs TP 16 over its NeuronCores): every rank registers its own KV heads with
    its own agent, device id 0 (each worker sees one device), and decode rank r reads prefill rank r's blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    tp, heads = 2, KV_HEADS // 2
    with on_neuron() as fabric, pytest.MonkeyPatch.context() as mp:
        mp.setattr(base_worker, "get_tensor_model_parallel_world_size", lambda: tp)
        ranks: dict[str, list] = {"prefill-0": [], "decode-0": []}
        for engine, started in ranks.items():
            for rank in range(tp):
                mp.setattr(base_worker, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
                started.append(start_engine(configs[f"{engine}/tp2"], engine, kv_heads=heads))
        for rank, engine in enumerate(ranks["prefill-0"]):
            fill(engine, 10 + rank)
        with side_channel(*ranks["prefill-0"]) as port:
            for engine in ranks["prefill-0"]:
                offer(engine, "p-1")
            for decode in ranks["decode-0"]:
                pull(decode, ranks["prefill-0"][0], port, [2, 4], [6, 8], "d-1", "p-1", tp_size=tp)
        for rank, (prefill, decode) in enumerate(zip(ranks["prefill-0"], ranks["decode-0"], strict=True)):
            (registered,) = calls(core(fabric, decode), "registerMem")
            assert registered[0] == neuron.NIXL_MEMORY_TYPE and {d for _, _, d in registered[1]} == {0}
            (op, remote_agent, pairs, notif), = calls(core(fabric, decode), "makeXferReq")
            assert op == "READ" and remote_agent == prefill.worker.nixl_wrapper.name, f"rank {rank} read another"
            assert pairs == expected_pairs(decode, prefill, [2, 4], [6, 8]) and notif == b"p-1:1"
            for name in decode.caches:
                assert torch.equal(block(decode, name, 2), block(prefill, name, 6))
                assert torch.equal(block(decode, name, 4), block(prefill, name, 8))
            assert decode.worker.get_finished()[1] == {"d-1"}
            assert prefill.worker.get_finished()[0] == {"p-1"}


@NEURON_VLLM
def test_a_read_nixl_refuses_fails_the_request_and_moves_nothing(configs, neuron_fabric):
    """Block ids past prefill's cache give NIXL descriptor indices out of range: NIXL refuses the transfer
    (NIXL_ERR_INVALID_PARAM), upstream fails the read and decode recomputes those blocks."""
    prefill = start_engine(configs["prefill-0"], "prefill-0")
    decode = start_engine(configs["decode-0"], "decode-0")
    fill(prefill, 1)
    before = {name: cache.clone() for name, cache in decode.caches.items()}
    with side_channel(prefill) as port:
        pull(decode, prefill, port, [3, 7], [5, BLOCKS + 4], "d-1", "p-1")
    assert calls(core(neuron_fabric, decode), "makeXferReq") == []
    assert calls(core(neuron_fabric, decode), "postXferReq") == []
    assert decode.worker.get_finished()[1] == {"d-1"}  # finished, as failed:
    assert decode.worker.get_block_ids_with_load_errors() == {3, 7}  # its blocks are recomputed
    for name in decode.caches:
        assert torch.equal(decode.caches[name].view(torch.int16), before[name].view(torch.int16))


def test_the_fake_agent_refuses_what_nixl_refuses(neuron_fabric):
    """The fake's refusals, through NIXL's own Python API: descriptors outside every registered region, an unknown
    remote agent, and indices out of range (NIXL core), device memory without a device runtime (LIBFABRIC)."""
    import nixl._api as nixl_api

    real = nixl_api.nixlBind._real
    buffer = torch.zeros(4096, dtype=torch.uint8)
    base = buffer.data_ptr()
    agent = nixl_api.nixl_agent("a", nixl_api.nixl_agent_config(backends=["LIBFABRIC"]))
    agent.register_memory([(base, 4096, 0, "")], "VRAM", backends=["LIBFABRIC"])
    with pytest.raises(real.nixlNotFoundError):  # one byte past the registered region
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + 2048, 2049, 0)], "VRAM")
    with pytest.raises(real.nixlNotFoundError):  # registered on device 0, described on device 1
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, 1024, 1)], "VRAM")
    with pytest.raises(real.nixlNotFoundError):  # registered as VRAM, described as DRAM
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, 1024, 0)], "DRAM")
    with pytest.raises(real.nixlNotFoundError):
        agent.prep_xfer_dlist("nobody", [(base, 1024, 0)], "VRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, 1024, 0), (base + 1024, 1024, 0)], "VRAM")
    peer = nixl_api.nixl_agent("b", nixl_api.nixl_agent_config(backends=["LIBFABRIC"]))
    other = torch.zeros(4096, dtype=torch.uint8)
    peer.register_memory([(other.data_ptr(), 4096, 0, "")], "VRAM", backends=["LIBFABRIC"])
    name = agent.add_remote_agent(peer.get_agent_metadata())
    remote = agent.prep_xfer_dlist(name, [(other.data_ptr(), 1024, 0), (other.data_ptr() + 1024, 512, 0)], "VRAM")
    with pytest.raises(real.nixlInvalidParamError):
        agent.make_prepped_xfer("READ", local, [0, 2], remote, [0, 0])  # local index 2 of 2
    with pytest.raises(real.nixlInvalidParamError):
        agent.make_prepped_xfer("READ", local, [0, 1], remote, [0, 1])  # 1024 bytes against 512
    with pytest.raises(real.nixlInvalidParamError):
        agent.make_prepped_xfer("READ", remote, [0], local, [0])  # sides swapped

    with on_neuron(runtime="system"):  # NIXL's topology found no Neuron runtime: LIBFABRIC offers DRAM only
        bare = nixl_api.nixl_agent("c", nixl_api.nixl_agent_config(backends=["LIBFABRIC"]))
        with pytest.raises(nixl_api.nixlBind._real.nixlBackendError):
            bare.register_memory([(base, 4096, 0, "")], "VRAM", backends=["LIBFABRIC"])
        bare.register_memory([(base, 4096, 0, "")], "DRAM", backends=["LIBFABRIC"])
