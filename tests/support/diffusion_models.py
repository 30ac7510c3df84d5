"""A random-weight diffusion model of a real architecture that stable-diffusion.cpp detects and
renders, written by the tests themselves (there is no hub here).

The architecture is SDXS-512-DS (sd.cpp's ``VERSION_SDXS_512_DS``): the SD 1.x tiny UNet
(channel widths 320/640/1280, one res block a level, attention at the two lower levels, no
middle block and no ``output_blocks.7.1``), CLIP-L as its text encoder (12 layers, 768 wide:
the width decides the family), and TAESD's tiny decoder as its VAE (sd.cpp uses the tiny
autoencoder for SDXS, and reads a ``first_stage_model.decoder.layers.*`` in the model file as
TAESD's). sd.cpp fixes every width by family (``unet.hpp``, ``clip.hpp``); SDXS is the smallest
UNet it knows, SD3 has at least 24 blocks of 64 a block, FLUX is 3072 wide. One file holds
everything (about 430 M parameters; no separate TAESD file is needed).

Weights: the 3x3 and 1x1 convolution kernels are F16 (sd.cpp keeps every ``Conv2d`` in F16,
and a kernel's rows of 3 cannot be quantized), drawn from N(0, 1/fan_in); every linear layer
and the token embedding is Q4_0, written straight as blocks (a random 4-bit value from -7 to 7
times a scale giving the same spread), which takes a fraction of the time numpy's normal draws
would; norms' weights 1 and biases 0, the other biases 0. A few weights lay a path that carries
the UNet's input to its output, so that it predicts about the noise it is given and latents stay
inside TAESD's clamp (``_identity_path``); TAESD's last convolution is centred on mid-grey.
Renders are finite, not one colour, unsaturated, and differ by seed, prompt, sampler and
weights. Deterministic in ``seed``: ``write_sdxs_model(path,
seed=1)`` is "another model" of the same shape.

Use ``diffusion_fixture.py``'s fixtures (one file per test session), or call
``write_sdxs_model`` directly. ``write_sdxs_safetensors`` writes the same model as a single-file
safetensors checkpoint, as most diffusion models are published (its Q4_0 weights turned into
F16 ones of the same values: about 880 MB).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

__all__ = ["TensorSpec", "WrittenModel", "sdxs_tensors", "write_sdxs_model",
           "write_sdxs_safetensors", "write_taesd"]

_UNET = "model.diffusion_model."
_CLIP = "cond_stage_model.transformer.text_model."
_TAESD = "first_stage_model.decoder.layers."
_CONTEXT = 768  # CLIP-L's width: what makes sd.cpp read the file as SD 1.x
_TIME = 1280
_Q4_BLOCK, _Q4_BYTES = 32, 18
RANDOM_SHARE = 0.1  # of the final convolution's random weights (see _identity_path)
RGB_GAIN = 1.0  # the final convolution's; 1 gives about 60 of spread round mid-grey
_Q4_SPREAD = math.sqrt((15 * 15 - 1) / 12)  # the standard deviation of a uniform -7..7


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor: ``shape`` in numpy's order (ggml's reversed), ``kind`` how it is drawn."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "conv", "linear", "embedding", "position", "ones", "zeros"
    fan_in: int = 1


@dataclass(frozen=True, slots=True)
class WrittenModel:
    path: Path
    sha256: str
    size_bytes: int
    parameter_count: int


# --- the architecture ---------------------------------------------------------------------------


def _linear(name: str, n_in: int, n_out: int, *, bias: bool = True) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", (n_out, n_in), "linear", n_in)
    if bias:
        yield TensorSpec(f"{name}.bias", (n_out,), "zeros")


def _conv(name: str, n_in: int, n_out: int, kernel: int, *, bias: bool = True
          ) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", (n_out, n_in, kernel, kernel), "conv",
                     n_in * kernel * kernel)
    if bias:
        yield TensorSpec(f"{name}.bias", (n_out,), "zeros")


def _norm(name: str, width: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", (width,), "ones")
    yield TensorSpec(f"{name}.bias", (width,), "zeros")


def _res_block(name: str, n_in: int, n_out: int) -> Iterator[TensorSpec]:
    yield from _norm(f"{name}.in_layers.0", n_in)
    yield from _conv(f"{name}.in_layers.2", n_in, n_out, 3)
    yield from _linear(f"{name}.emb_layers.1", _TIME, n_out)
    yield from _norm(f"{name}.out_layers.0", n_out)
    yield from _conv(f"{name}.out_layers.3", n_out, n_out, 3)
    if n_in != n_out:
        yield from _conv(f"{name}.skip_connection", n_in, n_out, 1)


def _transformer(name: str, width: int) -> Iterator[TensorSpec]:
    """A SpatialTransformer of depth 1 with linear projections (sd.cpp reads a 2-D
    ``proj_out.weight`` as linear, which lets them be quantized)."""
    yield from _norm(f"{name}.norm", width)
    yield from _linear(f"{name}.proj_in", width, width)
    block = f"{name}.transformer_blocks.0"
    for attn, context in (("attn1", width), ("attn2", _CONTEXT)):
        yield from _linear(f"{block}.{attn}.to_q", width, width, bias=False)
        yield from _linear(f"{block}.{attn}.to_k", context, width, bias=False)
        yield from _linear(f"{block}.{attn}.to_v", context, width, bias=False)
        yield from _linear(f"{block}.{attn}.to_out.0", width, width)
    yield from _linear(f"{block}.ff.net.0.proj", width, width * 4 * 2)  # GEGLU
    yield from _linear(f"{block}.ff.net.2", width * 4, width)
    for norm in ("norm1", "norm2", "norm3"):
        yield from _norm(f"{block}.{norm}", width)
    yield from _linear(f"{name}.proj_out", width, width)


def _unet() -> Iterator[TensorSpec]:
    """SDXS-512-DS's UNet, block by block as ``UnetModelBlock`` numbers them."""
    u = _UNET
    yield from _linear(f"{u}time_embed.0", 320, _TIME)
    yield from _linear(f"{u}time_embed.2", _TIME, _TIME)
    yield from _conv(f"{u}input_blocks.0.0", 4, 320, 3)
    yield from _res_block(f"{u}input_blocks.1.0", 320, 320)
    yield from _conv(f"{u}input_blocks.3.0.op", 320, 320, 3)
    yield from _res_block(f"{u}input_blocks.4.0", 320, 640)
    yield from _transformer(f"{u}input_blocks.4.1", 640)
    yield from _conv(f"{u}input_blocks.6.0.op", 640, 640, 3)
    yield from _res_block(f"{u}input_blocks.7.0", 640, 1280)
    yield from _transformer(f"{u}input_blocks.7.1", 1280)
    yield from _res_block(f"{u}output_blocks.0.0", 2560, 1280)
    yield from _transformer(f"{u}output_blocks.0.1", 1280)
    yield from _res_block(f"{u}output_blocks.1.0", 1920, 1280)
    yield from _transformer(f"{u}output_blocks.1.1", 1280)
    yield from _conv(f"{u}output_blocks.2.1.conv", 1280, 1280, 3)
    yield from _res_block(f"{u}output_blocks.3.0", 1920, 640)
    yield from _transformer(f"{u}output_blocks.3.1", 640)
    yield from _res_block(f"{u}output_blocks.4.0", 960, 640)
    yield from _transformer(f"{u}output_blocks.4.1", 640)
    yield from _conv(f"{u}output_blocks.5.2.conv", 640, 640, 3)
    yield from _res_block(f"{u}output_blocks.6.0", 960, 320)
    yield from _res_block(f"{u}output_blocks.7.0", 640, 320)
    yield from _norm(f"{u}out.0", 320)
    yield from _conv(f"{u}out.2", 320, 4, 3)


