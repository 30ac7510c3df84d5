"""Model names and how a filter picks one GGUF model out of a repo (pure functions)."""

from __future__ import annotations

import pytest

from desktop_worker.errors import (
    AmbiguousFilter,
    InvalidModelFile,
    InvalidModelName,
    NoMatchingFile,
)
from desktop_worker.store.names import (
    ModelName,
    parse_model_name,
    quant_tag,
    resolve_filter,
    split_part,
    validate_local_name,
)

# A repo laid out like the popular GGUF repos: quants side by side, a big one split in a folder,
# a vision projector, and files that are not models.
REPO = [
    "README.md",
    ".gitattributes",
    "config.json",
    "Model-7B-Instruct-Q2_K.gguf",
    "Model-7B-Instruct-Q4_0.gguf",
    "Model-7B-Instruct-Q4_0_4_4.gguf",
    "Model-7B-Instruct-Q4_K_M.gguf",
    "Model-7B-Instruct-Q4_K_S.gguf",
    "Model-7B-Instruct-IQ4_XS.gguf",
    "Model-7B-Instruct-IQ4_NL.gguf",
    "Model-7B-Instruct-Q8_0.gguf",
    "Model-7B-Instruct-f16.gguf",
    "Model-7B-Instruct-bf16.gguf",
    "mmproj-Model-7B-f16.gguf",
    "Q6_K/Model-7B-Instruct-Q6_K-00002-of-00003.gguf",
    "Q6_K/Model-7B-Instruct-Q6_K-00001-of-00003.gguf",
    "Q6_K/Model-7B-Instruct-Q6_K-00003-of-00003.gguf",
]


# --- names -------------------------------------------------------------------------------------


def test_parse_model_name_splits_repo_and_filter() -> None:
    name = parse_model_name("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    assert name == ModelName("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "Q4_K_M")
    assert str(name) == "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_K_M"


@pytest.mark.parametrize(
    ("text", "repo_id", "filter_"),
    [
        ("a/b:c", "a/b", "c"),
        ("bartowski/Llama-3.2-1B-GGUF:IQ4_XS", "bartowski/Llama-3.2-1B-GGUF", "IQ4_XS"),
        ("user_1/repo.v2:Q4_K_M/part", "user_1/repo.v2", "Q4_K_M/part"),
        ("u/r:model-f16.gguf", "u/r", "model-f16.gguf"),
    ],
)
def test_parse_model_name_accepts(text: str, repo_id: str, filter_: str) -> None:
    parsed = parse_model_name(text)
    assert (parsed.repo_id, parsed.filter) == (repo_id, filter_)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected hf-user/hf-repo:filter"),
        ("user/repo", "expected hf-user/hf-repo:filter"),
        ("repo:Q4_K_M", "must be hf-user/hf-repo"),
        ("a/b/c:Q4", "must be hf-user/hf-repo"),
        ("/repo:Q4", "must be hf-user/hf-repo"),
        ("user/:Q4", "must be hf-user/hf-repo"),
        ("user/repo:", "empty"),
        ("user/repo:Q4:K", "may not hold"),
        ("user/repo:Q4 K", "may not hold"),
        ("user/repo:Q4\tK", "may not hold"),
        ("user/repo:--", "at least one letter"),
        ("us er/repo:Q4", "not a valid Hugging Face"),
        ("user/re--po:Q4", "not a valid Hugging Face"),
        ("user/re..po:Q4", "not a valid Hugging Face"),
        ("-user/repo:Q4", "not a valid Hugging Face"),
        ("user/repo-:Q4", "not a valid Hugging Face"),
        ("u/" + "r" * 100 + ":Q4", "longer than 96"),
        ("u/r:" + "q" * 201, "longer than 200"),
    ],
)
def test_parse_model_name_rejects(text: str, reason: str) -> None:
    with pytest.raises(InvalidModelName, match=reason):
        parse_model_name(text)


def test_parse_model_name_rejects_non_text() -> None:
    with pytest.raises(InvalidModelName, match="must be text"):
        parse_model_name(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["my-model", "team/tuned:q4", "local/smol:Q4_1", "a", "x@1+2"])
def test_validate_local_name_accepts(name: str) -> None:
    assert validate_local_name(name) == name


@pytest.mark.parametrize("name", ["", " x", "-x", "a b", "a/../b", "x" * 201, "a\nb", "é"])
def test_validate_local_name_rejects(name: str) -> None:
    with pytest.raises(InvalidModelName):
        validate_local_name(name)


# --- helpers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("m-00001-of-00003.gguf", ("m", 1, 3)),
        ("dir/m-Q6_K-00003-of-00003.GGUF", ("dir/m-Q6_K", 3, 3)),
        ("m-0001-of-0003.gguf", None),
        ("m.gguf", None),
    ],
)
def test_split_part(path: str, expected: tuple[str, int, int] | None) -> None:
    assert split_part(path) == expected


