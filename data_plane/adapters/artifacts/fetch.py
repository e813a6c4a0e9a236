"""Fetch an adapter version named by content (shared.artifacts.ArtifactRef) and verify every byte of it.

The rules, in the order they are applied:
1. Origins. A URL is fetched only when its origin (scheme, host, port) is the engine's control plane
   (--control-plane) or the configured artifact store endpoint (--lora-artifact-endpoint, for
   presigned object-store URLs). Anything else is refused before a request is made: a body cannot
   make the engine fetch from (or send its token to) another host. Redirects are never followed.
   On the control plane's origin a URL must lie under its `/v1/artifacts/` (at the root or under the
   --control-plane URL's path), so the engine's token fetches artifacts and nothing else; a `.` or `..`
   segment, in any spelling (`%2e%2e`, `..%2f`, a backslash, encoded twice), is refused on every origin.
2. The manifest (`GET ref.url`, with the engine's control-plane token when it goes to the control
   plane) must be the version the push named (`manifest.digest == ref.digest`) and its files must hash
   to that digest (`manifest_matches`): a manifest cannot vouch for itself.
3. Each file is streamed (from its presigned `url`, or the control plane's `file_url`) into memory,
   hashed as it arrives; more bytes than listed, fewer, or another sha256 refuse the load with
   `checksum mismatch for <name>`. The caller (cache.py) gets only versions whose every file
   passed, writes the cache's copy and hands the loader these very bytes.

Bounds: one total deadline per version, a per-read timeout (a stalled server), the manifest's own size,
its files (exactly a PEFT version's two), and the version's size (the cache's capacity: a bigger one
could never be kept; it is also what a fetch holds in memory).
The files are downloaded and hashed concurrently, each in a low-priority thread of its own that rests
while the engine is busy (download.py: the stdlib client reading into the file's buffer, the GIL
released for the copies; `pace`), so the event loop and the engine's step thread keep their pace while
it runs; the small manifest comes over httpx on the loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpx
import msgspec

from data_plane.adapters.artifacts.download import (
    Download,
    DownloadProblem,
    Received,
    StageFactory,
    as_error,
    download,
    status_problem,
)
from data_plane.background import BackgroundPace, fetch_off_loop
from shared.artifacts import (
    ARTIFACTS_PATH,
    ArtifactFile,
    ArtifactManifest,
    ArtifactRef,
    file_url,
    manifest_matches,
)
from shared.errors import LoraplaneError, PayloadTooLargeError
from shared.peft import CONFIG_NAME, WEIGHTS_NAME, AdapterFilesError

FETCH_TIMEOUT_S = 600.0  # one whole version (manifest and every file)
READ_TIMEOUT_S = 30.0  # connect, or one read: a server that stops sending
MAX_MANIFEST_BYTES = 1 << 20
MAX_LISTED = 8  # file names quoted in a refusal
# a PEFT LoRA version, as the loader reads and digests it (shared.peft)
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MAX_DECODINGS = 4  # percent-decoding rounds a path gets before it is judged (more is refused)


class ArtifactFetchError(LoraplaneError):
    """The artifact could not be fetched right now (unreachable, 5xx, timeout, local disk): worth a retry,
    unlike the refusals (AdapterFilesError, 400), which name what is wrong with the artifact itself."""

    status_code = 502
    error_type = "artifact_unavailable"


def refusal(message: str, code: str) -> AdapterFilesError:
    return AdapterFilesError(message, param="artifact", code=code)


def origin_of(url: str) -> str | None:
    """`scheme://host:port` (lower case, default port filled in) of an http(s) URL; None for anything else."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    if u.scheme not in _DEFAULT_PORTS or not u.host:
        return None
    return f"{u.scheme}://{u.host}:{u.port or _DEFAULT_PORTS[u.scheme]}"


