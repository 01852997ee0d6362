"""Generate text from a megatron_lite checkpoint (a training run's, or one made by convert_checkpoint.py).

    python tools/generate.py --load ckpt/llama --prompt "The capital of France is" --max-new-tokens 20
    python tools/generate.py --load checkpoints/run1 --prompt-ids "1 15 27" --greedy --output-ids
    python tools/generate.py --load ckpt/llama --prompt "Once" --top-k 50 --top-p 0.9 --temperature 0.8 --seed 3

The model is rebuilt from the configuration saved in the checkpoint and runs in one process with a KV
cache. Text prompts use --tokenizer-type/--tokenizer-model when given here, else the checkpoint's
tokenizer: tokenizer files in the checkpoint directory (as convert_checkpoint.py carries them), else the
run's --tokenizer-model. Greedy unless --top-k, --top-p or --temperature ask for sampling. Generation stops at
--max-new-tokens, or when the tokenizer's end-of-document token comes (unless --ignore-eos).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.inference.sampling_params import SamplingParams  # noqa: E402
from megatron_lite.tool_args import ToolParser, non_negative_int, positive_int, seed  # noqa: E402


def build_parser() -> ToolParser:
    parser = ToolParser(prog="generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (a --save dir or one iter_XXXXXXX)")
    parser.add_argument("--iteration", type=non_negative_int,
                        help="which iteration (default: the newest complete one)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, encoded with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 15 27"')
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--greedy", action="store_true", help="take the most likely token (the default)")
    parser.add_argument("--top-k", type=non_negative_int, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="sample among the most likely tokens holding probability p")
    parser.add_argument("--temperature", type=float, help="divide the logits by T before sampling")
    parser.add_argument("--seed", type=seed, default=1234, help="sampling seed")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--output-ids", action="store_true", help="print the generated token ids")
    parser.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES), help="override the checkpoint's")
    parser.add_argument("--tokenizer-model", help="with --tokenizer-type")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    return parser


def sampling_from_args(args, parser) -> SamplingParams:
    sampling_flags = [args.top_k, args.top_p, args.temperature]
    if args.greedy and any(flag is not None for flag in sampling_flags):
        parser.error("--greedy cannot be combined with --top-k / --top-p / --temperature")
    sampling = SamplingParams(greedy=all(flag is None for flag in sampling_flags), top_k=args.top_k or 0,
                              top_p=1.0 if args.top_p is None else args.top_p,
                              temperature=1.0 if args.temperature is None else args.temperature)
    problems = sampling.problems()
    if problems:
        parser.error("; ".join(problems))
    return sampling


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sampling = sampling_from_args(args, parser)
    try:
        return generate_from(args, parser, sampling)
    except UserError as error:  # a missing or damaged checkpoint, a damaged tokenizer file
        parser.exit(1, f"generate.py: error: {error}\n")


def generate_from(args, parser: ToolParser, sampling: SamplingParams) -> int:
    """Load the checkpoint (and its tokenizer), generate and print: what main does once the flags are checked
    (torch and the model are imported only then, so a mistake in a flag is answered at once)."""
    import torch

    from megatron_lite.hf.checkpoint import resolve_checkpoint
    from megatron_lite.inference.checkpoint_tokenizer import find_tokenizer
    from megatron_lite.inference.generation import generate, load_model
    from megatron_lite.training.loop import resolve_device

    path = resolve_checkpoint(args.load, args.iteration)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    device = resolve_device(args.device)
    model, config = load_model(path, device=device)
    tokenizer = find_tokenizer(path, config, args.tokenizer_type, args.tokenizer_model)
    if args.prompt is not None:
        if tokenizer is None:
            parser.exit(1, "generate.py: error: this checkpoint has no tokenizer; pass --prompt-ids, or "
                           "--tokenizer-type and --tokenizer-model\n")
        prompt = tokenizer.tokenize(args.prompt)
    else:
        try:
            prompt = [int(token) for token in args.prompt_ids.split()]
        except ValueError:
            parser.exit(1, f"generate.py: error: --prompt-ids takes integers, got {args.prompt_ids!r}\n")
    vocab = config.model.vocab_size
    if not prompt or not all(0 <= token < vocab for token in prompt):
        parser.exit(1, f"generate.py: error: the prompt must be 1 or more token ids in [0, {vocab})\n")
    eos = None if args.ignore_eos or tokenizer is None else tokenizer.eod
    generator = torch.Generator(device).manual_seed(args.seed)
    try:
        ids = generate(model, torch.tensor([prompt], device=device), args.max_new_tokens, sampling, eos_id=eos,
                       generator=generator)[0].tolist()
    except ValueError as error:
        parser.exit(1, f"generate.py: error: {error}\n")
    if tokenizer is not None:
        print(tokenizer.detokenize(prompt + ids))
    if args.output_ids or tokenizer is None:
        print(" ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
