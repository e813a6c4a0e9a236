"""ArtifactFetcher against a real HTTP server on loopback: the origin rule, the manifest check, and
per-file verification (tests/data_plane/adapters/artifacts/artifact_server.py serves what the control plane would)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from data_plane.adapters.artifacts.fetch import (
    ArtifactFetcher,
    ArtifactFetchError,
    ArtifactOrigins,
    origin_of,
)
from data_plane.adapters.loading.staging import TensorStage
from data_plane.background import BackgroundPace
from data_plane.lora.errors import LoRAAdapterError
from shared.artifacts import ArtifactRef, manifest_url
from shared.errors import PayloadTooLargeError
from tests.data_plane.adapters.artifacts.artifact_server import ArtifactServer, serve_artifacts

TOKEN = "engine-token-1"
# several MiB, so a file arrives in many reads and crosses the receiver's 1 MiB steps
FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": os.urandom(3 * (1 << 20) + 7)}


@pytest.fixture
def cp() -> Iterator[ArtifactServer]:
    with serve_artifacts() as server:
        yield server


@pytest.fixture
def elsewhere() -> Iterator[ArtifactServer]:
    """Another server on loopback: what an untrusted URL points at (it must never be asked anything)."""
    with serve_artifacts() as server:
        yield server


def fetcher_for(cp: ArtifactServer, *, store: str | None = None, max_bytes: int = 1 << 30,
                pace: BackgroundPace | None = None) -> ArtifactFetcher:
    return ArtifactFetcher(ArtifactOrigins(cp.url, store), TOKEN, max_bytes=max_bytes, read_timeout_s=5, pace=pace,
                          stage=TensorStage)


def as_bytes(contents: dict) -> dict[str, bytes]:
    """Received files as bytes (a large one arrives in an anonymous mapping, a small one in a bytearray)."""
    return {name: bytes(received.data) for name, received in contents.items()}


@pytest.fixture
async def fetcher(cp: ArtifactServer) -> AsyncIterator[ArtifactFetcher]:
    f = fetcher_for(cp)
    yield f
    await f.aclose()


async def test_fetch_verifies_every_file_in_memory_with_the_token(cp, fetcher):
    ref = cp.publish(FILES)
    manifest = await fetcher.manifest(ref)
    assert as_bytes(await fetcher.receive(manifest)) == FILES
    assert sorted(cp.paths()) == sorted([f"/v1/artifacts/{ref.digest}", *(f"/v1/artifacts/{ref.digest}/{n}" for n in FILES)])
    assert all(headers["authorization"] == f"Bearer {TOKEN}" for _, headers in cp.seen)


async def test_a_ref_given_as_a_path_is_fetched_from_the_engines_own_control_plane(cp, fetcher):
    ref = cp.publish(FILES)
    as_path = msgspec.structs.replace(ref, url=f"/v1/artifacts/{ref.digest}")  # no public URL configured
    assert as_bytes(await fetcher.receive(await fetcher.manifest(as_path))) == FILES
    assert cp.paths()[0] == f"/v1/artifacts/{ref.digest}"
    no_control_plane = ArtifactFetcher(ArtifactOrigins(None), TOKEN, max_bytes=1 << 30)
    try:
        with pytest.raises(LoRAAdapterError, match="not on a trusted origin"):
            await no_control_plane.manifest(as_path)
    finally:
        await no_control_plane.aclose()


def test_origins_compare_scheme_host_and_port():
    assert origin_of("HTTP://Example.com/x") == "http://example.com:80" == origin_of("http://example.com:80/y")
    assert origin_of("https://a.b") == "https://a.b:443"
    assert origin_of("file:///etc/passwd") is None and origin_of("not a url") is None
    origins = ArtifactOrigins("http://127.0.0.1:9000/prefix", "https://s3.local:9443")
    origins.check("http://127.0.0.1:9000/v1/artifacts/x", "artifact")
    origins.check("https://s3.local:9443/bucket/k?sig=1", "file")
    for url in ("http://127.0.0.1:9001/v1/artifacts/x", "https://127.0.0.1:9000/", "http://cp@evil.example:9000/",
                "http://localhost:9000/"):
        with pytest.raises(LoRAAdapterError, match="not on a trusted origin"):
            origins.check(url, "artifact")


async def test_an_untrusted_origin_is_refused_without_a_request(cp, elsewhere, fetcher):
    ref = elsewhere.publish(FILES)  # the same content, offered by a host the engine does not trust
    with pytest.raises(LoRAAdapterError, match="not on a trusted origin") as exc:
        await fetcher.manifest(ref)
    assert exc.value.code == "untrusted_artifact_origin" and exc.value.param == "artifact"
    assert elsewhere.seen == [] and cp.seen == []


async def test_a_manifest_pointing_files_elsewhere_is_refused_before_any_file(cp, elsewhere, fetcher):
    cp.presign_via = elsewhere  # the files' URLs lie on a host that is not the configured store
    ref = cp.publish(FILES)
    with pytest.raises(LoRAAdapterError, match="file adapter_config.json URL .* not on a trusted origin"):
        await fetcher.manifest(ref)
    assert elsewhere.seen == []
    assert cp.paths() == [f"/v1/artifacts/{ref.digest}"]


async def test_presigned_store_urls_get_no_token(cp, elsewhere):
    cp.presign_via = elsewhere  # now the configured store endpoint
    fetcher = fetcher_for(cp, store=elsewhere.url)
    try:
        ref = cp.publish(FILES)
        got = await fetcher.receive(await fetcher.manifest(ref))
    finally:
        await fetcher.aclose()
    assert as_bytes(got) == FILES
    assert len(elsewhere.seen) == len(FILES) and all("authorization" not in h for _, h in elsewhere.seen)
    assert cp.paths() == [f"/v1/artifacts/{ref.digest}"]  # bytes did not flow through the control plane


@pytest.mark.parametrize("served", [b"x" * len(FILES["adapter_model.safetensors"]),  # same size, other bytes
                                    FILES["adapter_model.safetensors"][:-1],  # one byte short
                                    FILES["adapter_model.safetensors"] + b"!"])  # one byte more
async def test_a_file_that_is_not_the_listed_one_is_a_checksum_mismatch(cp, fetcher, served):
    ref = cp.publish(FILES)
    cp.corrupt["adapter_model.safetensors"] = served
    manifest = await fetcher.manifest(ref)
    with pytest.raises(LoRAAdapterError, match="^checksum mismatch for adapter_model.safetensors") as exc:
        await fetcher.receive(manifest)
    assert exc.value.code == "checksum_mismatch" and exc.value.status_code == 400


async def test_a_manifest_for_another_digest_is_refused(cp, fetcher):
    ref = cp.publish(FILES)
    other = cp.publish({**FILES, "adapter_config.json": b"{}"})
    forged = ArtifactRef(digest=ref.digest, url=other.url)  # serves the other version
    with pytest.raises(LoRAAdapterError, match="checksum mismatch for the manifest"):
        await fetcher.manifest(forged)


async def test_redirects_are_not_followed(cp, elsewhere, fetcher):
    ref = cp.publish(FILES)
    cp.redirect_to = elsewhere.url
    with pytest.raises(LoRAAdapterError, match="answered 302 .redirects are not followed"):
        await fetcher.manifest(ref)
    assert elsewhere.seen == []


async def test_a_server_dying_mid_file_is_a_fetch_error(cp, fetcher):
    ref = cp.publish(FILES)
    cp.die_after["adapter_model.safetensors"] = 1 << 20
    manifest = await fetcher.manifest(ref)
    with pytest.raises(ArtifactFetchError, match="file adapter_model.safetensors .*body broke off after 1048576 bytes") as exc:
        await fetcher.receive(manifest)
    assert exc.value.status_code == 502


async def test_unknown_digest_and_oversized_versions_are_refused(cp):
    fetcher = fetcher_for(cp, max_bytes=1 << 20)
    try:
        missing = hashlib.sha256(b"nothing").hexdigest()
        with pytest.raises(LoRAAdapterError, match="answered 404"):
            await fetcher.manifest(ArtifactRef(digest=missing, url=manifest_url(cp.url, missing)))
        with pytest.raises(PayloadTooLargeError, match="--lora-cache-max-bytes 1048576"):
            await fetcher.manifest(cp.publish(FILES))
    finally:
        await fetcher.aclose()


def test_the_manifest_name_cannot_collide_with_an_artifact_file():
    from data_plane.adapters.artifacts.cache import MANIFEST_NAME
    from shared.artifacts import is_file_name

    assert not is_file_name(MANIFEST_NAME)




@pytest.mark.parametrize("names", [["adapter_config.json"], [*FILES, "README.md"]])
async def test_a_manifest_that_is_not_a_peft_version_is_refused_before_any_file(cp, fetcher, names):
    ref = cp.publish({n: FILES.get(n, b"# readme") for n in names})
    with pytest.raises(LoRAAdapterError, match="an adapter version is exactly adapter_config.json and "):
        await fetcher.manifest(ref)
    assert cp.paths() == [f"/v1/artifacts/{ref.digest}"]


async def test_a_download_rests_while_the_engine_is_busy_and_still_completes(cp):
    """While the engine has requests a download uses at most its share of a CPU, but it always finishes
    (an idle-class thread, tried before, never ran while the engine decoded)."""
    ref = cp.publish(FILES)
    busy = BackgroundPace(lambda: True, share=0.5)
    idle = BackgroundPace(lambda: False, share=0.5)
    for pace in (busy, idle):
        fetcher = fetcher_for(cp, pace=pace)
        try:
            assert as_bytes(await fetcher.receive(await fetcher.manifest(ref))) == FILES
        finally:
            await fetcher.aclose()
    assert busy.rested_s > 0 and idle.rested_s == 0


TRAVERSALS = ("/v1/artifacts/../v1/engines", "/v1/artifacts/%2e%2e/v1/engines", "/v1/artifacts/%2E./v1/engines",
              "/v1/artifacts/..%2fv1/engines", "/v1/artifacts/..%5cv1/engines", "/v1/artifacts/%252e%252e/v1/engines",
              "/v1/artifacts/./x", "/v1/engines", "/v1/tenancy/keys", "/v1/artifactsX/y", "/")


@pytest.mark.parametrize("path", TRAVERSALS)
async def test_control_plane_urls_outside_the_artifacts_path_are_refused_without_a_request(cp, fetcher, path):
    """The engine's token goes to the control plane only for `/v1/artifacts/…`: a push or a manifest naming
    another path on the control plane, directly or through `..` in any spelling, asks nothing of anyone."""
    ref = cp.publish(FILES)
    for url in (cp.url + path, path):  # absolute on the control plane's origin, or a path resolved against it
        with pytest.raises(LoRAAdapterError, match="segment|not under the control plane's /v1/artifacts/") as exc:
            await fetcher.manifest(msgspec.structs.replace(ref, url=url))
        assert exc.value.code == "untrusted_artifact_url" and exc.value.param == "artifact"
    assert cp.seen == []


async def test_a_manifest_pointing_files_at_other_control_plane_paths_is_refused_before_any_file(cp, fetcher):
    cp.presign_via = cp  # the files' URLs lie on the control plane's origin, outside /v1/artifacts/
    ref = cp.publish(FILES)
    with pytest.raises(LoRAAdapterError, match="file adapter_config.json URL .* not under the control plane's"):
        await fetcher.manifest(ref)
    assert cp.paths() == [f"/v1/artifacts/{ref.digest}"]


def test_artifact_paths_are_judged_as_sent_and_as_decoded():
    origins = ArtifactOrigins("http://127.0.0.1:9000/prefix", "https://s3.local:9443")
    for url in ("http://127.0.0.1:9000/v1/artifacts/a..b/c", "http://127.0.0.1:9000/prefix/v1/artifacts/d/f.json",
                "https://s3.local:9443/bucket/k?sig=1"):
        origins.check(url, "artifact")
    for url in ("https://s3.local:9443/bucket/../other", "http://127.0.0.1:9000/prefix/v1/engines",
                "http://127.0.0.1:9000/v1/artifacts%2f..%2fengines", "http://127.0.0.1:9000/v1%2fartifacts/x"):
        with pytest.raises(LoRAAdapterError) as exc:
            origins.check(url, "artifact")
        assert exc.value.code == "untrusted_artifact_url"
