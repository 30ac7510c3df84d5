"""A running worker, widget-free: the model store, the engine, the job runner and the link.

The headless CLI and the desktop app (``desktop_worker/gui``) drive the same object. Blocking
work (hardware probes, downloads, hashing, model loading) runs in threads. A service serves
once: ``serve`` closes its engine at the end, so the app builds a fresh one (sharing the model
store) for each Start Earning.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from desktop_worker import __version__
from desktop_worker.adapter_cache import ADAPTERS_DIR, AdapterCache, FineTunedModels
from desktop_worker.engine.pool import ModelPool, ServableModel
from desktop_worker.errors import GroupError, WorkerError
from desktop_worker.fetching import Fetcher
from desktop_worker.group_family import family_tag
from desktop_worker.groups.lan import lan_hint
from desktop_worker.groups.lead import GroupContexts
from desktop_worker.groups.local import LocalGroup
from desktop_worker.groups.roles import GroupRoles
from desktop_worker.groups.rpc import (
    DeviceType,
    RpcProbe,
    RpcSupport,
    device_free_mb,
    group_devices,
)
from desktop_worker.groups.rpc_probe import SandboxedRpc
from desktop_worker.hardware import HardwareReport, detect_hardware
from desktop_worker.identity import WorkerIdentity
from desktop_worker.image_jobs import ImageJobs
from desktop_worker.jobs import JobRunner
from desktop_worker.link.client import LinkClient
from desktop_worker.owner import OwnerProbe, PauseWatcher, controls_on, default_probe
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.sandbox.images import SandboxedImages
from desktop_worker.sandbox.training import SandboxedTrainer
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import LocalModel, ModelStore, store_for
from desktop_worker.store.gguf_info import GgufInfo
from desktop_worker.store.names import validate_local_name
from desktop_worker.swarm_choice import SwarmChooser
from desktop_worker.training_jobs import TrainingJobs, store_room
from shared_schema import (
    CAPABILITY_CONTINUE,
    PROTOCOL_VERSION,
    Demand,
    Hello,
    Status,
    capabilities,
)
from shared_schema.groups import MAX_MEMBER_DEVICES
from shared_schema.hardware import MAX_VRAM_MB, ModelDescriptor

log = logging.getLogger(__name__)

# What this worker honours (shared_schema.capabilities): "continue" goes on from another
# worker's partial answer (Job.continuation); the rest are the OpenAI fields of issue 15.
CAPABILITIES = ["chat", "stream", "embeddings", CAPABILITY_CONTINUE, capabilities.GRAMMAR,
                capabilities.LOGPROBS, capabilities.LOGIT_BIAS, capabilities.CHOICES,
                capabilities.COMPLETIONS, capabilities.EMBED_TOKENS, capabilities.SCORE]


def worker_capabilities(settings: WorkerSettings, rpc: RpcProbe | None = None) -> list[str]:
    """What the hello says this worker can do: ``CAPABILITIES``, plus ``auditor`` when its
    operator offers it as an audit-only re-scorer (``WorkerSettings.auditor``), ``fetch``
    when its owner lets the queen place models on it (``accept_fetch``, issue 17), and ``rpc``
    when its llama.cpp has the RPC backend and its owner lets it join groups (issue 19),
    ``train`` when its owner lets it take fine-tuning jobs (``train``, issue 37), ``image``
    when its owner lets it render images and the image engine is installed (issue 38), and ``lora``
    (it serves fine-tuned models, issue 37) unless every model it serves goes through a local
    group's head (``local_group``), which loads no adapter."""
    out = list(CAPABILITIES)
    if not settings.local_group:
        out.append(capabilities.LORA)
    if settings.auditor:
        out.append(capabilities.CAPABILITY_AUDITOR)
    if settings.accept_fetch:
        out.append(capabilities.FETCH)
    if settings.join_groups and rpc is not None and rpc.available:
        out.append(capabilities.RPC)
    if settings.train:
        out.append(capabilities.TRAIN)
    if settings.images and image_engine_installed():
        out.append(capabilities.IMAGE)
    return out