def _clip() -> Iterator[TensorSpec]:
    """CLIP-L's text model (OpenAI's ViT-L/14: 12 layers, 768 wide, 49,408 tokens)."""
    c = _CLIP
    yield TensorSpec(f"{c}embeddings.token_embedding.weight", (49408, _CONTEXT), "embedding")
    yield TensorSpec(f"{c}embeddings.position_embedding.weight", (77, _CONTEXT), "position")
    for i in range(12):
        layer = f"{c}encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield from _linear(f"{layer}.self_attn.{proj}", _CONTEXT, _CONTEXT)
        yield from _norm(f"{layer}.layer_norm1", _CONTEXT)
        yield from _norm(f"{layer}.layer_norm2", _CONTEXT)
        yield from _linear(f"{layer}.mlp.fc1", _CONTEXT, 3072)
        yield from _linear(f"{layer}.mlp.fc2", 3072, _CONTEXT)
    yield from _norm(f"{c}final_layer_norm", _CONTEXT)


def _taesd_decoder() -> Iterator[TensorSpec]:
    """TAESD's decoder (``TinyDecoder``: 64 channels; convolutions after an upsample have no
    bias)."""
    t = _TAESD
    yield from _conv(f"{t}0", 4, 64, 3)
    for index in (2, 3, 4, 7, 8, 9, 12, 13, 14, 17):
        for conv in ("conv.0", "conv.2", "conv.4"):
            yield from _conv(f"{t}{index}.{conv}", 64, 64, 3)
    for index in (6, 11, 16):
        yield from _conv(f"{t}{index}", 64, 64, 3, bias=False)
    for spec in _conv(f"{t}18", 64, 3, 3):  # to RGB: zero-mean kernels, so that the ReLU'd
        yield TensorSpec(spec.name, spec.shape, "rgb" if spec.kind == "conv" else "grey",
                         spec.fan_in)  # (all positive) features set no colour of their own


