"""A tiny Hugging Face tokenizer with a ChatML chat template, and conversations, written in a test's tmp_path.

The template comes in two forms that render the same text: with `{% generation %}` tags around the assistant's
text and end-of-turn token (transformers' assistant masks), and without them, as most published templates are.
"""

from __future__ import annotations

import json
import os

_TURN = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
_TAGGED_TURN = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
                "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
                "{% else %}" + _TURN + "{% endif %}")
_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
CHATML = "{% for message in messages %}" + _TURN + "{% endfor %}" + _PROMPT
CHATML_TAGGED = "{% for message in messages %}" + _TAGGED_TURN + "{% endfor %}" + _PROMPT
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And what is the weather there?"},
     {"role": "tool", "content": "weather(Paris): rain, 12 degrees"},
     {"role": "assistant", "content": "It is raining, twelve degrees."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "A line about the sea?"},
     {"role": "assistant", "content": "The sea keeps every colour of the sky."}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."},
     {"role": "user", "content": "Now backwards."}, {"role": "assistant", "content": "Three, two, one."}],
]
_TRAINING_TEXT = " ".join(m["content"] for c in CONVERSATIONS for m in c) + " system user assistant tool"


def write_tokenizer(folder, tagged: bool = False, template: str | None = None, vocab_size: int = 300) -> str:
    """A byte-level BPE tokenizer.json with the ChatML tokens, and a tokenizer_config.json naming its chat template
    (`template`, else ChatML with or without generation tags); the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_TRAINING_TEXT] * 20, trainer)
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": template or (CHATML_TAGGED if tagged else CHATML)}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
        json.dump(config, file)
    return folder


def write_messages(path, conversations=CONVERSATIONS, repeat: int = 1) -> str:
    """One {"messages": [...]} line per conversation, the list `repeat` times; the path."""
    with open(path, "w") as file:
        for _ in range(repeat):
            for conversation in conversations:
                file.write(json.dumps({"messages": conversation}) + "\n")
    return str(path)
