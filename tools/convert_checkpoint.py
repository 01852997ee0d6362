"""Convert checkpoints between Hugging Face (docs/huggingface.md lists the families), Megatron-LM and megatron_lite.

    python tools/convert_checkpoint.py --direction hf-to-mlite --load-dir hf/Llama-3.2-1B --save-dir ckpt/llama
    python tools/convert_checkpoint.py --direction mlite-to-hf --load-dir checkpoints/run1 --save-dir hf/run1
    python tools/convert_checkpoint.py --direction megatron-to-mlite --load-dir megatron/run --save-dir ckpt/run
    python tools/convert_checkpoint.py --direction mlite-to-megatron --load-dir checkpoints/run1 --save-dir mlm/run1

Both directions stream a layer at a time: each layer's tensors are read, converted, written and freed
before the next layer's are read, so host memory stays at about two of the largest layer or vocabulary
table, whatever the model's depth (benchmarks/convert_checkpoint.py measures it).

hf-to-mlite reads a local model directory (config.json, model.safetensors or a sharded index; nothing is
downloaded) and writes an ordinary checkpoint holding the model weights only, which any layout loads:
  torchrun --nproc-per-node 4 pretrain_gpt.py --config ckpt/llama/model.yaml --load ckpt/llama --finetune \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...
Beside it go model.yaml (the model flags) and the tokenizer files, which --tokenizer-model can point at.
--target-tensor/pipeline-model-parallel-size check that the model splits over that layout and record it;
the files are the same for every layout.

mlite-to-hf reads the newest (or --iteration) checkpoint of a run, drops the vocabulary padding and the
optimizer state, and writes config.json + safetensors (sharded above --max-shard-size, with
model.safetensors.index.json) that transformers.AutoModelForCausalLM.from_pretrained loads, with the
tokenizer files of the checkpoint (or of the run's --tokenizer-model) when there are any: tokenizer.json,
tokenizer_config.json and its chat template (chat_template.jinja where transformers saved one there; a run
fine-tuned with --sft-tokenizer-prompt-format gets that format's template), so the export chats as it was taught.

megatron-to-mlite reads a Megatron-LM checkpoint (torch_dist or torch format, any TP/PP) and writes an
ordinary checkpoint at its iteration and consumed samples, with config.yaml holding the Megatron flags it
was trained with under this framework's names; mlite-to-megatron writes Megatron-LM's torch_dist format
(megatron_lite/megatron_lm/convert.py says what each carries).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_lite.config.arguments import ConfigError, make_config  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.hf.sizes import parse_size  # noqa: E402
from megatron_lite.tool_args import ToolParser, non_negative_int, output_directory, positive_int  # noqa: E402


def _layer_progress(description: str):
    return lambda layers: tqdm(layers, desc=description, unit="layer", file=sys.stderr)


def _empty_target(path: str) -> None:
    from megatron_lite.hf.configs import ConversionError

    if os.path.exists(path) and not os.path.isdir(path):
        raise ConversionError(f"--save-dir {path} is a file; choose a new directory")
    if os.path.isdir(path) and os.listdir(path):
        raise ConversionError(f"--save-dir {path} is not empty; choose a new directory")
    os.makedirs(path, exist_ok=True)


def hf_to_mlite(args) -> str:
    from megatron_lite.hf import families, safetensors_files, weights  # torch: once the flags are read
    from megatron_lite.hf.checkpoint import model_flags, write_model_checkpoint
    from megatron_lite.hf.configs import ConversionError

    hf_config = families.language_model_config(safetensors_files.read_hf_config(args.load_dir))
    family = families.family_of_hf(hf_config)
    values = families.model_values_from_hf(hf_config)
    hf = safetensors_files.HFWeights(args.load_dir)
    vision = weights.vision_tower_names(hf.names)
    if vision:
        print(f"note: converting the language model only; the vision tower's {len(vision)} tensors are left out",
              file=sys.stderr)
    hf.names = weights.normalize_hf_names(family, [n for n in hf.names if weights.is_weight(n)])
    depths = values.get("mtp_num_layers") or (values.get("hybrid_layer_pattern") or "").count("/")
    if depths and not weights.holds_mtp_weights(hf.names, values.get("num_layers")):
        print(f"note: config.json names {depths} multi-token prediction module(s) (num_nextn_predict_layers) and "
              f"the weights hold none, as transformers saves them: converting without", file=sys.stderr)
        values = weights.without_mtp(values)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    try:  # validated as a run on mock data (there is no corpus yet); the saved configuration names no data
        config = make_config({**values, "mock_data": True, "tensor_model_parallel_size": tp,
                              "pipeline_model_parallel_size": pp}, tp * pp)
    except ConfigError as error:
        raise ConversionError(f"cannot build this model at TP{tp} x PP{pp}: {error}") from None
    config.data.mock_data = False
    if not config.model.untie_embeddings_and_output_weights:
        hf.names.pop("lm_head.weight", None)  # a tied copy some files carry; transformers ignores it too
    problems = weights.shape_problems(hf.shapes(), weights.hf_shapes(family, config.model), args.load_dir)
    if problems:
        raise ConversionError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    _empty_target(args.save_dir)
    copied = safetensors_files.copy_carried_files(args.load_dir, args.save_dir)
    if "tokenizer.json" in copied:  # what --tokenizer-model should name to tokenize a corpus as the model was
        config.data.tokenizer_type, config.data.tokenizer_model = "HuggingFaceTokenizer", os.path.abspath(args.save_dir)
    elif "tokenizer.model" in copied:
        config.data.tokenizer_type = "SentencePieceTokenizer"
        config.data.tokenizer_model = os.path.abspath(os.path.join(args.save_dir, "tokenizer.model"))
    shapes = weights.megatron_shapes(family, config.model)
    print(f" writing {len(shapes)} tensors to {args.save_dir}", file=sys.stderr, flush=True)
    parts = weights.stream_to_megatron(family, hf, config.model, _layer_progress(f"converting {family}"))
    path = write_model_checkpoint(args.save_dir, parts, config, {"hf": {"model_type": family, "config": hf_config,
                                                                        "source": os.path.abspath(args.load_dir)}})
    flags = model_flags(config.model)
    if config.data.tokenizer_model:
        flags.update(tokenizer_type=config.data.tokenizer_type, tokenizer_model=config.data.tokenizer_model)
    with open(os.path.join(args.save_dir, "model.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(flags, f, sort_keys=False)
    extras = f"; carried {', '.join(copied)}" if copied else ""
    print(f"converted {family} ({sum(math.prod(shape) for shape in shapes.values()):,} parameters) to {path}{extras}\n"
          f"train from it: pretrain_gpt.py --config {os.path.join(args.save_dir, 'model.yaml')} --load "
          f"{args.save_dir} --finetune --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} ...")
    return path


def _tokenizer_folders(path: str, config) -> list[str]:
    """Where a checkpoint's tokenizer files may be: its own directory (a converted model), then the folder
    of the run's --tokenizer-model."""
    folders = [os.path.dirname(os.path.abspath(path))]
    model = config.data.tokenizer_model
    if config.data.tokenizer_type == "HuggingFaceTokenizer" and model:
        folders.append(model if os.path.isdir(model) else os.path.dirname(model))
    return folders