def image_engine_installed() -> bool:
    """Whether stable-diffusion.cpp's bindings are installed (found, never imported here: only
    an image child loads them)."""
    return importlib.util.find_spec("stable_diffusion_cpp") is not None


def default_budget_mb() -> int:
    """Models may use 60% of the RAM available when the worker starts."""
    return max(512, int(psutil.virtual_memory().available / (1024 * 1024) * 0.6))


Detector = Callable[[Path], HardwareReport]
TRAINING_DIR = "training"  # training jobs' folders, under the model store


class WorkerService:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        store: ModelStore | None = None,
        detector: Detector | None = None,
        owner_probe: OwnerProbe | None = None,
        rpc: RpcSupport | None = None,
    ) -> None:
        self.settings = settings
        # llama.cpp's RPC backend (model groups, issue 19), probed once, at the first hello.
        # asked of a confined engine child: this process never loads llama.cpp (issue 34)
        self._own_rpc = rpc is None  # closed with the service; one given is its giver's
        self.rpc: RpcSupport = rpc or SandboxedRpc()
        self.rpc_probe: RpcProbe | None = None
        self.joins_groups = False  # the last hello said ``rpc``: statuses name its devices
        self._devices_unlisted = False  # llama.cpp's devices could not be listed (logged once)
        # What the owner's pause settings read (issue 17); None: the real machine's probe.
        self.owner_probe: OwnerProbe = owner_probe or default_probe(settings)
        self.detector: Detector = detector or detect_hardware
        self.store = store or store_for(settings)  # its quota and headroom (issue 34)
        self.identity = WorkerIdentity.load_or_create(settings.key_path,
                                                      key_store=settings.key_store)
        self.hardware: HardwareReport | None = None
        # --local-group N: every model served through N RPC servers on this machine (issue 19)
        self.local_group = (LocalGroup(settings.local_group, n_threads=settings.threads or 1)
                            if settings.local_group else None)
        # The pool's contexts: a model with a queen-formed group (issue 19) gets its head,
        # every other model the usual context (or the local group's head under --local-group).
        # Every context is a confined engine child (issue 34); ``engines.on_crash`` hears of
        # one that ended mid-work.
        self.engines = SandboxedContexts()
        self.group_contexts = GroupContexts(self.local_group or self.engines)
        self.pool = ModelPool(
            self.store.get,
            max_jobs=settings.jobs_at_once,
            gpu_layers=settings.gpu_layers,
            n_ctx=settings.n_ctx,
            n_threads=settings.threads,  # None: llama.cpp picks half the cores
            free_vram_mb=self.free_vram_mb,
            budget_mb=settings.memory_budget_mb or default_budget_mb(),
            contexts=self.group_contexts,
            max_contexts=self.group_contexts.max_contexts,
        )
        # This worker's part in the queen's model groups; the link hands it the group commands
        # once a hello has said ``rpc`` (``hello_factory``).
        self.groups = GroupRoles(
            self.pool, self.group_contexts, self._held_model,
            # a member's RPC server and a head: llama.cpp's own default, half the cores
            n_threads=settings.threads or max(1, (os.cpu_count() or 2) // 2),
            lan_groups=settings.lan_groups,
            queen_host=urlsplit(settings.queen_url).hostname or "",
            head_gpus=self._head_gpus,
            gpus=self._gpus_allowed,
            memory_mb=self.group_memory_mb,  # a member's share when the queen sends none
        )
        # Fine-tuning jobs (issue 37), when the owner opted in: a folder each under the model
        # store (its disk), counted against the store's quota.
        training = (TrainingJobs(SandboxedTrainer(n_threads=settings.threads,
                                                  free_vram_mb=self._train_vram()),
                                 settings.models_dir / TRAINING_DIR, self._model_path,
                                 room_bytes=store_room(self.store))
                    if settings.train else None)
        # Fine-tuned models (issue 37): their adapters under the model store, counted against
        # its quota; a model a queen-formed group serves (its head) takes none.
        self.fine_tuned = FineTunedModels(AdapterCache(
            settings.models_dir / ADAPTERS_DIR, max_bytes=settings.adapter_cache_mb * 2**20,
            max_count=settings.adapter_cache_count, room_bytes=store_room(self.store)),
            self.pool)
        # Image jobs (issue 38), when the owner opted in and the image engine is installed.
        # Each image child's memory is reserved from the text models' budget (``ModelPool``).
        self.images = (ImageJobs(SandboxedImages(n_threads=settings.threads, memory=self.pool,
                                                 gpus=self._gpus_allowed()),
                                 self._model_info, self._model_path)
                       if capabilities.IMAGE in worker_capabilities(settings) else None)
        self.runner = JobRunner(
            self.pool, has_model=self.has_model, training=training, images=self.images,
            fine_tuned=None if settings.local_group else self.fine_tuned,
            grouped=lambda name: self.group_contexts.binding(name) is not None)
        self.fetcher = Fetcher(self.store, self.pool, evict=lambda: self.settings.swarm_models,
                               changed=self._status_changed,
                               images=lambda: self.images is not None)
        # What the queen says developers ask for (issue 17), and who wants to hear of it.
        self.demand: Demand | None = None
        self.demand_listeners: list[Callable[[Demand], None]] = []
        self.swarm = SwarmChooser(self)  # the owner's opt-in: follow demand (swarm_models)
        # Why the owner paused this worker (None: serving), and who wants to hear of it.
        self.paused: str | None = None
        self.pause_listeners: list[Callable[[str | None], None]] = []
        self._hand_back: asyncio.Task[None] | None = None
        self.link = LinkClient(
            settings.link_urls,
            self.hello_factory,
            self.runner,
            status=self.status,
            status_interval_s=settings.status_interval_s,
            shutdown_grace_s=settings.shutdown_grace_s,
            max_frame_bytes=settings.max_frame_bytes,
            on_demand=self._on_demand,
            on_fetch=self.fetcher.start if settings.accept_fetch else None,
            on_session_end=self.groups.session_ended,
        )

    def free_vram_mb(self) -> int | None:
        """Free GPU memory the engine may plan with: what was detected, capped by the owner's
        ``vram_cap_mb`` setting."""
        free = self.hardware.free_vram_mb if self.hardware else None
        cap = getattr(self.settings, "vram_cap_mb", None)
        if cap is None or free is None:
            return free
        return min(free, cap)

    def _held_model(self, name: str) -> ServableModel | None:
        """The model the store holds by ``name`` (for a group's head), else None."""
        try:
            return self.store.get(name) if name in self.store else None
        except WorkerError:
            return None

    def _train_vram(self) -> Callable[[], int | None] | None:
        """What a fine-tuning run reads its free GPU memory from, when the owner lets training
        use the GPU (``train_on_gpu``, and layers are not kept off it); None: the CPU."""
        if not self.settings.train_on_gpu or not self._gpus_allowed():
            return None
        return self.free_vram_mb

    def _gpus_allowed(self) -> bool:
        """Whether models may use this worker's GPUs: a model group's (``rpc.group_devices``,
        as a member and as a head), an image child's and a fine-tuning run's; not when the
        owner keeps layers off the GPU (``gpu_layers=0``)."""
        return self.settings.gpu_layers != 0

    def _head_gpus(self) -> int:
        """How many local GPUs a group's head offloads its own layers to: the GPUs among the
        devices it gives a group (none: its own layers stay on its CPU). Blocking."""
        devices = group_devices(self.rpc.devices(), gpus=self._gpus_allowed())
        return sum(1 for device in devices if device.type != DeviceType.CPU)

    def group_memory_mb(self) -> list[int] | None:
        """``device_free_mb`` for the hello and statuses: the memory of each device a group
        gets (``rpc.device_free_mb``; the CPU's is the pool's budget), bounded as the wire
        bounds it. None when llama.cpp's devices cannot be listed (logged once: the queen then
        plans with the budget alone) or it lists none. Blocking: it asks the GPU driver."""
        try:
            devices = self.rpc.devices()
        except (GroupError, ValueError) as exc:  # ValueError: a device type this ggml adds
            if not self._devices_unlisted:
                self._devices_unlisted = True
                log.warning("llama.cpp's devices could not be listed, so the queen is not told "
                            "each device's memory for model groups: %s", exc)
            return None
        found = device_free_mb(devices, self.pool.budget_mb, gpus=self._gpus_allowed(),
                               vram_cap_mb=self.settings.vram_cap_mb)
        return [min(mb, MAX_VRAM_MB) for mb in found[:MAX_MEMBER_DEVICES]] or None

    def model_room_mb(self) -> int:
        """Room for one more model (disk and quota), in MB, as the queen is told."""
        room = self.store.room_bytes(self.pool.loaded(), evict=self.settings.swarm_models)
        return room // 2**20

    # --- demand and pauses (issue 17) ---------------------------------------------------------

    def _on_demand(self, demand: Demand) -> None:
        self.demand = demand
        for listener in list(self.demand_listeners):
            try:
                listener(demand)
            except Exception:  # a broken listener must not break the link
                log.exception("a demand listener failed")

    def _status_changed(self) -> None:
        self.link.send_status_now()

    def pause(self, reason: str) -> None:
        """Pause: take no new jobs or fetches, say why in the status, and let the jobs in
        flight finish within ``pause_grace_s``, then hand them back to the queen (a retryable
        ``paused`` error: it continues each answer elsewhere)."""
        if self.paused == reason:
            return
        first = self.paused is None
        self.paused = reason
        self.link.set_paused(reason)
        self.groups.pause(reason)  # a group's part ends: its head or members cannot wait
        log.info("paused: %s", reason)
        if first and self.runner.active:
            self._hand_back = asyncio.get_running_loop().create_task(
                self.runner.hand_back(self.settings.pause_grace_s, reason))
        self._tell_pause()

    def resume(self) -> None:
        if self.paused is None:
            return
        self.paused = None
        if self._hand_back is not None:
            self._hand_back.cancel()
            self._hand_back = None
        self.link.set_paused(None)
        log.info("resumed: taking jobs again")
        self._tell_pause()

    def _tell_pause(self) -> None:
        for listener in list(self.pause_listeners):
            try:
                listener(self.paused)
            except Exception:
                log.exception("a pause listener failed")

    # --- models -------------------------------------------------------------------------------

    def has_model(self, name: str) -> bool:
        return name in self.store

    def _model_path(self, name: str) -> Path:
        return self.store.get(name).path

    def _model_info(self, name: str) -> GgufInfo | None:
        return self.store.get(name).info if name in self.store else None

    def descriptors(self) -> list[ModelDescriptor]:
        """The models the queen is told of: every one the store holds, less diffusion models
        when this worker renders no images (issue 38)."""
        models = self.store.descriptors(self.pool.loaded())
        if self.images is None:
            models = [model for model in models if model.kind != "image"]
        return models

    async def prepare(
        self, names_or_paths: list[str], progress: Callable[..., None] | None = None
    ) -> list[LocalModel]:
        """Make every named model local (pulling or importing it) and load it.

        The hardware is detected first (once), so that ``gpu_layers="auto"`` plans each load
        with the free VRAM the GPU really has, not with none."""
        if self.hardware is None:
            await self.detect()
        if self.local_group is not None:
            await self.local_group.start()  # before the first load: the heads need them
        models = []
        for item in names_or_paths:
            model = await asyncio.to_thread(self._local, item, progress)
            if model.info.is_diffusion:  # its image child loads it on its first job
                log.info("serving %s (%s, %.0f MB, a diffusion model: %s)", model.name,
                         model.path.name, model.size_bytes / 2**20,
                         "images on" if self.images is not None else
                         "not announced, images are off")
                models.append(model)
                continue
            plan = await self.pool.load(model.name)
            log.info("serving %s (%s, %.0f MB, %s)", model.name, model.path.name,
                     model.size_bytes / 2**20, plan.reason)
            models.append(model)
        return models

    def _local(self, item: str, progress: Callable[..., None] | None) -> LocalModel:
        path = Path(item).expanduser()
        if item.endswith((".gguf", ".safetensors")) and path.is_file():
            name = validate_local_name(path.stem)
            existing = next((m for m in self.store.list() if m.name == name), None)
            if existing is not None and existing.size_bytes == path.stat().st_size:
                return existing
            if existing is not None:
                self.store.remove(name)
            log.info("importing %s as %s", path, name)
            return self.store.import_file(path, name)
        return self.store.pull(item, progress=progress)

    # --- what the queen is told ---------------------------------------------------------------

    async def detect(self) -> HardwareReport:
        self.hardware = await asyncio.to_thread(self.detector, self.settings.models_dir)
        return self.hardware

    async def hello_factory(self) -> tuple[Callable[[str, str], Hello], int]:
        """Fresh hardware and model facts for the next hello (called on every connect)."""
        report = await self.detect()
        fields = report.registration_fields()
        models = self.descriptors()
        settings = self.settings
        room_mb = await asyncio.to_thread(self.model_room_mb)
        if self.rpc_probe is None:
            self.rpc_probe = await asyncio.to_thread(self.rpc.probe)
            if settings.join_groups and not self.rpc_probe.available:
                log.info("this worker joins no model groups: %s", self.rpc_probe.reason)
        rpc = self.rpc_probe
        joins = capabilities.RPC in worker_capabilities(settings, rpc)
        self.joins_groups = joins
        self.link.on_group = self.groups.receive if joins else None
        self.link.on_relay = self.groups.relay if joins else None  # relayed channels' bytes
        # A worker that does not listen on its LAN (lan_groups off) cannot be reached directly
        # there, so it names no LAN.
        hint = (await asyncio.to_thread(lan_hint, urlsplit(settings.queen_url).hostname or "")
                if joins and settings.lan_groups else None)
        devices = await asyncio.to_thread(self.group_memory_mb) if joins else None

        def hello_for(nonce: str, origin: str) -> Hello:  # origin: of the URL dialled
            return Hello(
                protocol=PROTOCOL_VERSION,
                worker_version=__version__,
                pubkey=self.identity.pubkey,
                signature=self.identity.sign_hello(nonce, settings.ln_url, origin=origin),
                ln_url=settings.ln_url,
                models=models,
                capabilities=worker_capabilities(settings, rpc),
                max_jobs=settings.jobs_at_once,
                memory_budget_mb=self.pool.budget_mb,
                model_room_mb=room_mb,
                swarm_models=settings.swarm_models,
                llama_build=rpc.build if joins else None,
                lan_hint=hint,
                device_free_mb=devices,
                group_family=(family_tag(settings.group_family, origin)
                              if joins and settings.group_family else None),
                **fields,
            )

        return hello_for, settings.jobs_at_once

    def jobs_now(self) -> int:
        """The jobs this worker takes at once, as its status says: the owner's number; with
        Jobs at once on automatic, what its loaded models' batches hold (memory decides each
        one's slots), up to the automatic most; before any model loads, that most."""
        loaded = self.pool.loaded()
        if self.settings.max_jobs is not None or not loaded:
            return self.settings.jobs_at_once
        held = sum(self.pool.slots(name) for name in loaded)
        return max(1, min(self.settings.jobs_at_once, held))

    async def status(self) -> Status:
        report = await self.detect()
        devices = (await asyncio.to_thread(self.group_memory_mb) if self.joins_groups
                   else None)
        return Status(
            active_jobs=self.runner.active,
            max_jobs=self.jobs_now(),
            models=self.descriptors(),
            downloads=self.fetcher.downloads(),
            model_room_mb=await asyncio.to_thread(self.model_room_mb),
            paused=self.paused,
            device_free_mb=devices,
            **report.status_fields(),
        )

    # --- running ------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        # The owner's pause settings (issue 17), watched beside the link while it runs.
        watch = None
        if controls_on(self.settings):
            watcher = PauseWatcher(self, self.owner_probe, lambda: self.settings)
            watch = asyncio.get_running_loop().create_task(watcher.run(stop))
        try:
            await self.link.run(stop)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            # A job task ends only after its generation thread does; closing the engine under
            # a running thread would free the model it is reading.
            await self.fetcher.close()
            await self.swarm.close()
            await self.runner.drain(0)
            await self.groups.close()  # its heads, members, gates and dialers
            await self.pool.close()
            if self.images is not None:
                await self.images.close()  # its image children
            if self.local_group is not None:
                await self.local_group.stop()
            if self._own_rpc and isinstance(self.rpc, SandboxedRpc):
                await asyncio.to_thread(self.rpc.close)