@dataclass(frozen=True)
class ArtifactOrigins:
    """Where artifacts may come from: the control plane (base URL, may carry a path prefix) and the store."""

    control_plane: str | None  # the engine's --control-plane URL
    store: str | None = None  # --lora-artifact-endpoint: presigned object-store URLs lie here

    def trusted(self) -> list[str]:
        return [o for o in (origin_of(u) for u in (self.control_plane, self.store) if u) if o is not None]

    def check(self, url: str, what: str) -> None:
        origin = origin_of(url)
        if origin is None or origin not in self.trusted():
            trusted = ", ".join(self.trusted()) or "none configured: start the engine with --control-plane"
            raise refusal(
                f"{what} URL {_shown(url)} is not on a trusted origin; artifacts are fetched only from the "
                f"engine's control plane or its artifact store endpoint ({trusted}); nothing was fetched",
                "untrusted_artifact_origin")
        path = _decoded_path(url)
        if path is None:
            raise refusal(f"{what} URL {_shown(url)} has a `.` or `..` segment (or an encoding of one); artifact "
                          "URLs are plain paths; nothing was fetched", "untrusted_artifact_url")
        if self.is_control_plane(url) and not self._under_artifacts(url, path):
            raise refusal(f"{what} URL {_shown(url)} is not under the control plane's {ARTIFACTS_PATH}/; the engine "
                          f"fetches nothing else from it; nothing was fetched", "untrusted_artifact_url")

    def _under_artifacts(self, url: str, decoded: str) -> bool:
        """Both the path as sent and as decoded lie under `<root or --control-plane path>/v1/artifacts/`,
        or under the store endpoint's path when the store shares the control plane's origin."""
        assert self.control_plane is not None
        base = urlsplit(self.control_plane).path.rstrip("/")
        prefixes = {f"{ARTIFACTS_PATH}/", f"{base}{ARTIFACTS_PATH}/"}
        if self.store and origin_of(self.store) == origin_of(url):
            prefixes.add(urlsplit(self.store).path.rstrip("/") + "/")
        raw = urlsplit(url).path
        return any(raw.startswith(p) and decoded.startswith(p) for p in prefixes)

    def resolve(self, url: str) -> str:
        """A path (`/v1/artifacts/…`: what the control plane sends unless it was told its public URL) lies
        on the engine's own control plane; an absolute URL stays as it is (and must pass `check`)."""
        if url.startswith("/") and not url.startswith("//") and self.control_plane:
            return self.control_plane.rstrip("/") + url
        return url

    def is_control_plane(self, url: str) -> bool:
        return self.control_plane is not None and origin_of(url) == origin_of(self.control_plane)