@pytest.mark.parametrize(
    ("path", "tag"),
    [
        ("Model-7B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("model-iq3_xxs.gguf", "IQ3_XXS"),
        ("model-bf16.gguf", "BF16"),
        ("Q6_K/Model-Q6_K-00001-of-00003.gguf", "Q6_K"),
        ("model-UD-Q4_K_XL.gguf", "Q4_K_XL"),
        ("model.gguf", None),
        ("model-7B.gguf", None),
    ],
)
def test_quant_tag(path: str, tag: str | None) -> None:
    assert quant_tag(path) == tag


# --- resolve_filter ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filter_", "expected"),
    [
        # an exact quant tag wins over longer tags that contain it
        ("Q4_K_M", "Model-7B-Instruct-Q4_K_M.gguf"),
        ("Q4_0", "Model-7B-Instruct-Q4_0.gguf"),  # not Q4_0_4_4
        ("f16", "Model-7B-Instruct-f16.gguf"),  # not bf16, not the mmproj
        ("bf16", "Model-7B-Instruct-bf16.gguf"),
        ("IQ4_XS", "Model-7B-Instruct-IQ4_XS.gguf"),
        ("Q4_0_4_4", "Model-7B-Instruct-Q4_0_4_4.gguf"),
        # case-insensitive
        ("q4_k_m", "Model-7B-Instruct-Q4_K_M.gguf"),
        ("Q8_0", "Model-7B-Instruct-Q8_0.gguf"),
        ("q2_k", "Model-7B-Instruct-Q2_K.gguf"),
        # several words as a run
        ("Instruct-Q8_0", "Model-7B-Instruct-Q8_0.gguf"),
        ("instruct.q8_0", "Model-7B-Instruct-Q8_0.gguf"),
        # the full file name, with or without the suffix
        ("Model-7B-Instruct-Q4_K_S.gguf", "Model-7B-Instruct-Q4_K_S.gguf"),
        ("model-7b-instruct-q4_k_s", "Model-7B-Instruct-Q4_K_S.gguf"),
        # a substring when no whole word matches
        ("IQ4_N", "Model-7B-Instruct-IQ4_NL.gguf"),
        ("Q2", "Model-7B-Instruct-Q2_K.gguf"),
        # the projector only when asked for
        ("mmproj", "mmproj-Model-7B-f16.gguf"),
    ],
)
def test_resolve_filter_picks_one_file(filter_: str, expected: str) -> None:
    resolved = resolve_filter(REPO, filter_)
    assert resolved.paths == (expected,)
    assert resolved.first == expected
    assert not resolved.is_split


def test_split_model_is_one_candidate_with_parts_in_order() -> None:
    resolved = resolve_filter(REPO, "q6_k")
    assert resolved.paths == (
        "Q6_K/Model-7B-Instruct-Q6_K-00001-of-00003.gguf",
        "Q6_K/Model-7B-Instruct-Q6_K-00002-of-00003.gguf",
        "Q6_K/Model-7B-Instruct-Q6_K-00003-of-00003.gguf",
    )
    assert resolved.is_split
    assert resolved.quant == "Q6_K"
    assert resolved.label == "Q6_K/Model-7B-Instruct-Q6_K-00001-of-00003.gguf (3 parts)"


def test_split_model_matches_by_folder_and_by_its_name_without_suffix() -> None:
    by_name = resolve_filter(REPO, "Q6_K/Model-7B-Instruct-Q6_K")
    by_first_part = resolve_filter(REPO, "Model-7B-Instruct-Q6_K-00001-of-00003.gguf")
    assert by_name.paths == by_first_part.paths
    assert len(by_name.paths) == 3


def test_a_tag_prefix_is_ambiguous_and_lists_only_the_matches() -> None:
    with pytest.raises(AmbiguousFilter) as caught:
        resolve_filter(REPO, "Q4_K")
    assert caught.value.candidates == [
        "Model-7B-Instruct-Q4_K_M.gguf",
        "Model-7B-Instruct-Q4_K_S.gguf",
    ]
    assert "Q4_K_M" in str(caught.value)
    assert "Q4_K_S" in str(caught.value)


def test_ambiguity_lists_split_groups_once() -> None:
    with pytest.raises(AmbiguousFilter) as caught:
        resolve_filter(REPO, "7B-Instruct")
    labels = caught.value.candidates
    assert "Q6_K/Model-7B-Instruct-Q6_K-00001-of-00003.gguf (3 parts)" in labels
    assert not any("00002" in label for label in labels)
    assert len(labels) == 11  # every non-projector model, the split one counted once


def test_ambiguous_delimited_match_does_not_fall_through_to_substrings() -> None:
    files = ["a-Q4_1.gguf", "b-Q4_1.gguf", "c-Q4_1x.gguf"]
    with pytest.raises(AmbiguousFilter) as caught:
        resolve_filter(files, "Q4_1")
    assert caught.value.candidates == ["a-Q4_1.gguf", "b-Q4_1.gguf"]


