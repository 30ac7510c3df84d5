"""The legacy registration as the real GPUtopia workerbee sends it: ``vram`` in bytes (the wiki
says MB), float GPU memory, ``null`` readings and the newer fields, next to the wiki's shape."""

from __future__ import annotations

import copy

import orjson
import pytest
from pydantic import ValidationError

from shared_schema import LegacyRegistration, NvGpu, ProtocolError
from shared_schema.hardware import MAX_VRAM_BYTES, MAX_VRAM_MB, MIB
from shared_schema.legacy import UNKNOWN_GPU, VRAM_BYTES_FROM, vram_to_mb
from shared_schema.parsing import parse_registration
from tests.support.workers import LegacyWorker

GIB = 1 << 30

# A workerbee on a machine without NVIDIA: pynvml fails, so its NVIDIA fields stay null; its
# OpenCL GPU is read by pyopencl (decimal MB, as int).
AMD_WORKERBEE = {
    **copy.deepcopy(LegacyWorker.WORKERBEE_REGISTRATION),
    "vram": 12 * GIB + 123_456,
    "nv_gpu_count": None, "nv_driver_version": None, "nv_gpus": [],
    "cl_driver_version": "OpenCL 2.1 AMD-APP (3581.0)",
    "cl_gpus": [{"name": "gfx1030", "uuid": None, "memory": 17163, "clock": 2660,
                 "clock_unit": "mhz"}],
}


# --- the unit rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vram", "mb"),
    [
        (0, 0),
        (2048, 2048),  # the wiki's MB
        (80 * 1024 * 8, 80 * 1024 * 8),  # eight 80 GB GPUs, in MB
        (VRAM_BYTES_FROM - 1, VRAM_BYTES_FROM - 1),  # the most MB a worker may have
        (VRAM_BYTES_FROM, 16),  # from here on, bytes: 16 MiB
        (LegacyWorker.WORKERBEE_VRAM_BYTES, 26_624),  # psutil's available RAM
        (64 * GIB + MIB - 1, 64 * 1024),  # a part of a MB is dropped
        (MAX_VRAM_BYTES, MAX_VRAM_MB),  # the cap, in bytes
    ],
)
def test_vram_is_megabytes_below_two_to_the_24_and_bytes_from_there(vram, mb):
    assert vram_to_mb(vram) == mb
    assert LegacyRegistration.model_validate({"vram": vram}).vram_mb == mb


def test_the_unit_rule_never_yields_more_than_the_cap():
    assert VRAM_BYTES_FROM == MAX_VRAM_MB
    assert max(vram_to_mb(VRAM_BYTES_FROM - 1), vram_to_mb(MAX_VRAM_BYTES)) == MAX_VRAM_MB


@pytest.mark.parametrize("vram", [MAX_VRAM_BYTES + 1, 18 * 2**60, -1])
def test_absurd_vram_is_refused_after_conversion(vram):
    with pytest.raises(ValidationError, match="vram"):
        LegacyRegistration.model_validate({"vram": vram})
    with pytest.raises(ProtocolError) as info:
        parse_registration({**LegacyWorker.WORKERBEE_REGISTRATION, "vram": vram})
    assert info.value.code == "invalid_message"


# --- the real workerbee's message --------------------------------------------------------------


def test_the_real_workerbee_registration_parses_with_its_fields_kept():
    sent = LegacyWorker.WORKERBEE_REGISTRATION
    registration = parse_registration(orjson.loads(orjson.dumps(sent)))
    assert registration.vram == sent["vram"]  # kept as sent
    assert registration.vram_mb == 26_624  # read in MB
    assert (registration.cpu_count, registration.disk_space) == (16, 412_873)  # MB of disk
    assert registration.nv_gpus == [NvGpu(name="NVIDIA GeForce RTX 3090", memory=24576,
                                          uuid="GPU-5c2d8f4e-1b7a-3c9e-8d6f-0a2b4c6e8f10")]
    assert registration.gpu_names == ["NVIDIA GeForce RTX 3090"]
    assert (registration.worker_version, registration.capabilities, registration.models) == (
        "0.2.4", ["llama-infer", "llama-fine-tune"],
        ["TheBloke/Mistral-7B-Instruct-v0.1-GGUF:Q4_K_M"])
    assert (registration.pubkey, registration.slug, registration.sig) == (
        sent["pubkey"], "", sent["sig"])
    assert registration.ln_url == registration.ln_address == "worker-bob@getalby.com"
    assert registration.auth_key == ""


def test_a_workerbee_without_nvidia_sends_nulls_and_opencl_gpus():
    registration = parse_registration(AMD_WORKERBEE)
    assert registration.nv_gpu_count == 0
    assert registration.nv_gpus == []
    assert registration.gpu_names == ["gfx1030"]
    assert registration.cl_gpus[0].memory == 17163
    assert registration.vram_mb == 12 * 1024


def test_nvml_float_memory_is_floored_and_missing_readings_are_tolerated():
    registration = parse_registration({
        **LegacyWorker.WORKERBEE_REGISTRATION,
        "nv_gpus": [{"name": "Tesla T4", "uuid": None, "memory": 15109.75, "clock": None,
                     "clock_unit": None},
                    {"name": None, "memory": None, "clock": 1, "clock_unit": "MHz"}],
        "cl_gpus": None, "capabilities": None, "models": None, "disk_space": None,
    })
    assert [(gpu.name, gpu.memory) for gpu in registration.nv_gpus] == [
        ("Tesla T4", 15109), (UNKNOWN_GPU, 0)]
    assert (registration.cl_gpus, registration.capabilities, registration.models,
            registration.disk_space) == ([], [], [], 0)


@pytest.mark.parametrize("memory", [float("inf"), -1.0, 2.0**40, "lots"])
def test_absurd_gpu_memory_is_still_refused(memory):
    body = {"vram": 1, "nv_gpus": [{"name": "x", "memory": memory}]}
    with pytest.raises(ProtocolError):
        parse_registration(body)


def test_the_auth_key_is_kept_but_never_shown():
    registration = parse_registration({**LegacyWorker.WORKERBEE_REGISTRATION,
                                       "auth_key": "user-secret-token"})
    assert registration.auth_key == "user-secret-token"
    assert "user-secret-token" not in repr(registration)


def test_the_wiki_registration_still_reads_as_megabytes():
    registration = parse_registration(LegacyWorker.REGISTRATION)
    assert registration.vram_mb == registration.vram == 2048
    assert registration.worker_version is None
    assert registration.models == []