class ArtifactFetcher:
    """Fetches manifests and files over one httpx client (open until `aclose`). `stage`: made for the
    weights file's bytes as they arrive (the engine's host copy: loading/staging.py), if given."""

    def __init__(
        self, origins: ArtifactOrigins, token: str | None, *, max_bytes: int, timeout_s: float = FETCH_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S, on_bytes: Callable[[int], None] | None = None,
        pace: BackgroundPace | None = None, stage: StageFactory | None = None,
    ) -> None:
        self.origins = origins
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self._on_bytes = on_bytes  # bytes received (metrics)
        self.pace = pace if pace is not None else BackgroundPace()  # downloads rest while the engine is busy
        self.stage = stage
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        # identity: sizes are checked against the bytes as stored; never follow a redirect elsewhere
        self._http = httpx.AsyncClient(timeout=read_timeout_s, follow_redirects=False, trust_env=False,
                                       headers={"accept-encoding": "identity"})

    async def aclose(self) -> None:
        await self._http.aclose()

    def check(self, ref: ArtifactRef) -> None:
        """The origin rule for the push's URL: refused before anything is asked of anyone."""
        self.origins.check(self.origins.resolve(ref.url), "artifact")

    async def manifest(self, ref: ArtifactRef) -> ArtifactManifest:
        """The version's manifest, checked to be the version `ref` names (and its file URLs trusted)."""
        self.check(ref)
        ref = msgspec.structs.replace(ref, url=self.origins.resolve(ref.url))
        async with self._deadline(f"the manifest of {ref.digest[:16]}…"):
            manifest = await self._get_manifest(ref)
        for f in manifest.files:  # every URL checked before the first byte of a file is fetched
            self.origins.check(self._file_url(manifest, f), f"file {f.name}")
        return manifest

    async def _get_manifest(self, ref: ArtifactRef) -> ArtifactManifest:
        raw = bytearray()
        async with self._stream(ref.url, "manifest") as r:
            async for chunk in r.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_MANIFEST_BYTES:
                    raise refusal(f"the manifest of {ref.digest[:16]}… is larger than {MAX_MANIFEST_BYTES} bytes",
                                  "bad_manifest")
        try:
            manifest = msgspec.json.decode(bytes(raw), type=ArtifactManifest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise refusal(f"the manifest of {ref.digest[:16]}… is not valid ({str(exc)[:200]})", "bad_manifest") \
                from None
        if manifest.digest != ref.digest or not manifest_matches(manifest):
            raise refusal(f"checksum mismatch for the manifest of {ref.digest[:16]}…: its files are not the "
                          "version the load names; nothing was loaded", "checksum_mismatch")
        names = sorted(f.name for f in manifest.files)
        if names != sorted(ADAPTER_FILES):  # what the loader reads and digests: any other file would never match
            raise refusal(f"the manifest of {ref.digest[:16]}… lists {', '.join(names[:MAX_LISTED]) or 'no files'}; an "
                          f"adapter version is exactly {' and '.join(ADAPTER_FILES)}", "bad_manifest")
        if manifest.size_bytes > self.max_bytes:
            raise PayloadTooLargeError(
                f"adapter {ref.digest[:16]}… is {manifest.size_bytes} bytes, more than the engine's LoRA cache "
                f"holds (--lora-cache-max-bytes {self.max_bytes})", param="artifact", code="artifact_too_large")
        return manifest

    async def receive(self, manifest: ArtifactManifest) -> dict[str, Received]:
        """Every file of `manifest` (name -> bytes), each verified against its size and sha256; the weights
        also staged as they arrived (`stage`: copied into the host layout), for the loader to adopt."""
        deadline = time.monotonic() + self.timeout_s  # the threads stop on their own by then too
        async with self._deadline(f"adapter {manifest.digest[:16]}…"):
            tasks = [asyncio.ensure_future(self._download_file(manifest, f, deadline)) for f in manifest.files]
            try:
                contents = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # the first refusal stops the other files' downloads too
                    task.cancel()
                done = await asyncio.gather(*tasks, return_exceptions=True)
                for received in done:  # a file verified before another failed: its stage is unused
                    if isinstance(received, Received) and received.stage is not None:
                        received.stage.discard()
                raise
        return {f.name: data for f, data in zip(manifest.files, contents, strict=True)}

    @asynccontextmanager
    async def _deadline(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except TimeoutError:
            raise ArtifactFetchError(f"{what} was not fetched within {self.timeout_s:g} s", param="artifact") \
                from None

    def _file_url(self, manifest: ArtifactManifest, f: ArtifactFile) -> str:
        if f.url is not None:
            return f.url
        if self.origins.control_plane is None:
            raise refusal(f"file {f.name} has no URL and the engine has no --control-plane to fetch it from",
                          "untrusted_artifact_origin")
        return file_url(self.origins.control_plane, manifest.digest, f.name)

    async def _download_file(self, manifest: ArtifactManifest, f: ArtifactFile, deadline: float) -> Received:
        url = self._file_url(manifest, f)
        job = Download(url=url, headers=self._auth if self.origins.is_control_plane(url) else {}, file=f,
                       where=f"file {f.name} at {_shown(url)}", read_timeout_s=self.read_timeout_s,
                       deadline=deadline, pace=self.pace, stage=self.stage if f.name == WEIGHTS_NAME else None)
        cancelled = threading.Event()
        try:
            return await fetch_off_loop(download, job, cancelled, self._on_bytes)
        except DownloadProblem as problem:
            raise as_error(problem, ArtifactFetchError) from None
        finally:
            cancelled.set()  # a cancelled await leaves the thread running: it stops before its next read

    @asynccontextmanager
    async def _stream(self, url: str, what: str) -> AsyncIterator[httpx.Response]:
        """A streamed 200 response; any other answer is a refusal (final) or a fetch error (retry)."""
        where = f"{what} at {_shown(url)}"
        headers = self._auth if self.origins.is_control_plane(url) else {}  # the token goes nowhere else
        try:
            async with self._http.stream("GET", url, headers=headers) as r:
                problem = status_problem(r.status_code, where)
                if problem is not None:
                    raise as_error(problem, ArtifactFetchError)
                yield r
        except httpx.HTTPError as exc:  # connect, read timeout, or the body broke off (the server died)
            raise ArtifactFetchError(f"{where}: {type(exc).__name__}", param="artifact") from None


def _decoded_path(url: str) -> str | None:
    """The URL's path, percent-decoded until it no longer changes, with `\\` read as `/`; None when any
    spelling of it holds a `.` or `..` segment (or it is encoded more deeply than anyone needs)."""
    path = urlsplit(url).path
    for _ in range(_MAX_DECODINGS):
        if any(segment in (".", "..") for segment in path.replace("\\", "/").split("/")):
            return None
        decoded = unquote(path)
        if decoded == path:
            return path
        path = decoded
    return None


def _shown(url: str) -> str:
    """A URL for a message: without its query (a presigned URL's query is a credential), bounded."""
    base = url.split("?", 1)[0]
    return repr(base[:200] + ("…" if len(base) > 200 else ""))
