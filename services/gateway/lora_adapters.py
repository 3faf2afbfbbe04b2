"""The cluster's LoRA adapters as the HTTP API serves them (docs/lora.md "The API", vLLM's names and answers):

- the `model` field of a request names the base model (--served-model-name) or an adapter (resolve_model): an
  adapter no live instance has loaded is a 404 naming it;
- POST /v1/load_lora_adapter {"lora_name", "lora_path"} loads an adapter on every live engine of the model
  (Instance.LoadLoRAAdapter, all at once); an engine refusing the directory undoes the load on the others and the
  answer is a 400 with the engine's reason, naming lora_path; a name the cluster has loaded already is a 400 (unload
  it first), as vLLM's, and so is the base model's name (requests naming it get the base model);
- POST /v1/unload_lora_adapter {"lora_name"} unloads it from every engine listing it; an unknown name is a 404.
Both are guarded by the gateway's API keys as every /v1 path (http_middleware.py). An instance started later, or
one that was down during the load, gets the adapter when routing first chooses it (placement.py).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tandem.services.channels import ChannelPool
from tandem.services.gateway.lora_routing import ClusterAdapter
from tandem.services.gateway.openai_errors import api_error
from tandem.services.gateway.openai_errors import APIError
from tandem.services.gateway.openai_protocol import Body
from tandem.services.gateway.router import Router
from tandem.services.grpc_errors import upstream_error
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.shared.errors import InvalidRequestError, NoInstanceError, UnknownLoRAError, UpstreamError
from tandem.shared.lora.request import LoRARequest
from tandem.v1 import common_pb2, common_pb2_grpc

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 120.0  # most seconds an engine may take to read an adapter


def adapter_named(model: str | None, base_name: str) -> str | None:
    """The LoRA adapter a request names (the HTTP API's `model`, the gRPC API's GenerateRequest.lora_name): None
    for the base model (no name, "" or base_name, its served name), else the name. The one place that decides."""
    return None if model in (None, "", base_name) else model


async def resolve_model(router: Router, base_name: str, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (adapter_named). APIError 404 naming the model when it names
    neither the base model nor an adapter of the cluster."""
    if adapter_named(model, base_name) is None:
        return None
    if model not in await router.adapters():
        raise APIError(404, f"the model {model!r} does not exist; this server serves {base_name!r} and the LoRA "
                            "adapters GET /v1/models lists", "model", "model_not_found")  # fmt: skip
    return model


class LoadLoRAAdapterRequest(Body):
    model_config = ConfigDict(extra="allow")  # (fields vLLM takes that we do not: refused by name)
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(Body):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None