def sdxs_tensors() -> list[TensorSpec]:
    """Every tensor of the model, in the order written."""
    return [*_unet(), *_clip(), *_taesd_decoder()]


# --- the weights --------------------------------------------------------------------------------


def _q4_0(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Q4_0 blocks of random values with standard deviation ``std``: each block a float16 scale
    and 32 four-bit values (the low nibbles the first 16), read as ``(q - 8) * scale``."""
    rows, cols = shape
    n_blocks = rows * cols // _Q4_BLOCK
    nibbles = rng.integers(1, 16, size=(n_blocks, _Q4_BLOCK), dtype=np.uint8)  # -7..7 after -8
    blocks = np.empty((n_blocks, _Q4_BYTES), dtype=np.uint8)
    blocks[:, :2] = np.full(n_blocks, std / _Q4_SPREAD, dtype=np.float16).view(np.uint8) \
        .reshape(n_blocks, 2)
    blocks[:, 2:] = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    return blocks.reshape(rows, cols // _Q4_BLOCK * _Q4_BYTES)


def _weights(spec: TensorSpec, rng: np.random.Generator) -> tuple[np.ndarray, int | None]:
    """The tensor's data and, for a quantized one, its ggml type."""
    if spec.kind == "linear":
        return _q4_0(rng, spec.shape, 1 / math.sqrt(spec.fan_in)), GGMLQuantizationType.Q4_0
    if spec.kind == "embedding":
        return _q4_0(rng, spec.shape, 1.0), GGMLQuantizationType.Q4_0
    if spec.kind == "conv":
        data = rng.standard_normal(spec.shape, dtype=np.float32)
        data *= 1 / math.sqrt(spec.fan_in)
        return _identity_path(spec.name, data).astype(np.float16), None
    if spec.kind == "rgb":
        data = rng.standard_normal(spec.shape, dtype=np.float32)
        data -= data.mean(axis=(2, 3), keepdims=True)
        data *= RGB_GAIN / math.sqrt(spec.fan_in)
        return data.astype(np.float16), None
    if spec.kind == "grey":  # TAESD's output is read as 0..1: centre it on mid-grey
        return np.full(spec.shape, 0.5, dtype=np.float32), None
    if spec.kind == "position":
        return (rng.standard_normal(spec.shape, dtype=np.float32) * 0.1), None
    if spec.kind == "ones":
        return np.ones(spec.shape, dtype=np.float32), None
    return np.zeros(spec.shape, dtype=np.float32), None


def _identity_path(name: str, data: np.ndarray) -> np.ndarray:
    """Lay a path through the UNet that carries its input to its output, so that it predicts
    about the noise it is given, as a trained one does (with random weights alone its
    prediction is unrelated to its input, every latent ends far past TAESD's clamp of 3, and an
    image is only the signs of its latent). The first convolution copies the 4 input channels
    to channels 0-3 and their negatives to 4-7; the last res block's skip connection passes
    those 8 (the first block's output, concatenated after channel 320) through untouched; the
    final convolution takes channel k less channel 4+k, which after the group norm and SiLU
    is the normalised input (silu(z) - silu(-z) = z), plus ``RANDOM_SHARE`` of its random
    weights, through which the prompt and the weights still shape the image."""
    centre = data.shape[-1] // 2 if data.ndim == 4 else 0
    if name == f"{_UNET}input_blocks.0.0.weight":
        data[:8] = 0
        for k in range(4):
            data[k, k, centre, centre] = 1
            data[4 + k, k, centre, centre] = -1
    elif name == f"{_UNET}output_blocks.7.0.skip_connection.weight":
        data[:8] = 0
        for k in range(8):
            data[k, 320 + k, 0, 0] = 1
    elif name == f"{_UNET}output_blocks.7.0.out_layers.3.weight":
        data[:8] = 0
    elif name == f"{_UNET}out.2.weight":
        data *= RANDOM_SHARE
        for k in range(4):
            data[k, k, centre, centre] += 1
            data[k, 4 + k, centre, centre] -= 1
    return data


def _drawn(seed: int) -> Iterator[tuple[TensorSpec, np.ndarray, int | None]]:
    """Every tensor's weights, drawn in order from ``seed`` (all of them, written or not, so
    that leaving some out changes none of the others)."""
    rng = np.random.default_rng(seed)
    for spec in sdxs_tensors():
        array, qtype = _weights(spec, rng)
        yield spec, array, qtype


def write_sdxs_model(path: Path, *, seed: int = 0, leave_out: frozenset[str] = frozenset()
                     ) -> WrittenModel:
    """Write the model to ``path`` (GGUF, ``general.architecture`` ``sd1`` as ComfyUI-GGUF's
    converter names SD 1.x files), its weights drawn from ``seed``; ``leave_out``: names, or
    prefixes of names, of tensors not written (a model sd.cpp refuses to load although its
    header is sound; a model without its VAE)."""
    items = [(spec.name, array, qtype) for spec, array, qtype in _drawn(seed)
             if not spec.name.startswith(tuple(leave_out))]
    return _write_gguf(path, items, f"apiary test SDXS-512-DS (random weights, seed {seed})")


def write_taesd(path: Path, *, seed: int = 0) -> WrittenModel:
    """The TAESD decoder of the model of ``seed`` as a file of its own (``taesd_path``), its
    tensors named as TAESD's published files name them (``decoder.layers.N...``)."""
    items = [(spec.name.removeprefix("first_stage_model."), array, qtype)
             for spec, array, qtype in _drawn(seed) if spec.name.startswith(_TAESD)]
    return _write_gguf(path, items, f"apiary test TAESD decoder (random weights, seed {seed})")


def write_sdxs_safetensors(path: Path, *, seed: int = 0) -> WrittenModel:
    """The model of ``seed`` as one safetensors file: its tensors under the same names, the
    Q4_0 ones as F16 of the values their blocks hold (so it renders as the GGUF file does, up
    to sd.cpp's own handling of the two types)."""
    items = [(spec.name, _dequantized(array) if qtype is not None else array)
             for spec, array, qtype in _drawn(seed)]
    entries: dict[str, object] = {"__metadata__": {"title": f"apiary test SDXS-512-DS "
                                                            f"(random weights, seed {seed})"}}
    offset = 0
    for name, array in items:
        dtype = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}[array.dtype]
        entries[name] = {"dtype": dtype, "shape": list(array.shape),
                         "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as handle:
        for chunk in (struct.pack("<Q", len(header)), header,
                      *(np.ascontiguousarray(array).tobytes() for _, array in items)):
            handle.write(chunk)
            digest.update(chunk)
    partial.replace(path)
    return WrittenModel(path=path, sha256=digest.hexdigest(), size_bytes=path.stat().st_size,
                        parameter_count=sum(array.size for _, array in items))


def _dequantized(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 rows (``_q4_0``'s layout) as the F16 values they hold."""
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, _Q4_BYTES)
    scale = flat[:, :2].copy().view(np.float16).astype(np.float32)
    packed = flat[:, 2:]
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32) - 8
    return (nibbles * scale).astype(np.float16).reshape(rows, -1)


def _write_gguf(path: Path, items: list[tuple[str, np.ndarray, int | None]], title: str
                ) -> WrittenModel:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="sd1")
    writer.add_name(title)
    for name, array, qtype in items:
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, array, _ in items:
        writer.write_tensor_data(array)
    writer.close()
    partial.replace(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    parameters = 0
    for _, array, qtype in items:
        parameters += array.size if qtype is None else array.size // _Q4_BYTES * _Q4_BLOCK
    return WrittenModel(path=path, sha256=digest.hexdigest(), size_bytes=path.stat().st_size,
                        parameter_count=parameters)
