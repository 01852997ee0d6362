"""Generate text from a megatron_lite checkpoint (a training run's, or one made by convert_checkpoint.py).

    python tools/generate.py --load ckpt/llama --prompt "The capital of France is" --max-new-tokens 20
    python tools/generate.py --load checkpoints/run1 --prompt-ids "1 15 27" --greedy --output-ids
    python tools/generate.py --load ckpt/llama --prompt "Once" --top-k 50 --top-p 0.9 --temperature 0.8 --seed 3
    python tools/generate.py --load checkpoints/sft --chat --system "You answer briefly." --prompt "What is 2 + 3?"

The model is rebuilt from the configuration saved in the checkpoint and runs in one process with a KV
cache. Text prompts use --tokenizer-type/--tokenizer-model when given here, else the checkpoint's
tokenizer: tokenizer files in the checkpoint directory (as convert_checkpoint.py carries them), else the
run's --tokenizer-model. Greedy unless --top-k, --top-p or --temperature ask for sampling. Generation stops at
--max-new-tokens, or when the tokenizer's end-of-document token comes (unless --ignore-eos).

--chat asks a fine-tuned model (pretrain_gpt.py --sft) for its reply: --prompt is a user turn (after a --system
turn, if given), rendered with the generation prompt by the chat template the run was fine-tuned with (its
--sft-tokenizer-prompt-format, else the Hugging Face tokenizer's chat_template); generation stops at the
tokenizer's eos (the end-of-turn token, such as ChatML's <|im_end|>) and the reply alone is printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.sft.prompt_formats import PROMPT_FORMATS  # noqa: E402
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
    parser.add_argument("--chat", action="store_true",
                        help="--prompt is a user turn: render it with the chat template, print the reply")
    parser.add_argument("--system", help="with --chat: a system turn before the user's")
    parser.add_argument("--sft-tokenizer-prompt-format", choices=list(PROMPT_FORMATS),
                        help="with --chat: the chat template (default: the run's --sft-tokenizer-prompt-format, "
                             "else the tokenizer's chat_template)")
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
    if args.chat and args.prompt is None:
        parser.error("--chat takes the user's turn as --prompt TEXT, not --prompt-ids")
    for flag in ("system", "sft_tokenizer_prompt_format"):
        if getattr(args, flag) is not None and not args.chat:
            parser.error(f"--{flag.replace('_', '-')} acts only with --chat")
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
    from megatron_lite.inference.checkpoint_tokenizer import find_chat_tokenizer, find_tokenizer
    from megatron_lite.inference.generation import load_model
    from megatron_lite.training.loop import resolve_device

    path = resolve_checkpoint(args.load, args.iteration)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    device = resolve_device(args.device)
    model, config = load_model(path, device=device)
    if args.chat:
        return chat_from(args, parser, model, config, find_chat_tokenizer(
            path, config, args.tokenizer_type, args.tokenizer_model, args.sft_tokenizer_prompt_format), sampling)
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
    ids = _generate(args, parser, model, config, prompt, None if tokenizer is None else tokenizer.eod, sampling)
    if tokenizer is not None:
        print(tokenizer.detokenize(prompt + ids))
    if args.output_ids or tokenizer is None:
        print(" ".join(map(str, ids)))
    return 0


def chat_from(args, parser: ToolParser, model, config, chat, sampling: SamplingParams) -> int:
    """The assistant's reply to --system and --prompt, up to the end-of-turn token, printed (and its ids)."""
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
    prompt = chat.prompt(messages + [{"role": "user", "content": args.prompt}])
    ids = _generate(args, parser, model, config, prompt, chat.eod, sampling)
    reply = ids[:ids.index(chat.eod)] if chat.eod in ids else ids
    print(chat.tokenizer.decode(reply, skip_special_tokens=True))
    if args.output_ids:
        print(" ".join(map(str, ids)))
    return 0


def _generate(args, parser: ToolParser, model, config, prompt: list[int], eos: int | None,
              sampling: SamplingParams) -> list[int]:
    """The ids generated after `prompt` (checked against the vocabulary), up to `eos` unless --ignore-eos."""
    import torch

    from megatron_lite.inference.generation import generate

    vocab = config.model.vocab_size
    if not prompt or not all(0 <= token < vocab for token in prompt):
        parser.exit(1, f"generate.py: error: the prompt must be 1 or more token ids in [0, {vocab})\n")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(args.seed)
    try:
        return generate(model, torch.tensor([prompt], device=device), args.max_new_tokens, sampling,
                        eos_id=None if args.ignore_eos else eos, generator=generator)[0].tolist()
    except ValueError as error:
        parser.exit(1, f"generate.py: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
