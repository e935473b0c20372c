import pytest

from qwenserve.core.cache.plan import CacheTooSmallError, largest_max_model_len, plan_cache
from qwenserve.core.cache.spec import PagedKVSpec, RecurrentStateSpec

GIB = 1 << 30


def qwen25_32b_kv():
    # 64 layers, 8 KV heads (GQA), head_dim 128, bf16: 256 KiB per token (research §5.2)
    return PagedKVSpec(tuple(range(64)), num_kv_heads=8, head_dim=128, dtype_bytes=2)


def test_kv_bytes_per_token_uses_kv_heads():
    assert qwen25_32b_kv().bytes_per_token == 262_144


def test_plan_splits_budget_into_blocks():
    plan = plan_cache([qwen25_32b_kv()], 8 * GIB, block_size=16, max_num_seqs=8,
                      max_model_len=32768)
    assert plan.num_blocks == 8 * GIB // (16 * 262_144) == 2048
    assert plan.token_capacity == 32768
    assert plan.max_concurrency(32768) == pytest.approx(1.0)
    assert "262144 bytes/token" in plan.summary(32768)


def test_plan_fails_with_numbers_and_flags_when_one_sequence_does_not_fit():
    with pytest.raises(CacheTooSmallError) as e:
        plan_cache([qwen25_32b_kv()], 4 * GIB, 16, 8, 32768)
    msg = str(e.value)
    assert "16,384 tokens" in msg and "max_model_len=32,768" in msg
    assert "--kv-cache-memory-bytes" in msg and "--max-model-len" in msg


def test_hybrid_plan_reserves_state_slots_first():
    # Qwen3.5-27B: 16 full-attention layers (64 KiB/token) + 48 GDN layers (~147 MiB/seq)
    kv = PagedKVSpec(tuple(range(3, 64, 4)), num_kv_heads=4, head_dim=256, dtype_bytes=2)
    state = RecurrentStateSpec(tuple(i for i in range(64) if i % 4 != 3),
                               conv_bytes=3 * 10240 * 2, ssm_bytes=48 * 128 * 128 * 4)
    assert kv.bytes_per_token == 65536 and state.bytes_per_seq == 153_944_064
    plan = plan_cache([kv, state], 20 * GIB, 16, max_num_seqs=16, max_model_len=32768)
    assert plan.num_state_slots == 17
    assert plan.num_blocks == (20 * GIB - 17 * 153_944_064) // (16 * 65536)
    assert plan.max_concurrency(32768) <= 17


def test_largest_max_model_len():
    assert largest_max_model_len([qwen25_32b_kv()], 8 * GIB, 16, 8) == 32768
