"""LoRA adapters across the fleet: load, unload and list them (the service's adapter RPCs).

An adapter loads onto one worker when asked: the least loaded of those that serve adapters.
The router remembers its path, so any other worker loads it on demand the first time a request
for it is placed there (router.worker_client); workers report what they hold in their load
reports, so every router replica learns an adapter another one loaded. Unloading asks every
worker holding it, each of which waits for its in-flight requests under it to finish.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath

import grpc

from common.pb import generation_pb2 as pb
from router.errors import ApiError, invalid_argument
from router.fleet import Fleet

log = logging.getLogger("pagedserve.router")


class LoRAAdapters:
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def infos(self, parent: str) -> list[pb.LoRAAdapterInfo]:
        """Every adapter the fleet knows, as ModelInfo lists them."""
        return [pb.LoRAAdapterInfo(name=name, parent=parent, path=path, workers=len(holders))
                for name, (path, holders) in sorted(self._fleet.lora_adapters().items())]

    async def load(self, request: pb.LoadLoRAAdapterRequest, served_names: tuple[str, ...]
                   ) -> pb.LoadLoRAAdapterResponse:
        """Loads an adapter onto one worker; `served_names`: the base model's names, the first
        its adapters' parent."""
        if not request.lora_name:
            raise invalid_argument("lora_name is required", "lora_name")
        if not request.lora_path:
            raise invalid_argument("lora_path is required", "lora_path")
        if request.lora_name in served_names:
            # A request naming it would reach the base model; the adapter could never be used.
            raise invalid_argument(f"lora_name {request.lora_name!r} is the base model's name: an adapter "
                                   "needs a name of its own", "lora_name")
        known = self._fleet.lora_path(request.lora_name)
        # Compared as paths, not strings: "/a/b/" and "/a/./b" name the adapter at "/a/b".
        if known and posixpath.normpath(known) != posixpath.normpath(request.lora_path):
            # Workers holding the first would serve it under the name while others load the second.
            raise invalid_argument(f"LoRA adapter {request.lora_name!r} is already loaded from {known!r}; "
                                   "unload it before loading another adapter under its name", "lora_name")
        capable = [w for w in self._fleet.accepting() if w.serves_lora]
        if not capable:
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                           "no connected worker serves LoRA adapters (start workers with --enable-lora)")
        worker = min(capable, key=lambda w: (w.kv_usage, w.worker_id))
        try:
            adapter = await worker.load_lora(request.lora_name, request.lora_path)
        except grpc.aio.AioRpcError as error:
            raise ApiError(error.code(), error.details(),
                           field="lora_path" if error.code() == grpc.StatusCode.INVALID_ARGUMENT else None
                           ) from None
        self._fleet.lora_paths[request.lora_name] = request.lora_path
        log.info("LoRA adapter loaded", extra={"lora": request.lora_name, "path": request.lora_path,
                                               "worker": worker.worker_id, "rank": adapter.rank})
        return pb.LoadLoRAAdapterResponse(adapter=pb.LoRAAdapterInfo(
            name=request.lora_name, parent=served_names[0], path=request.lora_path, workers=1))

    async def unload(self, request: pb.UnloadLoRAAdapterRequest) -> pb.UnloadLoRAAdapterResponse:
        name = request.lora_name
        known = self._fleet.lora_adapters()
        if name not in known:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded; loaded: "
                           f"{', '.join(sorted(known)) or 'none'}", field="lora_name")
        # Forgotten here first, so no new request is placed on (or loads it onto) a worker.
        self._fleet.lora_paths.pop(name, None)
        holders = [w for w in self._fleet.workers.values() if w.holds_lora(name)]
        self._fleet.lora_unloading.add(name)
        try:
            results = await asyncio.gather(*(w.unload_lora(name) for w in holders), return_exceptions=True)
        finally:
            self._fleet.lora_unloading.discard(name)
        for worker, result in zip(holders, results):
            # NOT_FOUND: it was gone already (evicted from host memory); a lost worker holds nothing.
            if isinstance(result, grpc.aio.AioRpcError) and result.code() not in (
                    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise ApiError(result.code(), f"worker {worker.worker_id}: {result.details()}")
            if isinstance(result, BaseException) and not isinstance(result, grpc.aio.AioRpcError):
                raise result
        log.info("LoRA adapter unloaded", extra={"lora": name, "workers": len(holders)})
        return pb.UnloadLoRAAdapterResponse()