def mlite_to_hf(args) -> str:
    from megatron_lite.hf import families, safetensors_files, weights  # torch: once the flags are read
    from megatron_lite.hf.checkpoint import ModelCheckpoint, config_from_metadata, resolve_checkpoint
    from megatron_lite.hf.configs import ConversionError

    path = resolve_checkpoint(args.load_dir, args.iteration)
    checkpoint = ModelCheckpoint(path)
    saved = checkpoint.saved
    config = config_from_metadata(saved)
    m = config.model
    family = families.family_of_model(m, saved.get("hf", {}).get("config", {}).get("model_type"))
    problems = weights.shape_problems(checkpoint.shapes(), weights.megatron_shapes(family, m), path)
    if problems:
        raise ConversionError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    hf = weights.to_hf(family, checkpoint.meta_tensors(), m)  # every HF name, shape and dtype, nothing read yet
    _empty_target(args.save_dir)
    with tqdm(total=len(safetensors_files.shard_plan(hf, args.max_shard_size)), desc="writing safetensors",
              unit="file", file=sys.stderr) as bar, \
            safetensors_files.ShardedWriter(args.save_dir, hf, args.max_shard_size, lambda _: bar.update()) as writer:
        for part in weights.stream_to_hf(family, checkpoint.read, m, _layer_progress(f"converting to {family}")):
            for name in list(part):
                writer.write(name, part.pop(name))  # dropped once written: nothing is left when the next is read
    files = writer.files
    copied = []
    for folder in _tokenizer_folders(path, config):
        copied += safetensors_files.copy_carried_files(folder, args.save_dir)
    tokenizer_model = config.data.tokenizer_model
    if (config.data.tokenizer_type == "SentencePieceTokenizer" and tokenizer_model
            and os.path.isfile(tokenizer_model) and "tokenizer.model" not in copied):
        shutil.copy2(tokenizer_model, os.path.join(args.save_dir, "tokenizer.model"))
        copied.append("tokenizer.model")
    prompt_format = getattr(config.data, "sft_tokenizer_prompt_format", None)
    if prompt_format and "tokenizer.json" in copied:  # fine-tuned with a named template: the export renders with it
        from megatron_lite.data.sft.prompt_formats import PROMPT_FORMATS

        safetensors_files.write_chat_template(args.save_dir, PROMPT_FORMATS[prompt_format])
        copied.append(f"the {prompt_format} chat template (--sft-tokenizer-prompt-format)")
    hf_config = families.hf_config_from_model(m, next(iter(hf.values())).dtype, saved.get("hf", {}).get("config"))
    if "hf" not in saved:  # trained here: the token ids come from the carried generation defaults, if any
        hf_config.update(safetensors_files.generation_token_ids(args.save_dir))
    safetensors_files.write_hf_config(args.save_dir, hf_config)
    extras = f"; carried {', '.join(copied)}" if copied else ""
    print(f"exported {path} as {family} to {args.save_dir} ({', '.join(files)}){extras}")
    return args.save_dir


