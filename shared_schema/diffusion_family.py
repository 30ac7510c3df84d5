"""Which diffusion model a tensor table is, by stable-diffusion.cpp 0.4.7's own rules.

``sd_family`` mirrors ``ModelLoader::get_sd_version`` (``src/model.cpp``) rule for rule: the
same substrings of tensor names, the same shapes (``input_blocks.0.0.weight``'s input channels
tell inpainting and editing models apart, the token embedding's width SD 1.x from SD 2.x, a
missing ``middle_block.1`` the tiny UNets), in the same order, with the same early answers, over
the tensors in the order sd.cpp walks them (a GGUF file's order; a safetensors header's names
sorted, as its JSON library keeps objects). Shapes are ggml's (``ne[0]``, a row, first).

The family's name (``"sd1"``, ``"sdxs"``, ``"sdxl"``, ``"flux"``, ...) is what the store, the
queen's pricing and ``/v1/models`` show. ``RENDERED_FAMILIES`` are those Apiary renders from a
prompt, each with its native side (``native_side``): the SD 1.x, 2.x and XL UNets, SD3 and FLUX
(issue 38). The others sd.cpp knows need an input image (inpainting, editing, FLUX fill and
controls), make video (SVD, Wan) or are not served yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ALL_FAMILIES",
    "RENDERED_FAMILIES",
    "ModelParts",
    "model_parts",
    "native_side",
    "sd_family",
]

# sd.cpp's SDVersion, as names (model.h's enum, in order).
ALL_FAMILIES = (
    "sd1", "sd1_inpaint", "sd1_pix2pix", "sd1_tiny", "sd2", "sd2_inpaint", "sd2_tiny", "sdxs",
    "sdxs_09", "sdxl", "sdxl_inpaint", "sdxl_pix2pix", "sdxl_vega", "sdxl_ssd1b", "svd", "sd3",
    "flux", "flux_fill", "flux_controls", "flex_2", "chroma_radiance", "wan2", "wan2_2_i2v",
    "wan2_2_ti2v", "qwen_image", "anima", "flux2", "flux2_klein", "z_image", "ovis_image",
    "ernie_image",
)

# What Apiary renders from a prompt, and each one's native side in pixels.
RENDERED_FAMILIES: Mapping[str, int] = {
    "sd1": 512, "sd1_tiny": 512, "sdxs": 512,
    "sd2": 768, "sd2_tiny": 512, "sdxs_09": 512,
    "sdxl": 1024, "sdxl_vega": 1024, "sdxl_ssd1b": 1024,
    "sd3": 1024,
    "flux": 1024, "flux2": 1024, "flux2_klein": 1024,
}

# Where a model's parts live, by the name prefixes sd.cpp's loader maps (name_conversion.cpp).
DENOISER_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "unet.", "transformer.")
TEXT_ENCODER_PREFIXES = ("cond_stage_model.", "conditioner.embedders.", "text_encoders.",
                         "text_encoder.", "text_model.", "te.", "te1.", "te2.", "te3.")
VAE_PREFIXES = ("first_stage_model.", "vae.")

_TOKEN_EMBEDDINGS = frozenset({
    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
    "cond_stage_model.model.token_embedding.weight",
    "text_model.embeddings.token_embedding.weight",
    "te.text_model.embeddings.token_embedding.weight",
    "conditioner.embedders.0.model.token_embedding.weight",
    "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
})
_INPUT_WEIGHTS = frozenset({"model.diffusion_model.input_blocks.0.0.weight",
                            "model.diffusion_model.img_in.weight", "unet.conv_in.weight"})
# Markers that settle the family at once, checked in this order for each tensor.
_EARLY = (
    ("model.diffusion_model.nerf_final_layer_conv.", "chroma_radiance"),
    ("model.diffusion_model.joint_blocks.", "sd3"),
    ("model.diffusion_model.transformer_blocks.0.img_mod.1.weight", "qwen_image"),
    ("llm_adapter.blocks.0.cross_attn.q_proj.weight", "anima"),
)
_LATE = (
    ("model.diffusion_model.double_blocks.0.img_mlp.gate_proj.weight", "ovis_image"),
    ("model.diffusion_model.cap_embedder.0.weight", "z_image"),
    ("model.diffusion_model.layers.0.adaLN_sa_ln.weight", "ernie_image"),
)


def _ne(shape: Sequence[int] | None, axis: int) -> int:
    """ggml's ``ne[axis]`` (1 past a tensor's dimensions, as sd.cpp's ``TensorStorage``)."""
    if shape is None or axis >= len(shape):
        return 1
    return shape[axis]


