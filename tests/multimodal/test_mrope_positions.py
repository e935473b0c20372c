"""M-RoPE position ids against HF's ``get_rope_index`` (Qwen3.5, Qwen3-VL), and what follows the
prompt (decode, chunks, recomputation after preemption)."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.tiny_models import _config
from helpers.tiny_vision import VISION
from qwenserve.multimodal.inputs import ImagePlacement, mrope_position_delta
from qwenserve.multimodal.mrope import mrope_positions, positions_for_range, prompt_mrope

IMG, VS, VE = 9, 7, 8  # image, vision start and end token ids of these prompts


def prompt(layout: list) -> tuple[list[int], list[ImagePlacement]]:
    """``layout``: ints are runs of text tokens, tuples are image grids (patches)."""
    ids, placements = [], []
    for item in layout:
        if isinstance(item, int):
            ids += [100 + len(ids) + i for i in range(item)]
            continue
        ids.append(VS)
        placements.append(ImagePlacement(len(ids), item, 2, f"h{len(placements)}"))
        ids += [IMG] * placements[-1].num_tokens
        ids.append(VE)
    return ids, placements


LAYOUTS = {
    "text_image_text": [5, (1, 4, 6), 3],
    "two_sizes": [2, (1, 4, 6), 4, (1, 8, 4), 6],
    "image_first": [(1, 6, 6), 1],
    "image_last": [3, (1, 2, 8)],
    "adjacent": [1, (1, 4, 4), (1, 2, 2), (1, 4, 2), 2],
}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def hf_model(request):
    import transformers as tf

    vision = {k: v for k, v in VISION.items()}
    if request.param == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config=_config("qwen3_5").to_dict(), vision_config=vision,
                               image_token_id=IMG, vision_start_token_id=VS,
                               vision_end_token_id=VE)
        return tf.Qwen3_5Model(cfg).eval()
    text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    cfg = tf.Qwen3VLConfig(text_config=text, vision_config={**vision, "out_hidden_size": 32},
                           image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE)
    return tf.Qwen3VLModel(cfg).eval()


def hf_rope_index(model, ids: list[int], placements: list[ImagePlacement]):
    input_ids = torch.tensor([ids])
    types = (input_ids == IMG).int()
    grids = torch.tensor([p.grid_thw for p in placements]) if placements else None
    positions, deltas = model.get_rope_index(input_ids, types, image_grid_thw=grids)
    return positions[:, 0], int(deltas[0, 0])


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_prompt_positions_match_hf(hf_model, layout):
    ids, placements = prompt(LAYOUTS[layout])
    want, want_delta = hf_rope_index(hf_model, ids, placements)
    got, delta = prompt_mrope(len(ids), placements)
    assert torch.equal(got, want)
    assert delta == want_delta


def test_text_only_prompt_is_plain_positions():
    positions, delta = prompt_mrope(6, [])
    assert delta == 0 and torch.equal(positions, torch.arange(6).expand(3, -1))


def test_after_the_prompt_every_row_is_position_plus_delta(hf_model):
    """HF's decode positions (``compute_3d_position_ids`` with a cache): arange + rope delta."""
    ids, placements = prompt(LAYOUTS["two_sizes"])
    prompt_positions, delta = prompt_mrope(len(ids), placements)
    n = len(ids)
    hf_model.rope_deltas = torch.tensor([[delta]])
    embeds = torch.zeros(1, 3, 1)
    cache = type("Cache", (), {"get_seq_length": lambda self: n + 4})()
    want = hf_model.compute_3d_position_ids(None, embeds, cache=cache)[:, 0]  # 3 decode steps
    torch.testing.assert_close(positions_for_range(prompt_positions, delta, n + 4, n + 7), want)
    # a chunk inside the prompt is a slice; one across its end (recomputation after
    # preemption) joins the slice and the decode positions
    assert torch.equal(positions_for_range(prompt_positions, delta, 3, 20),
                       prompt_positions[:, 3:20])
    across = positions_for_range(prompt_positions, delta, n - 2, n + 2)
    assert torch.equal(across[:, :2], prompt_positions[:, n - 2:])
    assert torch.equal(across[:, 2:], torch.tensor([n, n + 1]).expand(3, -1) + delta)


def test_delta_without_tensors_agrees_on_random_layouts():
    rng = random.Random(0)
    for _ in range(200):
        layout = [rng.choice([rng.randint(0, 5), (1, 2 * rng.randint(1, 5), 2 * rng.randint(1, 5))])
                  for _ in range(rng.randint(1, 6))]
        ids, placements = prompt(layout)
        positions = mrope_positions(len(ids), placements)
        expected = int(positions.max()) + 1 - len(ids) if ids else 0
        assert mrope_position_delta(len(ids), placements) == expected


def test_overlapping_images_are_refused():
    a = ImagePlacement(2, (1, 4, 4), 2, "a")
    b = ImagePlacement(4, (1, 2, 2), 2, "b")
    with pytest.raises(ValueError, match="overlaps the previous image"):
        mrope_positions(20, [a, b])
