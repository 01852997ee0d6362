"""A model for EleutherAI's lm-evaluation-harness: a megatron_lite checkpoint scored as it is, no conversion.

    python tools/run_lm_eval.py --model megatron_lite --model_args load=checkpoints/run1 --tasks hellaswag
    torchrun --nproc-per-node 8 tools/run_lm_eval.py --model megatron_lite \
        --model_args load=checkpoints/run1,tensor_model_parallel_size=2,pipeline_model_parallel_size=2 --tasks ...

Registered as `megatron_lite` (lm-eval's `register_model`). It answers the harness's three request kinds as its
`hf` model does, so that scores are comparable with a Hugging Face export's:

  loglikelihood          context and continuation tokenized together and split (TemplateLM), the last
                         max_length + 1 tokens kept, the log-probabilities of the continuation summed, and
                         whether it is the greedy continuation
  loglikelihood_rolling  the text in disjoint windows of max_length tokens, each conditioned on the previous
                         tokens (lm_eval.utils' rolling windows), the first on the prefix token
  generate_until         greedy decoding up to max_gen_toks or the end-of-text token, decoded
                         without special tokens and cut at the first stop sequence (lm-eval's own helpers)

Requests are scored longest first in batches of `batch_size` (right padding, which a causal model does not
see) by a ModelRunner (model_runner.py) at the layout of --model_args; under torchrun the data-parallel
replicas are lm-eval's ranks (its requests split by rank, results gathered to rank 0). The tokenizer is the
checkpoint's (a converted model's tokenizer files, else the run's --tokenizer-model), or `tokenizer_type` /
`tokenizer_model` in --model_args. max_length is the model's --max-position-embeddings, as the `hf` model
takes it from the configuration. With --apply_chat_template the requests are rendered by the chat template a
fine-tuned run (--sft) was taught with (its --sft-tokenizer-prompt-format, else the Hugging Face tokenizer's
chat_template), as the `hf` model renders them with its tokenizer's.
"""

from __future__ import annotations

import difflib
import os
import sys

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from megatron_lite.checkpoint.directory import read_metadata
from megatron_lite.errors import CheckpointError, ConfigError
from megatron_lite.evaluation.model_runner import ModelRunner
from megatron_lite.hf.checkpoint import config_from_metadata, resolve_checkpoint
from megatron_lite.inference.checkpoint_tokenizer import find_chat_tokenizer, find_tokenizer
from megatron_lite.parallel import mappings

DEFAULT_MAX_GEN_TOKS = 256
MODEL_ARGS = ("load", "iteration", "tokenizer_type", "tokenizer_model", "batch_size", "device",
              "tensor_model_parallel_size", "pipeline_model_parallel_size")
HARNESS_EXTRAS = {"max_batch_size"}  # what lm-eval passes every model beside --model_args


def check_model_args(load: str | None, extra: dict) -> None:
    """One line for --model_args the megatron_lite model does not take (a misspelling would be ignored, and the
    hf model's `pretrained` would leave `load` unset), naming the closest it takes."""
    unknown = sorted(set(extra) - HARNESS_EXTRAS)
    if unknown:
        if unknown[0] == "pretrained":
            hint = "; the megatron_lite model reads a checkpoint directory: load=DIR"
        else:
            close = difflib.get_close_matches(unknown[0], MODEL_ARGS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"--model_args: the megatron_lite model takes no '{unknown[0]}'{hint} (it takes "
                          f"{', '.join(MODEL_ARGS)})")
    if load is None:
        raise ConfigError("--model_args: give the checkpoint, load=DIR (a --save directory or one iteration of it)")


