"""Which adapters a tenant key may use: the control plane's access table, polled every refresh interval.

A key may use the base models, its tenant's adapters and public adapters; anything else is answered
404 exactly like a model that does not exist, so a private adapter's existence does not leak. The
table (GET /v1/tenancy/adapters) is kept when the control plane is down, like the routing table.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from shared.tenants import ACCESS_PATH, AccessTable, AdapterAccess

logger = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(AccessTable)


class AdapterAccessTable:
    def __init__(self, client: httpx.AsyncClient, interval_s: float) -> None:
        self.client = client
        self.interval_s = interval_s
        self.adapters: dict[str, AdapterAccess] = {}
        self.loaded = False
        self._failing = False

    def may_use(self, tenant: str, model: str, is_base: bool) -> bool:
        if is_base:
            return True
        entry = self.adapters.get(model)
        return entry is not None and (entry.public or entry.owner == tenant)

    async def refresh(self) -> bool:
        try:
            response = await self.client.get(ACCESS_PATH)
            if response.status_code != 200:
                raise httpx.HTTPStatusError(f"status {response.status_code}", request=response.request,
                                            response=response)
            table = _decoder.decode(response.content)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            if not self._failing:
                logger.warning("cannot read the adapter access table (%s); keeping the last one", exc)
                self._failing = True
            return False
        self.adapters = {a.name: a for a in table.adapters}
        self.loaded, self._failing = True, False
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