class LoRAAdapters:
    """Loads and unloads adapters on the engines the router sees; channels: the gateway's, to the engines;
    base_name: the base model's served name (no adapter may take it)."""

    def __init__(self, router: Router, channels: ChannelPool, instance_id: str, base_name: str):
        self.router, self.channels, self.instance_id, self.base_name = router, channels, instance_id, base_name

    def routes(self) -> APIRouter:
        """The HTTP routes, for FastAPI.include_router."""
        routes = APIRouter()
        routes.add_api_route("/v1/load_lora_adapter", self.load_endpoint, methods=["POST"])
        routes.add_api_route("/v1/unload_lora_adapter", self.unload_endpoint, methods=["POST"])
        return routes

    async def load_endpoint(self, body: LoadLoRAAdapterRequest):
        _refuse_extra(body)
        for field in ("lora_name", "lora_path"):
            if not getattr(body, field):
                raise APIError(400, f"{field} is required: a load takes lora_name and lora_path", field)
        try:
            LoRARequest(body.lora_name, body.lora_path)
        except InvalidRequestError as e:
            raise APIError(400, f"lora_name: {e}", "lora_name") from None
        if adapter_named(body.lora_name, self.base_name) is None:  # (requests naming it get the base model)
            raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name; an adapter needs another",
                           "lora_name")  # fmt: skip
        if body.lora_name in await self.router.adapters():
            raise APIError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded (unload it first)",
                           "lora_name")  # fmt: skip
        try:
            await self.load(body.lora_name, body.lora_path)
        except InvalidRequestError as e:
            raise APIError(400, f"lora_path: {e}", "lora_path") from None
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_endpoint(self, body: UnloadLoRAAdapterRequest):
        _refuse_extra(body)
        if not body.lora_name:
            raise APIError(400, "lora_name is required: an unload takes the name the adapter was loaded as",
                           "lora_name")  # fmt: skip
        try:
            await self.unload(body.lora_name)
        except UnknownLoRAError as e:
            raise APIError(404, str(e), "lora_name", "model_not_found") from None
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def load(self, name: str, path: str) -> ClusterAdapter:
        """Load the adapter at path as name on every live engine (the module's docstring); the cluster's adapter.
        InvalidRequestError for a directory an engine refuses (with its reason); NoInstanceError when no engine is
        live; UpstreamError when none could be reached."""
        instances = await self._engines()
        results = await asyncio.gather(*(self._call(i, "LoadLoRAAdapter", common_pb2.LoadLoRAAdapterRequest(
            lora_name=name, lora_path=path)) for i in instances), return_exceptions=True)  # fmt: skip
        loaded = [(i, r) for i, r in zip(instances, results) if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, UpstreamError) and r.status == "INVALID_ARGUMENT"]
        errors = [r for r in results if isinstance(r, BaseException)]
        if refused or not loaded:
            await asyncio.gather(*(self._call(i, "UnloadLoRAAdapter", common_pb2.UnloadLoRAAdapterRequest(
                lora_name=name)) for i, _ in loaded), return_exceptions=True)  # (undone: no half-loaded adapter)
            error = (refused or errors)[0]
            if isinstance(error, UpstreamError) and error.status == "INVALID_ARGUMENT":
                raise InvalidRequestError(str(error).split(": ", 1)[-1]) from None  # (the engine's reason)
            raise error
        for instance, error in zip(instances, results):
            if isinstance(error, BaseException):
                log.warning("adapter %s not loaded on %s %s (routing loads it there when it chooses it): %s", name,
                            instance.tier, instance.instance_id, error)  # fmt: skip
        first = loaded[0][1].adapter
        adapter = ClusterAdapter(name, first.digest, first.path)
        for instance, reply in loaded:
            if reply.adapter.digest == adapter.digest:
                self.router.lora_changes.loaded(instance.instance_id, adapter)
        log.info("adapter %s (digest %s) loaded from %s on %d engines in %.0f ms at most", name, adapter.digest, path,
                 len(loaded), max(reply.load_ms for _, reply in loaded))  # fmt: skip
        return adapter

    async def unload(self, name: str) -> None:
        """Unload the adapter name from every live engine. UnknownLoRAError when the cluster has none of that name;
        UpstreamError when an engine holding it could not be reached."""
        if name not in await self.router.adapters():
            raise UnknownLoRAError(f"the LoRA adapter {name!r} cannot be found")
        results = await asyncio.gather(*(self._call(i, "UnloadLoRAAdapter", common_pb2.UnloadLoRAAdapterRequest(
            lora_name=name)) for i in await self._engines()), return_exceptions=True)  # fmt: skip
        self.router.lora_changes.unloaded(name)
        errors = [r for r in results if isinstance(r, BaseException)
                  and not (isinstance(r, UpstreamError) and r.status == "NOT_FOUND")]  # fmt: skip
        if errors:
            raise errors[0]
        log.info("adapter %s unloaded", name)

    async def _engines(self) -> list[InstanceInfo]:
        """Every live engine of the model, both tiers. NoInstanceError when there is none."""
        instances = []
        for tier in ("decode", "prefill"):
            instances += await self.router.registry.list_instances(tier, self.router.model_id)
        if not instances:
            raise NoInstanceError(f"no live instance is registered for model {self.router.model_id}")
        return instances

    async def _call(self, instance: InstanceInfo, method: str, message):
        """Instance.<method>(message) on instance; its failure as an UpstreamError naming it."""
        stub = common_pb2_grpc.InstanceStub(self.channels.get(instance.address, instance.instance_id))
        try:
            return await getattr(stub, method)(message, timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise upstream_error(e, instance.tier, instance.instance_id, f"{method} {message.lora_name}") from None


def _refuse_extra(body: BaseModel) -> None:
    extra = sorted(body.model_extra or ())
    if extra:
        raise APIError(400, f"{extra[0]} is not supported by this server", extra[0])
