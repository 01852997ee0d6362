"""A model for EleutherAI's lm-evaluation-harness: a megatron_lite checkpoint scored as it is, no conversion.

    python tools/run_lm_eval.py --model megatron_lite --model_args load=checkpoints/run1 --tasks hellaswag

Registered as `megatron_lite` (lm-eval's `register_model`). It answers the harness's three request kinds as its
`hf` model does, so that scores are comparable with a Hugging Face export's:

  loglikelihood          context and continuation tokenized together and split (TemplateLM), the last
                         max_length + 1 tokens kept, the log-probabilities of the continuation summed, and
                         whether it is the greedy continuation
  loglikelihood_rolling  the text in disjoint windows of max_length tokens, each conditioned on the previous
                         tokens (lm_eval.utils' rolling windows), the first on the prefix token
  generate_until         greedy decoding (KV cache) up to max_gen_toks or the end-of-text token, decoded
                         without special tokens and cut at the first stop sequence (lm-eval's own helpers)

Requests are scored longest first in batches of `batch_size` (right padding, which a causal model does not
see). The tokenizer is the checkpoint's (a converted model's tokenizer files, else the run's
--tokenizer-model), or `tokenizer_type` / `tokenizer_model` in --model_args. max_length is the model's
--max-position-embeddings, as the `hf` model takes it from the configuration.
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from megatron_lite.errors import CheckpointError
from megatron_lite.hf.checkpoint import resolve_checkpoint
from megatron_lite.inference.checkpoint_tokenizer import find_tokenizer
from megatron_lite.inference.generation import generate, load_model
from megatron_lite.inference.sampling_params import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256


@register_model("megatron_lite")
class MegatronLiteLM(TemplateLM):
    """lm-eval's LM over a megatron_lite checkpoint (`load`: a --save directory or one iteration of it)."""

    def __init__(self, load: str, iteration: int | None = None, tokenizer_type: str | None = None,
                 tokenizer_model: str | None = None, batch_size: int | str = 8, device: str = "cpu", **kwargs):
        super().__init__()
        path = resolve_checkpoint(load, None if iteration is None else int(iteration))
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm_eval's default is cuda
            print(f"note: --device {device} is not available here; evaluating on the CPU", file=sys.stderr)
            device = "cpu"
        self._device = torch.device(device or "cpu")
        self.model, self.config = load_model(path, device=self._device)
        self.tokenizer = find_tokenizer(path, self.config, tokenizer_type, tokenizer_model)
        if self.tokenizer is None:
            raise CheckpointError(f"{path} has no tokenizer (no tokenizer files beside it, no --tokenizer-model of its "
                                  f"run); pass tokenizer_type=...,tokenizer_model=... in --model_args")
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.vocab_size = self.config.model.vocab_size
        self.max_length = self.config.model.max_position_embeddings

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos", None)
        return self.eot_token_id if bos is None else bos

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.detokenize(tokens, skip_special_tokens=skip_special_tokens)

    @torch.no_grad()
    def _log_probs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """log_softmax of the model's logits [len(input), vocab] for each token list, padded into one batch."""
        longest = max(len(ids) for ids in inputs)
        batch = torch.zeros(len(inputs), longest, dtype=torch.long, device=self._device)
        for row, ids in enumerate(inputs):
            batch[row, :len(ids)] = torch.tensor(ids, device=self._device)
        logits = self.model(batch, torch.arange(longest, device=self._device))[..., :self.vocab_size]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return [log_probs[row, :len(ids)] for row, ids in enumerate(inputs)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="loglikelihood"):
            chunk = order[start:start + self.batch_size]
            inputs, continuations = [], []
            for index in chunk:
                _, context, continuation = requests[index]
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
                continuations.append(continuation)
            for index, log_probs, continuation in zip(chunk, self._log_probs(inputs), continuations):
                scored = log_probs[-len(continuation):]
                target = torch.tensor(continuation, device=self._device)
                greedy = bool((scored.argmax(dim=-1) == target).all())
                results[index] = (float(scored.gather(1, target[:, None]).sum()), greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        scores = []
        for (text,) in tqdm([request.args for request in requests], disable=disable_tqdm, desc="rolling"):
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
        for context, gen_kwargs in tqdm([request.args for request in requests], disable=disable_tqdm,
                                        desc="generate_until"):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                raise ValueError("the megatron_lite model generates greedily; this task asks for sampling")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            max_gen_toks = kwargs["max_gen_toks"]
            prompt = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
            ids = generate(self.model, torch.tensor([prompt], device=self._device), max_gen_toks, SamplingParams(),
                           eos_id=self.eot_token_id)[0].tolist()
            outputs.append(postprocess_generated_text(self.tok_decode(ids), until, None))
        return outputs
