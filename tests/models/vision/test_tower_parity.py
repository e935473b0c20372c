"""The vision tower against HF's Qwen3.5 / Qwen3-VL vision models on the same random weights."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_vision import hf_vision_model, random_pixels, vision_config
from qwenserve.models.vision.tower import Qwen3VisionTower

ONE = [(1, 4, 6)]
TWO_SIZES = [(1, 4, 6), (1, 8, 4)]
# equal sizes batch together (adjacent and not), a 2 x 2 grid, a two-frame clip
VARLEN = [(1, 4, 6), (1, 2, 2), (1, 4, 6), (1, 8, 4), (1, 2, 2), (1, 2, 2), (2, 4, 4)]
BF16_UNIT_ROUNDOFF = 2.0**-8


def ours(family: str, hf_model, dtype=torch.float32) -> Qwen3VisionTower:
    tower = Qwen3VisionTower(vision_config(family), dtype)
    tower.load_weights(hf_model.state_dict().items())
    return tower


@torch.no_grad()
def hf_forward(model, grids, pixels):
    out = model(hidden_states=pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def family_models(request):
    hf = hf_vision_model(request.param, seed=1)
    return request.param, hf, ours(request.param, hf)


@pytest.mark.parametrize("grids", [ONE, TWO_SIZES, VARLEN], ids=["one", "two_sizes", "varlen"])
def test_fp32_matches_hf(family_models, grids):
    family, hf, tower = family_models
    pixels = random_pixels(grids, seed=2)
    ref, ref_deep = hf_forward(hf, grids, pixels)
    with torch.no_grad():
        out = tower(pixels, grids)
    assert out.embeds.shape == (sum(t * h * w for t, h, w in grids) // 4, 48)
    torch.testing.assert_close(out.embeds, ref, rtol=1e-5, atol=1e-5)
    assert len(out.deepstack) == (2 if family == "qwen3_vl" else 0) == len(ref_deep)
    for got, want in zip(out.deepstack, ref_deep):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_images_in_a_batch_do_not_see_each_other(family_models):
    """Block-diagonal attention: each image's tokens equal those of the image run alone."""
    _, _, tower = family_models
    pixels = random_pixels(VARLEN, seed=3)
    with torch.no_grad():
        batched = tower(pixels, VARLEN)
        alone = [tower(p, [g]) for p, g in zip(
            pixels.split([t * h * w for t, h, w in VARLEN]), VARLEN)]
    tokens = [t * h * w // 4 for t, h, w in VARLEN]
    for got, want in zip(batched.split(tokens), alone):
        torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5)
        for g, w in zip(got.deepstack, want.deepstack):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_every_gemm_runs_through_the_platform_linear(family_models):
    """The tower's GEMMs go through the ``linear`` it is given (the engine passes
    ``Backends.float_linear``: oneDNN for fp32 on CPU), and that still matches HF."""
    from qwenserve.platforms.cpu import CpuPlatform

    family, hf, _ = family_models
    platform_linear = CpuPlatform().float_linear() or torch.nn.functional.linear
    calls = []

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return platform_linear(x, weight, bias)

    tower = Qwen3VisionTower(vision_config(family), torch.float32, linear=counting)
    tower.load_weights(hf.state_dict().items())
    pixels = random_pixels(TWO_SIZES, seed=5)
    ref, _ = hf_forward(hf, TWO_SIZES, pixels)
    with torch.no_grad():
        out = tower(pixels, TWO_SIZES)
    torch.testing.assert_close(out.embeds, ref, rtol=1e-5, atol=1e-5)
    linears = [m for m in tower.modules() if hasattr(m, "quant_method")]
    assert len(calls) == len(linears)  # patch embed, 4 per block, 2 per merger


def test_bf16_error_is_bf16_rounding(family_models):
    """bf16 against the fp32 truth: no worse than HF's own bf16 run (x2), and within the error
    a few roundings of bf16's unit roundoff (2^-8) per block give."""
    family, hf, _ = family_models
    pixels = random_pixels(VARLEN, seed=4)
    truth, _ = hf_forward(hf, VARLEN, pixels)
    hf_bf16, _ = hf_forward(hf_vision_model(family, seed=1).to(torch.bfloat16), VARLEN, pixels)
    with torch.no_grad():
        got = ours(family, hf, torch.bfloat16)(pixels, VARLEN).embeds
    assert got.dtype == torch.bfloat16
    depth = vision_config(family).depth
    ours_err, hf_err = rel_err(got, truth), rel_err(hf_bf16, truth)
    assert ours_err <= max(2 * hf_err, BF16_UNIT_ROUNDOFF), (ours_err, hf_err)
    assert ours_err <= 4 * (depth + 2) * BF16_UNIT_ROUNDOFF, ours_err


def test_weight_loading_names_the_problem():
    hf = hf_vision_model("qwen3_5")
    tower = Qwen3VisionTower(vision_config("qwen3_5"), torch.float32)
    weights = dict(hf.state_dict())
    with pytest.raises(ValueError, match="lacks weights for blocks.0.mlp.linear_fc1.weight"):
        tower.load_weights((k, v) for k, v in weights.items() if k != "blocks.0.mlp.linear_fc1"
                           ".weight")
    with pytest.raises(ValueError, match="'model.visual.blocks.7.attn.qkv.weight' does not"):
        tower.load_weights([("blocks.7.attn.qkv.weight", torch.zeros(1))])
    weights["merger.linear_fc2.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 3\) in the checkpoint"):
        tower.load_weights(weights.items())


# the published large tower (HF's Qwen3_5VisionConfig defaults, Qwen3.5-27B's)
PUBLISHED = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                 out_hidden_size=2048, num_position_embeddings=2304)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_tower_builds_on_the_meta_device_with_hf_parameter_count(family):
    """``qwenserve plan`` counts weights on a meta-device model; the tower counts like HF's."""
    import transformers as tf

    cfg = vision_config(family, **PUBLISHED)
    cls = (tf.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel if family == "qwen3_vl"
           else tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel)
    with torch.device("meta"):
        tower = Qwen3VisionTower(cfg, torch.bfloat16)
        reference = cls._from_config(cfg)
    assert all(p.device.type == "meta" for p in tower.parameters())
    count = sum(p.numel() for p in tower.parameters())
    assert count == sum(p.numel() for p in reference.parameters())


def test_the_model_builds_its_tower_with_the_platform_linear():
    """``build_vision`` hands the tower ``ModelContext.backends.float_linear`` (issue 14: the
    vision layers had F.linear while the text layers had the platform GEMM)."""
    from dataclasses import replace

    from helpers.tiny_vision import hf_vl_model
    from qwenserve.layers.backends import Backends
    from qwenserve.models.base import ModelContext
    from qwenserve.models.qwen3_vl import Qwen3VLForConditionalGeneration

    def platform_gemm(x, weight, bias=None):
        return torch.nn.functional.linear(x, weight, bias)

    config = hf_vl_model("qwen3_vl").config
    text = config.get_text_config()
    text.vision_config = config.vision_config
    backends = replace(Backends.reference(), float_linear=platform_gemm)
    model = Qwen3VLForConditionalGeneration(ModelContext(text, torch.float32, 64,
                                                         backends=backends))
    linears = [m for m in model.visual.modules() if hasattr(m, "quant_method")]
    assert linears and all(m.quant_method.linear is platform_gemm for m in linears)
