"""The CUDA path on a real NVIDIA GPU: greedy parity with HF `transformers` on the same GPU and
random weights (dense, MoE, hybrid; fp32 and bf16; batched, chunked prefill, prefix caching),
then offline throughput of the benchmark shapes in bf16 on the GPU.

CI has no GPU, so this runs only where one is lent (`python benchmarks/cuda_check.py`); it prints
one JSON line per check and the figures go to docs/benchmarks.md with the GPU named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]

from benchmarks.common import QWEN25_05B, QWEN35_08B  # noqa: E402
from tests.helpers.tiny_models import build_tokenizer, make_tiny_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation (no cache), on the model's device."""
    out = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([out], device="cuda")).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parity(arch: str, dtype: str, workdir: str) -> None:
    import transformers as tf

    from qwenserve import LLM, SamplingParams

    path = make_tiny_model(arch, os.path.join(workdir, arch))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 37, 80, 130)]
    prompts.append(prompts[2][:64] + [7, 8, 9])  # shares 64 tokens with a prompt: a prefix hit
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to("cuda").eval()
    ref = [hf_greedy(hf, p, 16) for p in prompts]
    del hf
    llm = LLM(path, dtype=dtype, max_model_len=512, max_num_batched_tokens=64,
              enable_prefix_caching=True, gpu_memory_utilization=0.2, seed=0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)
    second = llm.generate([{"prompt_token_ids": prompts[4]}], params)  # after the cache is warm
    ours = [list(o.outputs[0].token_ids) for o in first + second]
    emit(check="parity", arch=arch, dtype=dtype,
         tokens_agreeing=[agreement(a, b) for a, b in zip(ours, ref)], of=16,
         exact=all(a == b for a, b in zip(ours, ref)))
    del llm
    torch.cuda.empty_cache()


def random_shape(name: str, arch: str, shape: dict, workdir: str) -> str:
    """A random-weight model of a benchmark shape (with the tiny tokenizer: prompts are ids)."""
    import transformers as tf

    path = os.path.join(workdir, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config_cls = {"qwen2": tf.Qwen2Config, "qwen3_5": tf.Qwen3_5TextConfig}[arch]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config_cls(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return path


def throughput(name: str, arch: str, shape: dict, workdir: str, n: int, prompt_len: int,
               out_len: int) -> None:
    from qwenserve import LLM, SamplingParams

    path = random_shape(name, arch, shape, workdir)
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", max_model_len=prompt_len + out_len + 16,
              gpu_memory_utilization=0.5, seed=0)
    startup = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (prompt_len,), generator=g).tolist()}
               for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    emit(check="throughput", shape=name, dtype="bfloat16", requests=n, prompt_len=prompt_len,
         out_len=out_len, out_tok_s=round(generated / elapsed, 1), seconds=round(elapsed, 2),
         startup_s=round(startup, 1), gpu=torch.cuda.get_device_name())
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/qwenserve-cuda-check")
    p.add_argument("--archs", default="qwen3,qwen3_moe,qwen3_5")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs on an NVIDIA GPU")
    from qwenserve.platforms import resolve_platform

    emit(check="platform", name=type(resolve_platform()).__name__,
         torch=torch.__version__, gpu=torch.cuda.get_device_name())
    for arch in args.archs.split(","):
        for dtype in ("float32", "bfloat16"):
            try:
                parity(arch, dtype, args.workdir)
            except Exception as e:  # one failing architecture must not hide the others
                emit(check="parity", arch=arch, dtype=dtype, error=repr(e)[:400])
    if args.skip_throughput:
        return
    for name, arch, shape in (("qwen2.5-0.5b", "qwen2", QWEN25_05B),
                              ("qwen3.5-0.8b", "qwen3_5", QWEN35_08B)):
        try:
            throughput(name, arch, shape, args.workdir, args.requests, 256, 128)
        except Exception as e:
            emit(check="throughput", shape=name, error=repr(e)[:400])


if __name__ == "__main__":
    main()