def megatron_to_mlite(args) -> str:
    from megatron_lite.megatron_lm.convert import megatron_to_mlite as convert  # torch: once the flags are read
    from megatron_lite.megatron_lm.convert import resume_flags

    _empty_target(args.save_dir)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    path, config, summary = convert(args.load_dir, args.save_dir, tp, pp, _layer_progress("converting Megatron-LM"))
    config_file = os.path.join(args.save_dir, "config.yaml")
    with open(config_file, "w", encoding="utf-8") as f:
        yaml.safe_dump(resume_flags(config, summary["carried"]), f, sort_keys=False)
    ignored = summary["ignored"]
    print(f"note: {len(ignored)} Megatron-LM flags of the source have no meaning here and were not carried "
          f"(listed under 'megatron' in {os.path.join(path, 'metadata.json')}): {', '.join(ignored[:8])}"
          f"{', ...' if len(ignored) > 8 else ''}", file=sys.stderr)
    with_optimizer = summary["optimizer_state"] == "read"
    if not with_optimizer:
        print(f"note: optimizer state {summary['optimizer_state']}; resume with --no-load-optim", file=sys.stderr)
    print(f"converted {summary['source']} ({summary['format']}, iteration {summary['iteration']}, "
          f"{summary['consumed_samples']} samples consumed{', with Adam state' if with_optimizer else ''}) to {path}\n"
          f"continue the run: pretrain_gpt.py --config {config_file} --load {args.save_dir} "
          f"{'' if with_optimizer else '--no-load-optim '}--save {args.save_dir} --tensor-model-parallel-size {tp} "
          f"--pipeline-model-parallel-size {pp} ...")
    return path


