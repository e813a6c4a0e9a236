"""VllmEngine: the `vllm` engine kind, over vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

- load: `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`; unload:
  `POST /v1/unload_lora_adapter {lora_name}` (404: not loaded);
- listing: `GET /v1/models`: the entry without `parent` is the base model (its `max_model_len`, its
  `root` folder), every entry whose `parent` is it an adapter (its `root`: the folder it was loaded from);
- figures: `GET /metrics`: `vllm:lora_requests_info`, whose labels name the adapters with requests running
  and waiting and `max_lora` (the newest sample: it is a gauge set to the time of each update, and it appears
  once a request was served); requests (`vllm:request_success_total` by `finished_reason`) and tokens
  (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`) by `model_name`; `process_start_time_seconds`
  of the API server, which changes when vLLM restarts;
- health: `GET /health` answers 200.

Each call has one deadline (`timeout_s`) for the whole answer and a cap on its size; redirects are not
followed; an error is reported as status plus vLLM's message, sanitized and bounded (shared.sanitize).
With `api_key` (vLLM's --api-key) every call carries it as a bearer token.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from data_plane.agent.kind import EngineCallFailed, Figures, Served
from shared.sanitize import reply_reason, safe_url, sanitize

MAX_BODY_BYTES = 8 << 20  # a /metrics of a busy server stays far below this


class _Model(msgspec.Struct):
    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class _Models(msgspec.Struct):
    data: list[_Model]


class VllmEngine:
    def __init__(self, url: str, *, timeout_s: float, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Accept-Encoding": "identity"}  # the size cap counts what is read
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, follow_redirects=False, trust_env=False,
                                       timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
                                       transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def load(self, name: str, folder: Path, inplace: bool) -> None:
        body = {"lora_name": name, "lora_path": str(folder), "load_inplace": inplace}
        status, raw = await self._call("POST", "/v1/load_lora_adapter", body)
        if status != 200:
            raise EngineCallFailed(f"vLLM refused to load {name}: {reply_reason(status, raw)}")

    async def unload(self, name: str) -> bool:
        status, raw = await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if status == 404:
            return False
        if status != 200:
            raise EngineCallFailed(f"vLLM refused to unload {name}: {reply_reason(status, raw)}")
        return True

    async def listing(self) -> Served:
        models = self._decode(await self._ok("GET", "/v1/models"), _Models).data
        base = next((m for m in models if m.parent is None), None)
        if base is None:
            raise EngineCallFailed("vLLM GET /v1/models lists no base model")
        adapters = {m.id: m.root or "" for m in models if m.parent is not None}
        return Served(base_model=base.id, max_model_len=base.max_model_len, model_path=base.root, adapters=adapters)

    async def stats(self) -> Figures:
        text = (await self._ok("GET", "/metrics")).decode("utf-8", errors="replace")
        try:
            return _figures(text)
        except (ValueError, TypeError, IndexError) as exc:
            raise EngineCallFailed(f"vLLM GET /metrics is not a Prometheus exposition ({sanitize(str(exc), 120)})") \
                from None

    async def health(self) -> str | None:
        try:
            status, raw = await self._call("GET", "/health")
        except EngineCallFailed as exc:
            return exc.message
        return None if status == 200 else f"vLLM /health: {reply_reason(status, raw)}"

    async def _ok(self, method: str, path: str) -> bytes:
        status, raw = await self._call(method, path)
        if status != 200:
            raise EngineCallFailed(f"vLLM {method} {path}: {reply_reason(status, raw)}")
        return raw

    @staticmethod
    def _decode(raw: bytes, kind: type[Any]) -> Any:
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise EngineCallFailed(f"vLLM gave an invalid reply ({sanitize(str(exc), 120)})") from None

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body) of one call within the deadline; EngineCallFailed when there is no answer."""
        where = f"vLLM {method} {safe_url(self.url)}{path}"
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http.stream(method, path, json=body) as r:
                    chunks, size = [], 0
                    async for chunk in r.aiter_raw():
                        size += len(chunk)
                        if size > MAX_BODY_BYTES:
                            raise EngineCallFailed(f"{where}: the reply exceeds {MAX_BODY_BYTES} bytes")
                        chunks.append(chunk)
                    return r.status_code, b"".join(chunks)
        except TimeoutError:
            raise EngineCallFailed(f"{where}: no complete answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise EngineCallFailed(f"{where}: {type(exc).__name__} {sanitize(str(exc), 120)}".rstrip()) from None


def _figures(text: str) -> Figures:
    lora: tuple[float, dict[str, str]] | None = None  # the newest sample of vllm:lora_requests_info
    requests: defaultdict[str, dict[str, int]] = defaultdict(dict)
    prompt: dict[str, int] = {}
    generated: dict[str, int] = {}
    started = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            model = labels.get("model_name")
            if sample.name == "vllm:lora_requests_info" and (lora is None or value >= lora[0]):
                lora = (value, labels)
            elif sample.name == "vllm:request_success_total" and model is not None:
                outcome = labels.get("finished_reason", "unknown")
                requests[model][outcome] = requests[model].get(outcome, 0) + int(value)
            elif sample.name == "vllm:prompt_tokens_total" and model is not None:
                prompt[model] = prompt.get(model, 0) + int(value)
            elif sample.name == "vllm:generation_tokens_total" and model is not None:
                generated[model] = generated.get(model, 0) + int(value)
            elif sample.name == "process_start_time_seconds":
                started = value
    labels = lora[1] if lora is not None else {}
    max_lora = labels.get("max_lora", "")
    return Figures(running=_names(labels.get("running_lora_adapters", "")),
                   waiting=_names(labels.get("waiting_lora_adapters", "")),
                   max_loras=int(max_lora) if max_lora.isdigit() else None,
                   requests=dict(requests), prompt_tokens=prompt, generated_tokens=generated, started_at=started)


def _names(label: str) -> frozenset[str]:
    return frozenset(n for n in label.split(",") if n)
