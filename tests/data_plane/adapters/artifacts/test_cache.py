"""ArtifactCache over a real loopback artifact server: fetched once (also across a restart and for
concurrent needs), nothing partial ever cached, LRU eviction that spares held and in-use digests."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from data_plane.adapters.artifacts.cache import MANIFEST_NAME, PARTIAL_DIR, ArtifactCache, CacheInUseError
from data_plane.adapters.artifacts.fetch import ArtifactFetcher, ArtifactFetchError, ArtifactOrigins
from data_plane.adapters.loading.staging import TensorStage
from data_plane.background import BackgroundPace
from data_plane.lora.errors import LoRAAdapterError
from shared.artifacts import ArtifactRef
from shared.errors import OverloadedError
from tests.data_plane.adapters.artifacts.artifact_server import ArtifactServer, serve_artifacts

MiB = 1 << 20


def files(seed: int, size: int = 2 * MiB) -> dict[str, bytes]:
    return {"adapter_config.json": f'{{"seed": {seed}}}'.encode(), "adapter_model.safetensors": os.urandom(size)}


@pytest.fixture
def cp() -> Iterator[ArtifactServer]:
    with serve_artifacts() as server:
        yield server


@pytest.fixture
async def make_cache(cp: ArtifactServer, tmp_path: Path) -> AsyncIterator:
    opened: list[ArtifactCache] = []

    def make(max_bytes: int = 64 * MiB, in_use=frozenset, root: Path | None = None,
             pace: BackgroundPace | None = None) -> ArtifactCache:
        fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), "t", max_bytes=max_bytes, read_timeout_s=5, pace=pace,
                                  stage=TensorStage)
        cache = ArtifactCache(root or tmp_path / "cache", max_bytes, fetcher, in_use=in_use)
        cache.open()
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        cache.close()
        await cache.fetcher.aclose()


async def get(cache: ArtifactCache, ref: ArtifactRef) -> dict[str, bytes]:
    async with cache.acquire(ref) as folder:
        pass  # where a load takes the weights (from the held bytes right after a fetch)
    await cache.settle()  # a fetched version's files are written in the background once its holder is done
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST_NAME}


def digests_on_disk(cache: ArtifactCache) -> set[str]:
    return {p.name for p in cache.root.iterdir() if not p.name.startswith(".")}


async def test_a_cached_digest_is_never_fetched_again_also_after_a_restart(cp, make_cache):
    content = files(1)
    ref = cp.publish(content)
    cache = make_cache()
    assert await get(cache, ref) == content
    fetched = len(cp.seen)
    assert fetched == 3  # the manifest and two files
    assert await get(cache, ref) == content
    cache.close()
    restarted = make_cache()  # a new engine process over the same folder
    assert ref.digest in restarted
    assert await get(restarted, ref) == content
    assert len(cp.seen) == fetched
    assert (cache.stats.misses, cache.stats.hits, restarted.stats.hits) == (1, 1, 1)


async def test_concurrent_needs_of_one_digest_fetch_it_once(cp, make_cache):
    content = files(2)
    ref = cp.publish(content)
    cache = make_cache()
    got = await asyncio.gather(*(get(cache, ref) for _ in range(5)))
    assert all(g == content for g in got)
    assert len(cp.paths()) == len(set(cp.paths())) == 3  # the manifest and each file, asked once
    assert cache.stats.fetches == 1 and cache.stats.hits == 4


async def test_a_server_dying_mid_file_leaves_no_cache_entry(cp, make_cache):
    content = files(3, size=4 * MiB)
    ref = cp.publish(content)
    cp.die_after["adapter_model.safetensors"] = 3 * MiB
    cache = make_cache()
    with pytest.raises(ArtifactFetchError):
        await get(cache, ref)
    assert ref.digest not in cache and digests_on_disk(cache) == set()
    assert list((cache.root / PARTIAL_DIR).iterdir()) == []
    cache.close()
    assert ref.digest not in make_cache()  # nor after a restart
    del cp.die_after["adapter_model.safetensors"]
    assert await get(make_cache(root=cache.root.parent / "other"), ref) == content


async def test_a_corrupted_file_is_refused_and_not_cached(cp, make_cache):
    ref = cp.publish(files(4))
    cp.corrupt["adapter_model.safetensors"] = b"\0" * (2 * MiB)
    cache = make_cache()
    with pytest.raises(LoRAAdapterError, match="checksum mismatch for adapter_model.safetensors"):
        await get(cache, ref)
    assert digests_on_disk(cache) == set() and cache.stats.fetch_failures == 1
    # nothing of the refused bytes is held for the loader, nor is anything being written
    folder = cache.root / ref.digest
    assert all(cache.verified.contents_of(folder / n) is None for n in ("adapter_config.json", "adapter_model.safetensors"))
    assert list((cache.root / PARTIAL_DIR).iterdir()) == []


async def test_fetched_bytes_are_held_for_the_loader_until_the_cache_copy_is_written(cp, make_cache):
    content = files(7)
    ref = cp.publish(content)
    cache = make_cache()
    async with cache.acquire(ref) as folder:
        # the loader's view right after the fetch: the verified bytes; the cache's copy is not written
        # while the load that fetched them runs (it would compete with the load's own copies)
        await asyncio.sleep(0.5)
        held = {n: bytes(h[1]) for n in content if (h := cache.verified.contents_of(folder / n)) is not None}
        assert held == content and not (folder / MANIFEST_NAME).exists()
    await cache.settle()  # written once the holder is done
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST_NAME} == content
    # written: the file is the copy now; its sha256 stays known, so no re-hash either
    assert all(cache.verified.contents_of(folder / n) is None for n in content)
    weights = folder / "adapter_model.safetensors"
    assert cache.verified.sha256_of(weights) == hashlib.sha256(content["adapter_model.safetensors"]).hexdigest()
    assert list((cache.root / PARTIAL_DIR).iterdir()) == [] and ref.digest in cache


async def test_a_write_waiting_for_a_quiet_engine_holds_up_no_load_and_no_shutdown(cp, make_cache):
    """While the engine serves, the cache's copy waits (up to 30 s); another holder of the same version
    meanwhile gets it at once from the held bytes, and shutdown's settle makes the write go now."""
    content = files(8)
    ref = cp.publish(content)
    cache = make_cache(pace=BackgroundPace(lambda: True))  # an engine that never stops serving
    async with cache.acquire(ref) as folder:
        pass  # the load that fetched it is done: the write now waits for a quiet engine
    await asyncio.sleep(0.3)
    assert not (folder / MANIFEST_NAME).exists()
    started = asyncio.get_running_loop().time()
    async with cache.acquire(ref) as again:  # a second load of the version (a retried push)
        held = {n: bytes(h[1]) for n in content if (h := cache.verified.contents_of(again / n)) is not None}
    assert held == content and asyncio.get_running_loop().time() - started < 1
    assert cache.stats.fetches == 1 and cache.stats.hits == 1
    await asyncio.wait_for(cache.settle(), 20)  # as at shutdown: written now, paced, not after 30 s
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST_NAME} == content


