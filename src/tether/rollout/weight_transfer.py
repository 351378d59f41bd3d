"""Weights to served vLLM engines through vLLM's own weight-transfer protocol (``rollout.engine.kind=vllm_server``).

vLLM 0.32 splits a weight update into a trainer engine (``TrainerWeightTransferEngine``, built by
``WeightTransferTrainerFactory.trainer_init``, one ``send_weights()`` per update) and a worker engine in every
server process (``WeightTransferEngine``, chosen by the server's ``--weight-transfer-config '{"backend": ...}'``),
driven over the server's HTTP routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``; mounted with ``VLLM_SERVER_DEV_MODE=1``). tether writes no wire
protocol of its own; it supplies three pieces:

* `policy_source`: the policy's weights as vLLM's ``WeightSource`` (LoRA merged into copies, the tied head
  included, FSDP2 shards gathered: `tether.rollout.vllm.named_weights`, the stream `VLLMEngine.sync_weights`
  sends in process), gathered on every trainer rank before rank 0 sends them.
* `FanoutClient`: vLLM's ``VLLMWeightSyncClient`` protocol over several servers at once (each call posted to
  every server concurrently, each server given its own rank offset in the transfer group), with the servers'
  API key.
* the **gloo** backend (`GlooWeightTransferEngine` in the server, `GlooTrainerEngine` in the trainer): vLLM's
  own backends (nccl, ipc, ...) all need CUDA, so on CPU the same protocol runs over a gloo broadcast: the
  trainer is rank 0 of a stateless gloo group (a TCP rendezvous at ``master_address:master_port``), each server
  worker joins at ``rank_offset + its rank``, and every tensor is broadcast from rank 0 and loaded with the
  model's ``load_weights`` inside vLLM's layerwise reload (which re-runs each layer's post-load processing, e.g.
  the CPU GEMM packing). The server loads it through vLLM's extension point: `register` is a
  ``vllm.general_plugins`` entry point (pyproject.toml), run in every vLLM process, which adds the backend to
  ``WeightTransferEngineFactory``; the trainer side is registered in ``WeightTransferTrainerFactory`` here.

This module imports vLLM: it is loaded only where the served engine runs (the ``.venv-vllm`` environment), or by
vLLM itself through the plugin.
"""

from __future__ import annotations

import threading
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Iterator

import torch

GLOO = "gloo"  # the backend's name in vLLM's registries and in --weight-transfer-config
_ENGINES: dict = {}  # the classes below, made at first use (they subclass vLLM's: vLLM is imported lazily)
_LOCK = threading.Lock()


# ------------------------------------------------------------------ the policy as vLLM's WeightSource


def policy_source(weights: list[tuple[str, torch.Tensor]], cpu: bool = False):
    """The policy's weights as vLLM's ``WeightSource``: ``weights`` is the list of `tether.rollout.vllm.named_weights`
    (LoRA merged into copies, the tied head, FSDP2 shards gathered: every trainer rank materializes it together,
    since gathering a shard is a collective, then the sender sends from it), each tensor contiguous, and on the CPU
    when ``cpu`` (the gloo backend). Assign ``.weights`` for the next round."""
    with _LOCK:
        if "source" not in _ENGINES:
            from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

            class PolicySource(WeightSource):
                def __init__(self, weights, cpu: bool):
                    self.weights, self.cpu = weights, cpu

                def metadata(self):
                    return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights]

                def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                    for name, t in self.weights:
                        t = t.contiguous()
                        yield name, (t.cpu() if self.cpu else t)

            _ENGINES["source"] = PolicySource
    return _ENGINES["source"](weights, cpu)


# ------------------------------------------------------------------ the HTTP control routes, on every server


class WeightRouteError(RuntimeError):
    """A weight-transfer route of a server failed; the message names the server, the route and its answer."""


