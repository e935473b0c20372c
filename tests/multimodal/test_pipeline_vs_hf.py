"""The whole image path before the decoder, checked through HF's own model.

Our pieces (HF image processor, placeholder expansion, vision tower, M-RoPE positions, image
rows and deep-stack features, also when a chunked prefill cuts an image) feed HF's language model;
its hidden states must equal HF's full multimodal forward on the same prompt and images. This is
the contract the engine's decoder will meet in the second round.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_vision import hf_vl_model, random_image, vl_tokenizer, write_preprocessor_config
from qwenserve.models.vision.tower import Qwen3VisionTower
from qwenserve.multimodal.inputs import image_slices
from qwenserve.multimodal.mrope import prompt_mrope
from qwenserve.multimodal.processor import ImageProcessor
from qwenserve.multimodal.prompt import ImagePromptFormat, expand_image_tokens


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def setup(request, tmp_path_factory):
    model = hf_vl_model(request.param, seed=7)
    tokenizer = vl_tokenizer()
    fmt = ImagePromptFormat.from_config(model.config, tokenizer)
    processor = ImageProcessor.from_model_dir(
        write_preprocessor_config(str(tmp_path_factory.mktemp("proc"))),
        model.config.vision_config)
    tower = Qwen3VisionTower(model.config.vision_config, torch.float32)
    tower.load_weights((k[len("visual."):], v) for k, v in model.state_dict().items()
                       if k.startswith("visual."))
    return model, tokenizer, fmt, processor, tower


def prepared(setup, text_parts):
    """Tokenize a prompt whose images are PIL images among text parts; expand and process."""
    model, tokenizer, fmt, processor, _ = setup
    text = "".join(fmt.placeholder if not isinstance(p, str) else p for p in text_parts)
    images = [p for p in text_parts if not isinstance(p, str)]
    processed = processor.process(images)
    prompt = expand_image_tokens(tokenizer.encode(text), fmt.image_token_id,
                                 [p.grid_thw for p in processed],
                                 [p.content_hash for p in processed], processor.merge_size)
    return prompt, processed


@torch.no_grad()
def hf_reference(model, prompt, processed):
    ids = torch.tensor([prompt.token_ids])
    out = model(input_ids=ids, pixel_values=torch.cat([p.pixel_values for p in processed]),
                image_grid_thw=torch.tensor([p.grid_thw for p in processed]),
                mm_token_type_ids=(ids == model.config.image_token_id).int())
    return out.last_hidden_state[0]


@torch.no_grad()
def ours_through_hf_decoder(setup, prompt, processed, chunk: int):
    """Image rows filled chunk by chunk from per-image encoder outputs (as the engine will)."""
    model, _, _, _, tower = setup
    outputs = [tower(p.pixel_values, [p.grid_thw]) for p in processed]  # encoder, per image
    n = len(prompt.token_ids)
    embeds = model.language_model.embed_tokens(torch.tensor(prompt.token_ids))  # [T, H]
    depth = len(outputs[0].deepstack)
    deepstack = torch.zeros(depth, n, embeds.shape[1])
    is_image = torch.zeros(n, dtype=torch.bool)
    for start in range(0, n, chunk):
        for s in image_slices(prompt.placements, start, min(start + chunk, n)):
            rows = slice(start + s.chunk_offset, start + s.chunk_offset + s.token_end
                         - s.token_start)
            out = outputs[s.image_index]
            embeds[rows] = out.embeds[s.token_start:s.token_end]
            for layer in range(depth):
                deepstack[layer, rows] = out.deepstack[layer][s.token_start:s.token_end]
            is_image[rows] = True
    positions, _ = prompt_mrope(n, prompt.placements)
    kwargs = {}
    if depth:
        kwargs = dict(visual_pos_masks=is_image[None],
                      deepstack_visual_embeds=[d[is_image] for d in deepstack])
    out = model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None],
                               **kwargs)
    return out.last_hidden_state[0]


# fp32 rounding: the tower's patch embedding is a GEMM where HF runs a Conv3d (~1e-6 apart),
# then the random decoder amplifies it; measured ~6e-6 in norm
FP32_NOISE = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


PROMPTS = {
    "one_image": ["Hello ", random_image(40, 24, seed=1), " what?"],
    "two_sizes": ["a", random_image(40, 24, seed=1), "b c", random_image(20, 72, seed=2), "d"],
    "image_text_image": [random_image(33, 33, seed=3), " vs ", random_image(64, 16, seed=4)],
}


@pytest.mark.parametrize("name,chunk", [("one_image", 1000), ("two_sizes", 5),
                                        ("image_text_image", 7)])
def test_hidden_states_match_hf(setup, name, chunk):
    """Whole prompts, and chunks of 5 or 7 tokens that cut through the images."""
    prompt, processed = prepared(setup, PROMPTS[name])
    assert len(prompt.placements) == len(processed) >= 1
    want = hf_reference(setup[0], prompt, processed)
    got = ours_through_hf_decoder(setup, prompt, processed, chunk)
    assert rel_err(got, want) < FP32_NOISE, rel_err(got, want)


def test_a_different_image_changes_the_result(setup):
    """Guard: the comparison above would notice a wrong image in a slot."""
    prompt, processed = prepared(setup, PROMPTS["two_sizes"])
    want = hf_reference(setup[0], prompt, processed)
    swapped_prompt, swapped = prepared(setup, ["a", random_image(40, 24, seed=9), "b c",
                                               random_image(20, 72, seed=2), "d"])
    assert swapped_prompt.token_ids == prompt.token_ids
    got = ours_through_hf_decoder(setup, swapped_prompt, swapped, 1000)
    assert rel_err(got, want) > 100 * FP32_NOISE