def test_exact_file_name_beats_a_longer_name_with_the_same_words() -> None:
    files = ["m-Q4_1.gguf", "m-Q4_1-imat.gguf"]
    assert resolve_filter(files, "m-Q4_1").paths == ("m-Q4_1.gguf",)
    assert resolve_filter(files, "imat").paths == ("m-Q4_1-imat.gguf",)


def test_no_match_lists_every_candidate() -> None:
    with pytest.raises(NoMatchingFile) as caught:
        resolve_filter(REPO, "Q3_K_L")
    candidates = caught.value.candidates
    assert "Model-7B-Instruct-Q2_K.gguf" in candidates
    assert "Q6_K/Model-7B-Instruct-Q6_K-00001-of-00003.gguf (3 parts)" in candidates
    assert "README.md" not in candidates
    assert "mmproj-Model-7B-f16.gguf" not in candidates
    assert "Model-7B-Instruct-Q2_K.gguf" in str(caught.value)


def test_repo_without_gguf_files() -> None:
    files = ["README.md", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with pytest.raises(NoMatchingFile, match=r"no \.gguf") as caught:
        resolve_filter(files, "model")
    assert caught.value.candidates == []  # shards are no single-file checkpoint


# A diffusion repo laid out like stabilityai/sdxl-turbo: single-file checkpoints at the top, the
# diffusers layout's parts in folders.
SDXL = [
    "README.md",
    "model_index.json",
    "sd_xl_turbo_1.0.safetensors",
    "sd_xl_turbo_1.0_fp16.safetensors",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/model-00001-of-00002.safetensors",
]


def test_a_repo_of_no_gguf_files_picks_a_single_safetensors_file() -> None:
    assert resolve_filter(SDXL, "sd_xl_turbo_1.0_fp16").paths == (
        "sd_xl_turbo_1.0_fp16.safetensors",)
    assert resolve_filter(SDXL, "sd_xl_turbo_1.0.safetensors").paths == (
        "sd_xl_turbo_1.0.safetensors",)
    assert resolve_filter(SDXL, "fp16").paths == ("sd_xl_turbo_1.0_fp16.safetensors",)
    with pytest.raises(NoMatchingFile) as missing:  # a diffusers pipeline's parts are not models
        resolve_filter(SDXL, "diffusion_pytorch_model")
    assert missing.value.candidates == ["sd_xl_turbo_1.0.safetensors",
                                        "sd_xl_turbo_1.0_fp16.safetensors"]
    without_index = [path for path in SDXL if path != "model_index.json"]
    assert resolve_filter(without_index, "unet/diffusion_pytorch_model.fp16").paths == (
        "unet/diffusion_pytorch_model.fp16.safetensors",)
    with pytest.raises(NoMatchingFile):  # shards never are
        resolve_filter(without_index, "text_encoder/model-00001-of-00002")


def test_a_gguf_repo_picks_safetensors_only_when_the_filter_names_the_suffix() -> None:
    files = ["m-Q8_0.gguf", "m-Q8_0.safetensors"]
    assert resolve_filter(files, "Q8_0").paths == ("m-Q8_0.gguf",)
    assert resolve_filter(files, "m-Q8_0.safetensors").paths == ("m-Q8_0.safetensors",)


def test_non_gguf_files_never_match() -> None:
    files = ["model-Q4_K_M.safetensors", "notes-Q4_K_M.md", "model-Q4_K_M.gguf"]
    assert resolve_filter(files, "Q4_K_M").paths == ("model-Q4_K_M.gguf",)


def test_gguf_suffix_is_case_insensitive() -> None:
    assert resolve_filter(["M-Q8_0.GGUF"], "q8_0").paths == ("M-Q8_0.GGUF",)


def test_models_in_subfolders_are_found() -> None:
    files = ["quants/deep/model-Q5_K_M.gguf", "model-Q4_K_M.gguf"]
    assert resolve_filter(files, "Q5_K_M").paths == ("quants/deep/model-Q5_K_M.gguf",)
    assert resolve_filter(files, "deep").paths == ("quants/deep/model-Q5_K_M.gguf",)


def test_single_part_split_counts_as_a_plain_file() -> None:
    resolved = resolve_filter(["m-Q4_K_M-00001-of-00001.gguf"], "Q4_K_M")
    assert resolved.paths == ("m-Q4_K_M-00001-of-00001.gguf",)
    assert resolved.label == "m-Q4_K_M-00001-of-00001.gguf"


def test_split_model_with_missing_parts_is_refused() -> None:
    files = ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"]
    with pytest.raises(InvalidModelFile, match="2 of 3 present"):
        resolve_filter(files, "Q8_0")


def test_resolved_quant_comes_from_the_file_name() -> None:
    assert resolve_filter(REPO, "IQ4_NL").quant == "IQ4_NL"
    assert resolve_filter(["plain.gguf"], "plain").quant is None


def test_duplicate_listing_entries_do_not_cause_ambiguity() -> None:
    assert resolve_filter(["m-Q8_0.gguf", "m-Q8_0.gguf"], "Q8_0").paths == ("m-Q8_0.gguf",)