@register_model("megatron_lite")
class MegatronLiteLM(TemplateLM):
    """lm-eval's LM over a megatron_lite checkpoint (`load`: a --save directory or one iteration of it), at
    `tensor_model_parallel_size` x `pipeline_model_parallel_size` under torchrun (data parallel the rest)."""

    def __init__(self, load: str | None = None, iteration: int | None = None, tokenizer_type: str | None = None,
                 tokenizer_model: str | None = None, batch_size: int | str = 8, device: str = "cpu",
                 tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, **kwargs):
        super().__init__()
        check_model_args(load, kwargs)
        path = resolve_checkpoint(load, None if iteration is None else int(iteration))
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm_eval's default is cuda
            print(f"note: --device {device} is not available here; evaluating on the CPU", file=sys.stderr)
            device = "cpu"
        saved = read_metadata(path)
        run_config = config_from_metadata(saved)
        self.tokenizer = find_tokenizer(path, run_config, tokenizer_type, tokenizer_model)
        self._chat_source = (path, run_config, tokenizer_type, tokenizer_model)
        self._chat = None
        if self.tokenizer is None:
            raise CheckpointError(f"{path} has no tokenizer (no tokenizer files beside it, no --tokenizer-model of its "
                                  f"run); pass tokenizer_type=...,tokenizer_model=... in --model_args")
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.runner = ModelRunner.from_checkpoint(os.path.dirname(os.path.abspath(path)), path, saved["iteration"],
                                                  int(tensor_model_parallel_size), int(pipeline_model_parallel_size),
                                                  self.batch_size, device or "cpu")
        self.max_length = self.runner.max_length
        self.quiet = False

    @classmethod
    def around(cls, runner: ModelRunner, tokenizer) -> MegatronLiteLM:
        """The harness model over a model already built (a training run's, evaluated in the loop)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm.runner, lm.tokenizer = runner, tokenizer
        lm.batch_size, lm.max_length = runner.micro_batch_size, runner.max_length
        lm.quiet = True  # no progress bars in the training log
        return lm

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval's request cache keys a chat-templated request by."""
        return self._chat_tokenizer().tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat_tokenizer().template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The text of `chat_history` by the checkpoint's chat template, as lm-eval's hf model renders it."""
        chat = self._chat_tokenizer()
        return chat.tokenizer.apply_chat_template(chat_history, chat_template=chat.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def _chat_tokenizer(self):
        if getattr(self, "_chat", None) is None:
            source = getattr(self, "_chat_source", None)
            if source is None:
                raise ConfigError("--apply_chat_template needs the checkpoint's tokenizer: evaluate it with "
                                  "tools/run_lm_eval.py --model megatron_lite --model_args load=DIR")
            self._chat = find_chat_tokenizer(*source)
        return self._chat

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos", None)
        return self.eot_token_id if bos is None else bos

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def rank(self) -> int:
        return self.runner.pstate.dp_rank

    @property
    def world_size(self) -> int:
        return self.runner.pstate.dp_size

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return mappings.all_gather_dim0(tensor.reshape(1) if tensor.dim() == 0 else tensor,
                                        self.runner.pstate.group("dp"))

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        group = self.runner.pstate.group("dp")
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(group, dst), group=group)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.runner.pstate.group("dp"))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.detokenize(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        batches = range(0, len(order), self.batch_size)
        for start in tqdm(batches, disable=disable_tqdm or self.quiet, desc="loglikelihood"):
            chunk = order[start:start + self.batch_size]
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            for index, result in zip(chunk, self.runner.score(inputs, [requests[i][2] for i in chunk])):
                results[index] = result
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        scores = []
        for (text,) in tqdm([request.args for request in requests], disable=disable_tqdm or self.quiet, desc="rolling"):
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scored = self._loglikelihood_tokens([(None, context, continuation) for context, continuation in windows],
                                                disable_tqdm=True)
            scores.append(sum(logprob for logprob, _ in scored))
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        outputs = []
        for context, gen_kwargs in tqdm([request.args for request in requests], disable=disable_tqdm or self.quiet,
                                        desc="generate_until"):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                raise ValueError("the megatron_lite model generates greedily; this task asks for sampling")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            max_gen_toks = kwargs["max_gen_toks"]
            prompt = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
            ids = self.runner.greedy(prompt, max_gen_toks, self.eot_token_id)
            outputs.append(postprocess_generated_text(self.tok_decode(ids), until, None))
        return outputs
