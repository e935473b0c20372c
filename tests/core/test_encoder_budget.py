"""The encoder budget (pure Python): which images a chunk encodes, and where a chunk stops."""

from __future__ import annotations

from qwenserve.core.encoder_budget import EncoderBudget, fit_chunk, images_to_encode
from qwenserve.multimodal.inputs import ImagePlacement, MultiModalInputs
from qwenserve.request import Request
from qwenserve.sampling_params import SamplingParams

# image 0: tokens [2, 8) (a 2 x 3 token grid); image 1: tokens [10, 14) (2 x 2)
IMAGES = [ImagePlacement(2, (1, 4, 6), 2, "a"), ImagePlacement(10, (1, 4, 4), 2, "b")]


def test_images_to_encode_follow_the_workers_hold_rule():
    assert images_to_encode(IMAGES, 0, 4, first_chunk=True) == [IMAGES[0]]
    # a later chunk inside image 0: the workers hold it since the chunk that reached it
    assert images_to_encode(IMAGES, 4, 12, first_chunk=False) == [IMAGES[1]]
    # the first chunk after admission (a prefix hit inside image 0) encodes it again
    assert images_to_encode(IMAGES, 4, 12, first_chunk=True) == IMAGES


def test_a_chunk_stops_before_an_image_the_budget_cannot_take():
    budget = EncoderBudget(left=8)
    assert fit_chunk(IMAGES, 0, 16, True, budget) == 10  # image 0 (6) fits, image 1 (4) not
    assert budget.left == 2
    # the next request's chunk that starts with an image gets nothing this step
    assert fit_chunk(IMAGES, 10, 4, True, budget) == 0


def test_an_image_larger_than_the_budget_runs_alone():
    budget = EncoderBudget(left=3)
    assert fit_chunk(IMAGES, 0, 16, True, budget) == 10  # image 0 alone, then stop
    assert budget.left < 0 and budget.used


def test_block_keys_differ_by_image_content_and_only_from_the_image_on():
    from qwenserve.core.cache.hashing import extend_block_hashes

    def keys(content: str) -> list[bytes]:
        image = ImagePlacement(5, (1, 4, 4), 2, content)
        req = Request("r", list(range(12)), SamplingParams(), 4,
                      mm_inputs=MultiModalInputs([image], 0))
        extend_block_hashes(req.block_hashes, req.all_token_ids, 4, 12, req.block_extra_key)
        return req.block_hashes

    a, b = keys("a"), keys("b")
    assert a[0] == b[0]  # tokens 0-3: before the image
    assert a[1] != b[1] and a[2] != b[2]  # tokens 4-7 hold image tokens; 8-11 chain on
