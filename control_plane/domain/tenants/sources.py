"""Where a tenant's own admin keys may load adapters from: the tenant's `sources`, set by an operator.

A key with `admin:<tenant>` may always upload its own files (POST /v1/lora_adapters/{name}/versions). A
load's `lora_path` is read with the control plane's own file system, credentials and network, so from
such a key it is accepted only under one of its tenant's sources: otherwise 403, the same answer whether
or not anything lies there, given before anything is read. Admin tokens are not confined. A source is

- a folder, `/abs/path` or `file:///abs/path`: the lora_path, resolved (symlinks, `..`, `~`), must lie
  under the source, resolved too, and under --lora-roots as every load's must; so must each of its files;
- a URL prefix, `s3://bucket/prefix` (`gs://`, `az://` alike): the same scheme and host (lower-cased) and
  a path whose segments begin with the prefix's (`s3://b/team-a` does not cover `s3://b/team-ab/x`);
- `hf://org` (its repositories), `hf://org/name` (any revision) or `hf://org/name@revision` (that one;
  a lora_path without a revision reads `main`).

Sources, and URL lora_paths from tenant keys, may not hold `.`/`..` or empty segments, an encoded `/`,
credentials, a query or a fragment (400).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from control_plane.artifacts.sources import OBJECT_STORE_SCHEMES, is_object_store_url, local_path, split_url
from shared.errors import InvalidRequestError, PermissionDeniedError
from shared.peft import resolve_under_roots

MAX_SOURCES = 32
_FORMS = "an absolute folder (/path or file:///path) or a URL prefix (s3://, gs://, az://, hf://org[/name[@revision]])"


@dataclass(frozen=True)
class _Prefix:
    """A URL as compared: scheme, host, path segments (as sent, each checked decoded too), revision."""

    scheme: str
    host: str
    segments: tuple[str, ...]
    revision: str | None = None  # hf:// only

    def covers(self, other: _Prefix) -> bool:
        return ((self.scheme, self.host) == (other.scheme, other.host)
                and other.segments[:len(self.segments)] == self.segments
                and (self.revision is None or self.revision == other.revision))

    def __str__(self) -> str:
        path = "".join("/" + s for s in self.segments)
        return f"{self.scheme}://{self.host}{path}" + (f"@{self.revision}" if self.revision else "")


def _segments(path: str, what: str, param: str) -> tuple[str, ...]:
    inner = path.removeprefix("/").removesuffix("/")
    segments = tuple(inner.split("/")) if inner else ()
    for s in segments:
        plain = unquote(s)
        if not s or plain in (".", "..") or "/" in plain or "\\" in plain or "\0" in plain:
            raise InvalidRequestError(f"{what} may not hold empty, '.' or '..' segments nor an encoded '/'",
                                      param=param)
    return segments


def _url(text: str, param: str, *, load: bool) -> _Prefix:
    """A URL prefix (a source) or a URL lora_path (`load`: an hf:// one without a revision reads main)."""
    what = "a source" if param == "sources" else "a tenant key's lora_path"
    parts = split_url(text, param)
    if parts.query or parts.fragment or "@" in parts.netloc or not parts.netloc:
        raise InvalidRequestError(f"{what} is scheme://host/path: no credentials, query or fragment", param=param)
    scheme, host, path, revision = parts.scheme, parts.netloc.lower(), parts.path, None
    if scheme == "hf":
        host = parts.netloc  # the organisation, as the Hub spells it
        path, at, revision = path.rstrip("/").partition("@")  # as hub_url reads it
        if at and (not revision or "/" in revision or not path.strip("/")):
            raise InvalidRequestError(f"{what} reads hf://org, hf://org/name or hf://org/name@revision", param=param)
        revision = revision or ("main" if load else None)
    segments = _segments(path, what, param)
    if scheme == "hf" and len(segments) > 1:
        raise InvalidRequestError(f"{what} reads hf://org, hf://org/name or hf://org/name@revision", param=param)
    return _Prefix(scheme, host, segments, revision)


def _folder(text: str) -> str:
    path = local_path(text, param="sources") if text.startswith("file://") else text
    if not path.startswith("/"):
        raise InvalidRequestError(f"a source is {_FORMS}, not {text[:80]!r}", param="sources")
    segments = [s for s in path.split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise InvalidRequestError("a folder source may not hold '.' or '..' segments", param="sources")
    return "/" + "/".join(segments)


def normalise(sources: list[str]) -> list[str]:
    """The sources as stored and shown (each in one spelling, duplicates dropped); 400 for a bad one."""
    out: list[str] = []
    for text in sources:
        if "\0" in text:
            raise InvalidRequestError("a source may not contain a NUL byte", param="sources")
        scheme = split_url(text, "sources").scheme if "://" in text else ""
        if scheme and scheme != "file" and scheme not in OBJECT_STORE_SCHEMES:
            raise InvalidRequestError(f"a source is {_FORMS}, not {scheme}://", param="sources")
        canonical = str(_url(text, "sources", load=False)) if scheme in OBJECT_STORE_SCHEMES else _folder(text)
        if canonical not in out:
            out.append(canonical)
    if len(out) > MAX_SOURCES:
        raise InvalidRequestError(f"a tenant has at most {MAX_SOURCES} sources", param="sources")
    return out


def _refused(tenant: str, sources: list[str]) -> PermissionDeniedError:
    how = (f"an operator (admin token) must set the tenant's sources: `loraplane tenants update {tenant} "
           f"--source PREFIX …` or PATCH /v1/tenants/{tenant} {{\"sources\": [\"PREFIX\", …]}}")
    upload = "POST /v1/lora_adapters/{name}/versions"
    if not sources:
        return PermissionDeniedError(f"tenant {tenant!r} has no sources: its admin keys may upload adapter files "
                                     f"({upload}) but not load a server path or URL. To allow that, {how}",
                                     param="lora_path")
    return PermissionDeniedError(f"lora_path is not under any source of tenant {tenant!r} ({', '.join(sources)}). "
                                 f"Upload the files instead ({upload}); to load from there, {how}", param="lora_path")


def confine(lora_path: str, sources: list[str], roots: tuple[str, ...], tenant: str) -> tuple[str, ...]:
    """For a tenant key's load: the adapter roots its folder (and each file) must lie under, the overlap
    of the tenant's folder sources with `roots`; 403 when lora_path is under none of its sources.
    Blocking (paths are resolved): call it off the event loop."""
    urls = [s for s in sources if is_object_store_url(s)]
    if is_object_store_url(lora_path):
        wanted = _url(lora_path, "lora_path", load=True)
        if not any(_url(s, "sources", load=False).covers(wanted) for s in urls):
            raise _refused(tenant, sources)
        return roots
    folders = [_resolved(s) for s in sources if s not in urls]
    within = [f for f in folders if f is not None]
    if resolve_under_roots(local_path(lora_path), [str(f) for f in within]) is None:
        raise _refused(tenant, sources)
    overlap: list[str] = []
    for source in within:
        for root in filter(None, map(_resolved, roots)):
            deeper = source if source.is_relative_to(root) else root if root.is_relative_to(source) else None
            if deeper is not None and str(deeper) not in overlap:
                overlap.append(str(deeper))
    return tuple(overlap) or roots  # none: the folder is outside every root, and the load says so


def _resolved(folder: str) -> Path | None:
    try:
        return Path(folder).expanduser().resolve()
    except (RuntimeError, OSError, ValueError):
        return None