@dataclass(slots=True)
class _Marks:
    """What the walk over the tensors found (``get_sd_version``'s locals)."""

    is_unet: bool = False
    is_xl: bool = False
    multiple_encoders: bool = False
    is_flux: bool = False
    is_flux2: bool = False
    single_block_47: bool = False
    is_wan: bool = False
    patch_channels: int = 0
    img_emb: bool = False
    middle_block_1: bool = False
    output_block_311: bool = False
    output_block_71: bool = False
    attn_1024: bool = False
    is_video: bool = False  # SVD: sd.cpp answers at once
    token_embedding: Sequence[int] | None = None
    input_weight: Sequence[int] | None = None

    def see(self, name: str, shape: Sequence[int]) -> str | None:
        """Take one tensor in; a family when this tensor settles it."""
        if "model.diffusion_model.double_blocks." in name:
            self.is_flux = True
        for marker, family in _EARLY:
            if marker in name:
                return family
        if "model.diffusion_model.double_stream_modulation_img.lin.weight" in name:
            self.is_flux2 = True
        if "single_blocks.47.linear1.weight" in name:
            self.single_block_47 = True
        for marker, family in _LATE:
            if marker in name:
                return family
        self._see_unet_and_video(name, shape)
        if name in _TOKEN_EMBEDDINGS:
            self.token_embedding = shape
        if name in _INPUT_WEIGHTS:
            self.input_weight = shape
        return None

    def _see_unet_and_video(self, name: str, shape: Sequence[int]) -> None:
        if "model.diffusion_model.blocks.0.cross_attn.norm_k.weight" in name:
            self.is_wan = True
        if "model.diffusion_model.patch_embedding.weight" in name:
            self.patch_channels = _ne(shape, 3)
        if "model.diffusion_model.img_emb" in name:
            self.img_emb = True
        if "model.diffusion_model.input_blocks." in name or "unet.down_blocks." in name:
            self.is_unet = True
            self.is_xl = self.is_xl or self.multiple_encoders
        if any(m in name for m in ("conditioner.embedders.1", "cond_stage_model.1", "te.1")):
            self.multiple_encoders = True
            self.is_xl = self.is_xl or self.is_unet
        if "model.diffusion_model.input_blocks.8.0.time_mixer.mix_factor" in name:
            self.is_video = True
        if ("model.diffusion_model.middle_block.1." in name
                or "unet.mid_block.resnets.1." in name):
            self.middle_block_1 = True
        if ("model.diffusion_model.output_blocks.3.1.transformer_blocks.1" in name
                or "unet.up_blocks.1.attentions.0.transformer_blocks.1" in name):
            self.output_block_311 = True
        if ("model.diffusion_model.output_blocks.7.1" in name
                or "unet.up_blocks.2.attentions.1" in name):
            self.output_block_71 = True
            if ("model.diffusion_model.output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight"
                    in name and _ne(shape, 0) == 1024):
                self.attn_1024 = True


def sd_family(tensors: Iterable[tuple[str, Sequence[int]]]) -> str | None:
    """The family sd.cpp reads a model as, from its tensors' names and ggml shapes in sd.cpp's
    order; None where sd.cpp would answer ``VERSION_COUNT`` (no diffusion model it knows)."""
    marks = _Marks()
    for name, shape in tensors:
        settled = marks.see(name, shape)
        if settled is not None:
            return settled
        if marks.is_video:
            return "svd"
    return _decide(marks)


def _decide(m: _Marks) -> str | None:
    if m.is_wan:
        if m.patch_channels == 184320 and not m.img_emb:
            return "wan2_2_i2v"
        if m.patch_channels == 147456 and not m.img_emb:
            return "wan2_2_ti2v"
        return "wan2"
    in_channels = _ne(m.input_weight, 2)
    inpaint, edit = in_channels == 9, in_channels == 8
    if m.is_xl:
        if inpaint:
            return "sdxl_inpaint"
        if edit:
            return "sdxl_pix2pix"
        if not m.middle_block_1:
            return "sdxl_ssd1b" if m.output_block_311 else "sdxl_vega"
        return "sdxl"
    if m.is_flux and not m.is_flux2:
        return {384: "flux_fill", 128: "flux_controls", 196: "flex_2"}.get(
            _ne(m.input_weight, 0), "flux")
    if m.is_flux2:
        return "flux2" if m.single_block_47 else "flux2_klein"
    width = _ne(m.token_embedding, 0) if m.token_embedding is not None else 0
    if width == 768:
        if inpaint:
            return "sd1_inpaint"
        if edit:
            return "sd1_pix2pix"
        if not m.middle_block_1:
            return "sd1_tiny" if m.output_block_71 else "sdxs"
        return "sd1"
    if width == 1024:
        if inpaint:
            return "sd2_inpaint"
        if not m.middle_block_1:
            return "sdxs_09" if m.attn_1024 else "sd2_tiny"
        return "sd2"
    return None


def native_side(family: str) -> int | None:
    """The side, in pixels, the family's models are trained at (``size: "auto"``); None for a
    family Apiary does not render."""
    return RENDERED_FAMILIES.get(family)


@dataclass(frozen=True, slots=True)
class ModelParts:
    """Parameters by part, as sd.cpp's loader tells the parts apart by name."""

    denoiser: int
    text_encoder: int
    vae: int
    other: int

    @property
    def total(self) -> int:
        return self.denoiser + self.text_encoder + self.vae + self.other


def model_parts(tensors: Iterable[tuple[str, int]]) -> ModelParts:
    """Each part's parameter count from ``(name, element count)`` pairs."""
    denoiser = text = vae = other = 0
    for name, count in tensors:
        if name.startswith(DENOISER_PREFIXES):
            denoiser += count
        elif name.startswith(TEXT_ENCODER_PREFIXES):
            text += count
        elif name.startswith(VAE_PREFIXES):
            vae += count
        else:
            other += count
    return ModelParts(denoiser=denoiser, text_encoder=text, vae=vae, other=other)