async def test_a_partial_folder_left_by_a_crash_is_removed_at_open(cp, make_cache, tmp_path):
    ref = cp.publish(files(5))
    root = tmp_path / "cache"
    (root / PARTIAL_DIR / f"{ref.digest}.dead").mkdir(parents=True)
    (root / ref.digest).mkdir()  # a digest folder without its manifest: not a cache entry
    (root / ref.digest / "adapter_model.safetensors").write_bytes(b"half")
    cache = make_cache()
    assert ref.digest not in cache and digests_on_disk(cache) == set()
    assert list((root / PARTIAL_DIR).iterdir()) == []


async def test_a_cached_file_truncated_behind_the_engine_is_fetched_again(cp, make_cache):
    content = files(6)
    ref = cp.publish(content)
    cache = make_cache()
    async with cache.acquire(ref) as folder:
        pass
    await cache.settle()
    (folder / "adapter_model.safetensors").write_bytes(b"short")
    assert await get(cache, ref) == content
    assert cache.stats.fetches == 2


async def test_lru_eviction_spares_digests_in_use_and_held(cp, make_cache):
    a, b, c, d = (cp.publish(files(10 + i)) for i in range(4))
    in_use: set[str] = set()
    cache = make_cache(max_bytes=int(4.5 * MiB), in_use=lambda: in_use)  # room for two versions
    await get(cache, a)
    await get(cache, b)
    in_use.add(a.digest)  # the registry serves a: the least recently used, but not evictable
    await get(cache, c)
    assert digests_on_disk(cache) == {a.digest, c.digest} and cache.stats.evictions == 1
    async with cache.acquire(c):  # c held (a load in progress), a in use: nothing can make room
        with pytest.raises(OverloadedError, match="lora_cache_full|in use or being fetched"):
            await get(cache, d)
    assert digests_on_disk(cache) == {a.digest, c.digest}
    in_use.clear()
    await get(cache, c)  # now c is the most recently used
    await get(cache, d)
    assert digests_on_disk(cache) == {c.digest, d.digest}


async def test_lru_order_survives_a_restart(cp, make_cache):
    a, b, c = (cp.publish(files(20 + i)) for i in range(3))
    cache = make_cache(max_bytes=int(4.5 * MiB))
    await get(cache, a)
    await get(cache, b)
    os.utime(cache.root / b.digest, (1, 1))  # b's last use long ago: a is the more recent
    cache.close()
    restarted = make_cache(max_bytes=int(4.5 * MiB))
    await get(restarted, c)
    assert digests_on_disk(restarted) == {a.digest, c.digest}


async def test_one_engine_per_cache_folder(make_cache):
    make_cache()
    with pytest.raises(CacheInUseError, match="in use by another engine process"):
        make_cache()
