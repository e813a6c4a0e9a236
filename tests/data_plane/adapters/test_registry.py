"""LoRARegistry against a stand-in for the engine's adapter interface and the real PEFT loader.

The fake engine implements only what the registry calls on an engine (the LoRAEngine protocol:
pin/unpin/remove, abort, stats), scripted so that a test decides when an aborted request lets go;
test_fake_engine_matches_the_real_one runs the cases both can run against both and compares. The
adapters are real PEFT folders written by data_plane.demo.adapters.
"""

from __future__ import annotations

import asyncio
import functools
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from data_plane.adapters.entry import AdapterState, Residency
from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.adapters.registry import LoRAEngine, LoRARegistry
from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.llm_engine import EngineStats
from data_plane.lora.errors import LoRAAdapterError, LoRAConflictError, LoRANotFoundError
from data_plane.lora.slots import AdapterEngineStats, LoRAEngineStats
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from shared.errors import InvalidRequestError, LoraplaneError
from tests.data_plane.api.engines import engine_stats, make_engine
from tests.data_plane.engine.protocol_check import mismatches

BASE = "demo"


@dataclass
class FakeEngine:
    """The engine's adapter interface: slots for pins, abort that ends a request (via `on_abort`)."""

    slots: int = 2
    pinned: set[int] = field(default_factory=set)
    resident: set[int] = field(default_factory=set)
    removed: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    on_abort: dict[str, object] = field(default_factory=dict)  # request id -> lease to release

    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        await asyncio.sleep(0)
        if adapter_id not in self.pinned and len(self.pinned) >= self.slots:
            raise LoRAConflictError("every LoRA slot is pinned")  # as the engine's slot manager does
        assert weights is not None and weights.layers
        self.pinned.add(adapter_id)
        self.resident.add(adapter_id)

    async def unpin_lora(self, adapter_id: int) -> None:
        await asyncio.sleep(0)
        self.pinned.discard(adapter_id)

    async def remove_lora(self, adapter_id: int) -> None:
        await asyncio.sleep(0)
        self.pinned.discard(adapter_id)
        self.resident.discard(adapter_id)
        self.removed.append(adapter_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        lease = self.on_abort.pop(request_id, None)
        if lease is not None:  # the request ends a moment later, releasing its lease
            asyncio.get_running_loop().call_soon(lease.release)

    def stats(self) -> EngineStats:
        adapters = {i: AdapterEngineStats(slot=0, pinned=i in self.pinned) for i in self.resident}
        return engine_stats(lora=LoRAEngineStats(self.slots, len(self.resident), adapters))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registry_base") / "demo"
    write_demo_model(path, seed=0)
    return path


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    return tmp_path / "adapters"


@pytest.fixture
def adapters(base_dir: Path, roots: Path) -> dict[str, Path]:
    return write_demo_adapters(base_dir, roots, seed=0)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def make_registry(engine: FakeEngine, base_dir: Path, roots: Path, **kw) -> LoRARegistry:
    loader = functools.partial(
        load_peft_adapter, model_config=ModelConfig.from_pretrained(base_dir), max_rank=64, allowed_roots=[str(roots)]
    )
    kw.setdefault("max_cpu_loras", 4)
    return LoRARegistry(engine, loader, base_name=BASE, default_drain_timeout_s=5.0, **kw)


@pytest.fixture
def registry(engine: FakeEngine, base_dir: Path, roots: Path) -> LoRARegistry:
    return make_registry(engine, base_dir, roots)


def rewrite(base_dir: Path, roots: Path, name: str, seed: int) -> None:
    """New content in place (same folder, different weights)."""
    write_demo_adapters(base_dir, roots, seed=seed, names=[name])


async def test_load_reports_the_adapter(registry, adapters):
    info = await registry.load("demo-poet", str(adapters["demo-poet"]))
    assert info["name"] == "demo-poet" and info["id"] >= 1 and info["load_generation"] == 1
    assert info["rank"] == 16 and info["alpha"] == 32.0 and len(info["sha256"]) == 64
    assert info["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert info["size_bytes"] > 0 and info["residency"] == "host"
    assert [e.name for e in registry.ready()] == ["demo-poet"]


async def test_same_content_is_idempotent_and_updates_pin(registry, adapters, engine):
    first = await registry.load("demo-poet", str(adapters["demo-poet"]))
    again = await registry.load("demo-poet", str(adapters["demo-poet"]), pinned=True)
    assert again["id"] == first["id"] and again["load_generation"] == 1
    assert engine.pinned == {first["id"]} and again["residency"] == "device"
    await registry.load("demo-poet", str(adapters["demo-poet"]))  # pinned=false is the desired state
    assert engine.pinned == set()
    assert len(list(registry.entries())) == 1


async def test_different_content_conflicts_without_load_inplace(registry, adapters, base_dir, roots):
    first = await registry.load("demo-poet", str(adapters["demo-poet"]))
    rewrite(base_dir, roots, "demo-poet", seed=1)
    with pytest.raises(LoRAConflictError) as err:
        await registry.load("demo-poet", str(adapters["demo-poet"]))
    assert err.value.status_code == 409
    assert first["sha256"][:12] in err.value.message and "load_inplace" in err.value.message
    assert [e.adapter_id for e in registry.entries()] == [first["id"]]


async def test_load_inplace_gets_a_fresh_id_and_drains_the_old(registry, adapters, base_dir, roots, engine):
    first = await registry.load("demo-poet", str(adapters["demo-poet"]))
    old_lease = await registry.acquire("demo-poet")
    rewrite(base_dir, roots, "demo-poet", seed=1)
    second = await registry.load("demo-poet", str(adapters["demo-poet"]), load_inplace=True)
    assert second["id"] > first["id"] and second["load_generation"] == 2 and second["sha256"] != first["sha256"]
    new_lease = await registry.acquire("demo-poet")
    assert new_lease.adapter_id == second["id"] and new_lease.cache_namespace != old_lease.cache_namespace
    states = {e.adapter_id: e.state for e in registry.entries()}
    assert states == {first["id"]: AdapterState.DRAINING, second["id"]: AdapterState.READY}
    old_lease.release()
    await wait_until(lambda: first["id"] in engine.removed)
    assert [e.adapter_id for e in registry.entries()] == [second["id"]]
    new_lease.release()
    # back to the first content: new content again for this name, so version 3 and yet another id
    rewrite(base_dir, roots, "demo-poet", seed=0)
    third = await registry.load("demo-poet", str(adapters["demo-poet"]), load_inplace=True)
    assert third["load_generation"] == 3 and third["id"] > second["id"] and third["sha256"] == first["sha256"]


async def test_ids_are_fresh_per_load_and_never_reused(registry, adapters):
    ids = []
    for _ in range(3):
        ids.append((await registry.load("demo-short", str(adapters["demo-short"])))["id"])
        await registry.unload("demo-short")
    ids.append((await registry.load("demo-pirate", str(adapters["demo-pirate"])))["id"])
    assert len(set(ids)) == 4 and ids == sorted(ids) and min(ids) >= 1


async def test_acquire_release_counting(registry, adapters):
    await registry.load("demo-short", str(adapters["demo-short"]))
    base = await registry.acquire(BASE)
    assert base.adapter_id == 0 and base.cache_namespace == 0 and base.weights is None
    leases = [await registry.acquire("demo-short") for _ in range(3)]
    [entry] = registry.ready()
    assert entry.in_flight == 3 and not entry.idle.is_set()
    assert leases[0].weights is entry.weights and leases[0].cache_namespace == entry.weights.cache_namespace
    leases[0].release()
    leases[0].release()  # idempotent
    assert entry.in_flight == 2
    for lease in leases[1:]:
        lease.release()
    assert entry.in_flight == 0 and entry.idle.is_set() and entry.last_used_at is not None


async def test_unknown_name_is_404(registry):
    with pytest.raises(LoRANotFoundError) as err:
        await registry.acquire("nope")
    assert err.value.status_code == 404 and err.value.message == "The model `nope` does not exist."
    with pytest.raises(LoRANotFoundError):
        await registry.unload("nope")


async def test_bad_names_and_paths_are_refused_without_an_entry(registry, adapters, tmp_path):
    with pytest.raises(InvalidRequestError):
        await registry.load(BASE, str(adapters["demo-poet"]))
    with pytest.raises(InvalidRequestError):
        await registry.load("", str(adapters["demo-poet"]))
    outside = tmp_path / "elsewhere"
    shutil.copytree(adapters["demo-poet"], outside)
    with pytest.raises(LoRAAdapterError, match="outside the allowed LoRA roots"):
        await registry.load("x", str(outside))
    with pytest.raises(LoRAAdapterError):
        await registry.load("x", str(adapters["demo-poet"].parent / "missing"))
    assert list(registry.entries()) == [] and registry.loading() == {}


async def test_draining_refuses_new_requests_and_unload_waits(registry, adapters, engine):
    await registry.load("demo-short", str(adapters["demo-short"]))
    lease = await registry.acquire("demo-short")
    lease.bind("req-1")
    unload = asyncio.ensure_future(registry.unload("demo-short", drain_timeout_s=10))
    await asyncio.sleep(0.05)
    assert not unload.done()
    [entry] = registry.entries()
    assert entry.state is AdapterState.DRAINING
    with pytest.raises(LoRANotFoundError, match="adapter demo-short is being unloaded"):
        await registry.acquire("demo-short")
    lease.release()
    assert await unload == {"name": "demo-short", "drained": True, "aborted": 0}
    assert engine.removed == [entry.adapter_id] and engine.aborted == []
    assert list(registry.entries()) == [] and entry.weights is None
    with pytest.raises(LoRANotFoundError, match="does not exist"):
        await registry.acquire("demo-short")


async def test_unload_aborts_in_flight_requests_after_the_timeout(registry, adapters, engine):
    await registry.load("demo-short", str(adapters["demo-short"]))
    leases = [await registry.acquire("demo-short") for _ in range(2)]
    for i, lease in enumerate(leases):
        lease.bind(f"req-{i}")
        engine.on_abort[f"req-{i}"] = lease
    result = await registry.unload("demo-short", drain_timeout_s=0.05)
    assert result == {"name": "demo-short", "drained": False, "aborted": 2}
    assert sorted(engine.aborted) == ["req-0", "req-1"] and len(engine.removed) == 1
    assert leases[0].abort_error is not None and "drain timeout" in leases[0].abort_error.message
    with pytest.raises(LoRANotFoundError):
        leases[0].check_admissible()  # a request that had not reached the engine must not start now
    assert list(registry.entries()) == []


async def test_unload_with_zero_timeout_on_idle_adapter_drains(registry, adapters):
    await registry.load("demo-short", str(adapters["demo-short"]))
    assert await registry.unload("demo-short", drain_timeout_s=0) == {
        "name": "demo-short",
        "drained": True,
        "aborted": 0,
    }


async def test_unload_frees_the_pinned_slot(registry, adapters, engine):
    info = await registry.load("demo-poet", str(adapters["demo-poet"]), pinned=True)
    assert engine.pinned == {info["id"]}
    await registry.unload("demo-poet")
    assert engine.pinned == set() and engine.resident == set() and engine.removed == [info["id"]]


async def test_pin_refused_when_all_slots_are_pinned(registry, adapters, engine):
    engine.slots = 1
    await registry.load("demo-poet", str(adapters["demo-poet"]), pinned=True)
    with pytest.raises(LoRAConflictError) as refused:
        await registry.load("demo-short", str(adapters["demo-short"]), pinned=True)
    assert refused.value.status_code == 409
    assert [e.name for e in registry.entries()] == ["demo-poet"]


async def test_host_cache_drops_lru_to_disk_and_rereads(engine, base_dir, roots):
    paths = {}
    for seed in range(4):  # 12 distinct adapters
        for name, path in write_demo_adapters(base_dir, roots / f"s{seed}", seed=seed).items():
            paths[f"{name}-{seed}"] = path
    registry = make_registry(engine, base_dir, roots, max_cpu_loras=3)
    names = sorted(paths)[:5]
    held = await registry.load(names[0], str(paths[names[0]]), pinned=True)
    in_use_info = await registry.load(names[1], str(paths[names[1]]))
    in_use = await registry.acquire(names[1])
    for name in names[2:]:
        await registry.load(name, str(paths[name]))
    residency = {e.name: registry.residency(e) for e in registry.entries()}
    # 3 host slots: the pinned and the in-use one stay; of the others only the most recent stays
    assert residency == {
        names[0]: Residency.DEVICE,
        names[1]: Residency.HOST,
        names[2]: Residency.DISK,
        names[3]: Residency.DISK,
        names[4]: Residency.HOST,
    }
    assert held["residency"] == "device" and in_use_info["residency"] == "host"
    lease = await registry.acquire(names[2])  # re-read from disk, in a thread
    assert lease.weights is not None and lease.weights.description.sha256 == next(
        e.description.sha256 for e in registry.entries() if e.name == names[2]
    )
    assert registry.residency(lease.entry) is Residency.HOST
    lease.release()
    in_use.release()
    assert sum(e.weights is not None for e in registry.entries()) == 3


async def test_changed_files_of_a_dropped_adapter_are_refused(engine, base_dir, roots, adapters):
    registry = make_registry(engine, base_dir, roots, max_cpu_loras=1)
    await registry.load("demo-poet", str(adapters["demo-poet"]))
    await registry.load("demo-short", str(adapters["demo-short"]))  # drops demo-poet to disk
    poet = next(e for e in registry.entries() if e.name == "demo-poet")
    assert registry.residency(poet) is Residency.DISK
    rewrite(base_dir, roots, "demo-poet", seed=5)
    with pytest.raises(LoRAConflictError, match="files changed since load; reload with load_inplace") as err:
        await registry.acquire("demo-poet")
    assert err.value.status_code == 409
    assert poet.in_flight == 0 and poet.idle.is_set()  # the refused request holds nothing
    info = await registry.load("demo-poet", str(adapters["demo-poet"]), load_inplace=True)
    lease = await registry.acquire("demo-poet")
    assert lease.adapter_id == info["id"] != poet.adapter_id
    lease.release()


async def test_concurrent_reads_of_a_dropped_adapter_read_once(engine, base_dir, roots, adapters):
    calls = []
    registry = make_registry(engine, base_dir, roots, max_cpu_loras=1)
    real = registry._loader
    registry._loader = lambda path: calls.append(path) or real(path)
    await registry.load("demo-poet", str(adapters["demo-poet"]))
    await registry.load("demo-short", str(adapters["demo-short"]))
    calls.clear()
    leases = await asyncio.gather(*(registry.acquire("demo-poet") for _ in range(5)))
    assert len(calls) == 1 and {id(lease.weights) for lease in leases} == {id(leases[0].weights)}
    for lease in leases:
        lease.release()


@pytest.mark.parametrize("seed", range(5))
async def test_load_unload_storm_on_one_name_ends_consistent(registry, adapters, engine, base_dir, roots, seed):
    # two contents for the same name in two folders
    other = write_demo_adapters(base_dir, roots / "v2", seed=1, names=["demo-short"])["demo-short"]
    folders = [str(adapters["demo-short"]), str(other)]
    rng = random.Random(seed)
    held = []

    async def actor(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.01)
        op = rng.choice(["load", "load_inplace", "unload", "acquire"])
        try:
            if op == "unload":
                await registry.unload("demo-short", drain_timeout_s=0.01)
            elif op == "acquire":
                lease = await registry.acquire("demo-short")
                lease.bind(f"storm-{i}")
                engine.on_abort[f"storm-{i}"] = lease
                held.append(lease)
                await asyncio.sleep(rng.random() * 0.02)
                lease.release()
            else:
                await registry.load("demo-short", rng.choice(folders), load_inplace=op == "load_inplace")
        except (LoRANotFoundError, LoRAConflictError):
            pass

    await asyncio.gather(*(actor(i) for i in range(50)))
    await wait_until(lambda: not registry._tasks)
    entries = list(registry.entries())
    assert len(entries) <= 1 and all(e.state is AdapterState.READY for e in entries)
    assert all(e.in_flight == 0 for e in entries) and all(lease.released for lease in held)
    live = {e.adapter_id for e in entries}
    assert engine.resident <= live  # no slot leaked for a removed version
    assert len(registry._name_lock) == 0  # per-name locks are not leaked either
    if entries:
        await registry.unload("demo-short")
    assert list(registry.entries()) == [] and registry.ready() == []


async def test_close_cancels_background_drains(registry, adapters, base_dir, roots):
    await registry.load("demo-poet", str(adapters["demo-poet"]))
    lease = await registry.acquire("demo-poet")
    rewrite(base_dir, roots, "demo-poet", seed=3)
    await registry.load("demo-poet", str(adapters["demo-poet"]), load_inplace=True)
    assert registry._tasks
    await registry.close()
    assert not registry._tasks
    lease.release()


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)



async def test_loading_state_is_visible_and_requests_wait_for_the_load(registry, adapters):
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = registry._loader

    def slow(path: str):
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(5)  # held until the test lets it go
        return real(path)

    registry._loader = slow
    task = asyncio.ensure_future(registry.load("demo-poet", str(adapters["demo-poet"])))
    await wait_until(lambda: "demo-poet" in registry.loading())
    waiting = asyncio.ensure_future(registry.acquire("demo-poet"))  # waits for the load, no 404 "still loading"
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.set()
    await task
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.name == "demo-poet"
    lease.release()
    assert registry.loading() == {} and [e.name for e in registry.ready()] == ["demo-poet"]


async def test_a_request_waiting_for_a_failed_load_is_404(registry, adapters, tmp_path):
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = registry._loader

    def slow(path: str):
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(5)
        return real(path)

    registry._loader = slow
    missing = adapters["demo-poet"].parent / "no-such-adapter"
    task = asyncio.ensure_future(registry.load("ghost", str(missing)))
    await wait_until(lambda: "ghost" in registry.loading())
    waiting = asyncio.ensure_future(registry.acquire("ghost"))
    gate.set()
    with pytest.raises(LoraplaneError):
        await task
    with pytest.raises(LoRANotFoundError):
        await asyncio.wait_for(waiting, 5)


@pytest.mark.parametrize("name", ["a\0b", "a\u202eb", "name\n", "../lora_stats", "a/./b", "x" * 129])
async def test_unsafe_names_are_refused_on_every_way_in(registry, adapters, name):
    # --lora-modules and the control plane's pulls call the registry directly, past the HTTP schema
    with pytest.raises(InvalidRequestError, match="not a valid adapter name") as err:
        await registry.load(name, str(adapters["demo-poet"]))
    assert err.value.param == "lora_name" and list(registry.entries()) == []


# ---- the fake against the real engine ----------------------------------------------------------


async def pin_scenario(engine: LoRAEngine, weights: list[LoRAAdapterWeights]) -> list[object]:
    """What a registry can do to an engine with two slots, and what it sees: pins until full, a pin
    again (idempotent), unpin, remove (also of an id never pinned); each step's error type and status
    (or None) and the slot figures after it."""
    seen: list[object] = []

    async def do(call: object) -> None:
        try:
            await call  # type: ignore[misc]
            seen.append(None)
        except LoraplaneError as exc:
            seen.append((type(exc).__name__, exc.status_code))
        lora = engine.stats().lora
        seen.append((lora.slots_used, sorted(i for i, a in lora.adapters.items() if a.pinned)))

    await do(engine.pin_lora(1, weights[0]))
    await do(engine.pin_lora(2, weights[1]))
    await do(engine.pin_lora(3, weights[2]))  # every slot pinned: 409
    await do(engine.pin_lora(2, weights[1]))  # already pinned: fine
    await do(engine.unpin_lora(1))
    await do(engine.remove_lora(1))
    await do(engine.remove_lora(99))  # never known: nothing to free
    await do(engine.pin_lora(3, weights[2]))  # a slot is free again
    return seen


async def test_fake_engine_matches_the_real_one(demo_model_dir, base_dir, roots, adapters):
    loader = make_registry(FakeEngine(), base_dir, roots)._loader
    weights = [loader(str(adapters[name])) for name in ("demo-poet", "demo-short", "demo-pirate")]
    real = make_engine(demo_model_dir, enable_lora=True, max_loras=2, max_lora_rank=64)
    assert mismatches(real, LoRAEngine) == [] and mismatches(FakeEngine(), LoRAEngine) == []
    real.start()
    try:
        expected = await pin_scenario(real, weights)
    finally:
        await real.shutdown()
    assert expected[4] == ("LoRAConflictError", 409)  # the case the fake once got wrong (400)
    assert await pin_scenario(FakeEngine(slots=2), weights) == expected
