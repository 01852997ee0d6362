"""Named prompt formats for --sft-tokenizer-prompt-format: chat templates that a tokenizer without one of its own
(or with one the user would rather not train on) renders conversations with.

Each is a Jinja chat template, rendered by transformers' `apply_chat_template` like a tokenizer's own, and each
honours `add_generation_prompt` (the text that opens an assistant turn), which the assistant masks are found from
(chat_tokenizer.py). The Nemotron formats write the same text as Megatron-LM's prompt formats of those names.
"""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The user turn ends with the assistant's header, so a turn is answered whether or not a generation prompt is asked.
NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + message['content'].strip() + '\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\\n' + message['content'].strip() + '\\n<SPECIAL_11>Assistant\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\\n' }}"
    "{% else %}{{ raise_exception('the nemotron-h-aligned format has no ' + message['role'] + ' turns') }}"
    "{% endif %}{% endfor %}"
)

NEMOTRON_NANO_V2 = (
    "{% for message in messages %}"
    "{% set content = message['content'].replace('/think', '').replace('/no_think', '').strip() %}"
    "{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + content + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\\n' + content + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<SPECIAL_11>Assistant\\n' + content + '\\n<SPECIAL_12>\\n' }}"
    "{% else %}{{ raise_exception('the nemotron-nano-v2 format has no ' + message['role'] + ' turns') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<SPECIAL_11>Assistant\\n' }}{% endif %}"
)

PROMPT_FORMATS = {
    "chatml": CHATML,
    "nemotron-h-aligned": NEMOTRON_H_ALIGNED,
    "nemotron-nano-v2": NEMOTRON_NANO_V2,
}
# The special tokens each format writes, which its tokenizer must hold as single tokens.
FORMAT_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "nemotron-h-aligned": ("<SPECIAL_10>", "<SPECIAL_11>"),
    "nemotron-nano-v2": ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
}
