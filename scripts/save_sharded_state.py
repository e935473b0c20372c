"""Write a model as a ``--load-format sharded_state`` checkpoint (vLLM's
examples/offline_inference/save_sharded_state.py, for qwenserve).

    python scripts/save_sharded_state.py --model Qwen/Qwen3-30B-A3B --tensor-parallel-size 4 \\
        [--enable-expert-parallel] [--dtype bfloat16] --output /data/qwen3-30b-tp4

Then: ``qwenserve serve /data/qwen3-30b-tp4 --load-format sharded_state -tp 4``.
"""

from __future__ import annotations

import argparse

from qwenserve.tools.sharded_state import write_sharded_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-file-size", type=int, default=5 << 30,
                        help="bytes per file (default 5 GiB)")
    args = parser.parse_args()
    write_sharded_state(args.model, args.output, args.tensor_parallel_size,
                        args.enable_expert_parallel, args.dtype, args.max_file_size)


if __name__ == "__main__":
    main()