def mlite_to_megatron(args) -> str:
    from megatron_lite.megatron_lm.convert import mlite_to_megatron as convert  # torch: once the flags are read

    _empty_target(args.save_dir)
    layout = {"tensor_model_parallel_size": args.target_tensor_parallel_size,
              "pipeline_model_parallel_size": args.target_pipeline_parallel_size, "expert_model_parallel_size": 1}
    path = convert(args.load_dir, args.save_dir, args.iteration, layout, _layer_progress("converting to Megatron-LM"))
    print(f"exported {args.load_dir} as a Megatron-LM torch_dist checkpoint: {path}\n"
          f"load it in Megatron-LM: --load {args.save_dir} --ckpt-format torch_dist --use-checkpoint-args "
          f"--no-load-optim --no-load-rng (any TP/PP; the vocabulary is padded for TP"
          f"{args.target_tensor_parallel_size})")
    return path


DIRECTIONS = {"hf-to-mlite": hf_to_mlite, "mlite-to-hf": mlite_to_hf, "megatron-to-mlite": megatron_to_mlite,
              "mlite-to-megatron": mlite_to_megatron}


def build_parser() -> ToolParser:
    parser = ToolParser(prog="convert_checkpoint.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", required=True, choices=list(DIRECTIONS))
    parser.add_argument("--load-dir", required=True, help="HF model directory, Megatron-LM checkpoint directory, or "
                                                          "megatron_lite checkpoint directory (a --save dir or one "
                                                          "iter_XXXXXXX in it)")
    parser.add_argument("--save-dir", required=True, type=output_directory, help="new (or empty) directory to write")
    parser.add_argument("--target-tensor-parallel-size", type=positive_int, default=1,
                        help="hf/megatron-to-mlite: check the model splits over this TP size (any layout can load "
                             "it); mlite-to-megatron: pad the vocabulary as Megatron-LM does at this TP size")
    parser.add_argument("--target-pipeline-parallel-size", type=positive_int, default=1,
                        help="hf/megatron-to-mlite: check the layers split over this many pipeline stages")
    parser.add_argument("--iteration", type=non_negative_int,
                        help="mlite-to-hf, mlite-to-megatron: which iteration (default: the newest)")
    parser.add_argument("--max-shard-size", type=shard_size, default="5GB",
                        help="mlite-to-hf: safetensors files up to this size, e.g. 5GB, 500MB (default 5GB)")
    return parser


def shard_size(text: str) -> int:
    """--max-shard-size in bytes: a size such as 5GB (save_pretrained's max_shard_size), above zero."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be above 0 bytes, got {text}")
    return size


@contextlib.contextmanager
def _removed_on_failure(path: str):
    """A conversion that fails (or is interrupted) takes with it what it wrote into --save-dir, so that the same
    command can run again; a directory that held something before is refused before any write."""
    created = not os.path.exists(path)
    fresh = created or (os.path.isdir(path) and not os.listdir(path))
    try:
        yield
    except BaseException:
        if fresh and os.path.isdir(path):
            for child in os.listdir(path):
                child = os.path.join(path, child)
                shutil.rmtree(child) if os.path.isdir(child) and not os.path.islink(child) else os.remove(child)
            if created:
                os.rmdir(path)
        raise


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        with _removed_on_failure(args.save_dir):
            DIRECTIONS[args.direction](args)
    except UserError as error:  # ConversionError, CheckpointError, a DataError of a carried tokenizer file
        sys.exit(f"convert_checkpoint.py: error: {error}")
    except OSError as error:  # a directory that cannot be written, a full disk
        sys.exit(f"convert_checkpoint.py: error: {error.filename or 'a file'}: {error.strerror or error}")
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