def post_json(url: str, path: str, body: Any = None, *, api_key: str = "", timeout: float = 300.0) -> Any:
    """POST ``body`` as JSON to ``url + path``; the decoded JSON answer (None when empty). Any failure is a
    `WeightRouteError` naming the server and the route (vLLM's own error text included)."""
    from ..userio import loads_json  # deferred, as vLLM's servers import this module as their plugin
    from .servers import http_request

    try:
        raw = http_request("POST", url.rstrip("/") + path, body, api_key=api_key, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace").strip()[:500]
        raise WeightRouteError(f"server {url}: {path} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise WeightRouteError(f"server {url}: {path} failed: {getattr(e, 'reason', e)}") from None
    if not raw.strip():
        return None
    try:
        return loads_json(raw.decode("utf-8"))
    except ValueError:
        return raw.decode("utf-8", "replace")


class FanoutClient:
    """vLLM's ``VLLMWeightSyncClient`` over every server: each call goes to all of them at once (the transfer is
    one collective, so their ``/update_weights`` must be in flight together), in threads; the first failure is
    raised, naming its server.

    ``world_sizes[i]``: server i's workers in the transfer group (``/get_world_size``); server i's workers take
    the ranks after rank 0 (the trainer) and the servers before it."""

    def __init__(self, urls: list[str], world_sizes: list[int], *, api_key: str = "", timeout: float = 300.0):
        self.urls, self.world_sizes, self.api_key, self.timeout = list(urls), list(world_sizes), api_key, timeout
        self.offsets = [1 + sum(self.world_sizes[:i]) for i in range(len(self.urls))]

    @property
    def world_size(self) -> int:
        """The transfer group: the trainer and every server's workers."""
        return 1 + sum(self.world_sizes)

    def _all(self, path: str, bodies: list) -> list:
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = [pool.submit(post_json, u, path, b, api_key=self.api_key, timeout=self.timeout)
                       for u, b in zip(self.urls, bodies)]
            return [f.result() for f in futures]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("/init_weight_transfer_engine",
                  [{"init_info": {**init_info, "rank_offset": off}} for off in self.offsets])

    def start_weight_update(self) -> None:
        self._all("/start_weight_update", [None] * len(self.urls))

    def update_weights(self, update_info) -> None:
        self._all("/update_weights", [{"update_info": update_info}] * len(self.urls))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._all("/finish_weight_update", [body] * len(self.urls))


# ------------------------------------------------------------------ the gloo backend


def _broadcast(pg, t: torch.Tensor) -> None:
    """Broadcast ``t`` from rank 0 of the stateless gloo group ``pg`` (in place on the other ranks)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t], opts).wait()


def _gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A stateless gloo group of its own (the trainer's default process group, under torchrun, untouched). Under
    torchrun, torch's rendezvous would connect to torchrun's agent store instead of serving the group's own store
    from rank 0 (``TORCHELASTIC_USE_AGENT_STORE``), and the servers would wait for a store no one serves: the
    variable is lifted while the group forms."""
    import os

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        return stateless_init_torch_distributed_process_group(address, port, rank, world_size, backend="gloo",
                                                              timeout=timedelta(seconds=timeout_s))
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store


@dataclass(kw_only=True)
class GlooInitInfo:
    """The worker side's init info: the rendezvous, this server's first rank, the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    """One update: every tensor's name, dtype and shape, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def worker_engine_class():
    """`GlooWeightTransferEngine`, vLLM's worker-side engine class (made at first use: vLLM imported lazily)."""
    with _LOCK:
        if "worker" not in _ENGINES:
            from vllm.distributed.weight_transfer.base import WeightTransferEngine

            class GlooWeightTransferEngine(WeightTransferEngine):
                """The server's side of the gloo backend (module doc): join the group at init; per update, receive
                every tensor by broadcast and load it with ``load_weights`` inside vLLM's layerwise reload."""

                init_info_cls = GlooInitInfo
                update_info_cls = GlooUpdateInfo

                def __init__(self, config, vllm_config, device, model):
                    super().__init__(config, vllm_config, device, model)
                    self.group = None

                def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
                    pc = self.parallel_config
                    rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
                    self.group = _gloo_group(init_info.master_address, init_info.master_port, rank,
                                             init_info.world_size, init_info.timeout_s)

                def start_weight_update(self) -> None:
                    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                    initialize_layerwise_reload(self.model)

                def finish_weight_update(self) -> None:
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                    finalize_layerwise_reload(self.model, self.model_config)

                def receive_weights(self, update_info: GlooUpdateInfo) -> None:
                    if self.group is None:
                        raise RuntimeError("the gloo weight transfer is not initialized: call "
                                           "/init_weight_transfer_engine first")
                    for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                        t = torch.empty(shape, dtype=getattr(torch, dtype))
                        _broadcast(self.group, t)
                        self.model.load_weights([(name, t.to(self.device))])

                def shutdown(self) -> None:
                    if self.group is not None:
                        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                        stateless_destroy_torch_distributed_process_group(self.group)
                        self.group = None

            _ENGINES["worker"] = GlooWeightTransferEngine
        return _ENGINES["worker"]


def trainer_engine_class():
    """`GlooTrainerEngine`, the trainer's side of the gloo backend, as vLLM's ``TrainerWeightTransferEngine``."""
    with _LOCK:
        if "trainer" not in _ENGINES:
            from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

            @dataclass
            class GlooTrainerInitInfo(TrainerInitInfo):
                """The trainer's init info: where its rank 0 listens, the group's size (trainer + server workers)."""

                backend: ClassVar[str] = GLOO
                master_address: str
                master_port: int
                world_size: int
                timeout_s: float = 600.0

            class GlooTrainerEngine(TrainerWeightTransferEngine):
                """Rank 0 of the gloo group: ``trainer_init`` posts the workers' init (on a thread: they block in
                the rendezvous) while it opens the group; ``send_weights`` is start -> update (posted on a
                thread, while this side broadcasts every tensor) -> finish. Other trainer ranks (torchrun) only
                iterate the source, which gathers FSDP2 shards collectively."""

                init_info_cls = GlooTrainerInitInfo

                def __init__(self, *, client, source, is_sender: bool = True):
                    super().__init__(client=client, source=source, is_sender=is_sender)
                    self.group = None

                @classmethod
                def trainer_init(cls, init_info, *, client, source=None):
                    if source is None:
                        raise ValueError("the gloo weight transfer needs a WeightSource")
                    engine = cls(client=client, source=source, is_sender=init_info.is_sender)
                    if not engine.is_sender:
                        return engine
                    worker = GlooInitInfo(master_address=init_info.master_address,
                                          master_port=init_info.master_port, rank_offset=1,
                                          world_size=init_info.world_size, timeout_s=init_info.timeout_s)
                    with ThreadPoolExecutor(max_workers=1) as pool:
                        future = pool.submit(client.init_weight_transfer_engine, asdict(worker))
                        try:
                            engine.group = _gloo_group(init_info.master_address, init_info.master_port, 0,
                                                       init_info.world_size, init_info.timeout_s)
                        finally:
                            future.result()  # the servers' own error first, when they raised
                    return engine

                def send_weights(self) -> None:
                    meta = self.source.metadata()
                    if not self.is_sender:
                        for _ in self.source:
                            pass
                        return
                    info = GlooUpdateInfo(names=[m.name for m in meta],
                                          dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                          shapes=[list(m.shape) for m in meta])
                    self.client.start_weight_update()
                    pool = ThreadPoolExecutor(max_workers=1)
                    try:
                        future = pool.submit(self.client.update_weights, asdict(info))
                        for (name, t), m in zip(self.source, meta):
                            if name != m.name or tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
                                raise RuntimeError(f"the weight stream gave {name} {tuple(t.shape)} {t.dtype} where "
                                                   f"its metadata said {m.name} {tuple(m.shape)} {m.dtype}")
                            _broadcast(self.group, t)
                        future.result()
                    finally:
                        pool.shutdown(wait=False)  # a failed broadcast leaves the route hanging: never join it
                    self.client.finish_weight_update()

                def shutdown(self) -> None:
                    if self.group is not None:
                        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                        stateless_destroy_torch_distributed_process_group(self.group)
                        self.group = None

            _ENGINES["trainer"] = (GlooTrainerEngine, GlooTrainerInitInfo)
        return _ENGINES["trainer"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (pyproject.toml): add the gloo backend to vLLM's worker-side
    registry, in every vLLM process. Idempotent (vLLM may call it more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO, worker_engine_class())


def register_trainer() -> None:
    """Add the gloo backend to vLLM's trainer-side registry (this process; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if GLOO not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO, trainer_engine_class()[0])
