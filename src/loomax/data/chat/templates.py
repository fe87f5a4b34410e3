"""Chat templates shipped with Loomax, by name (``data.chat.template: chatml``)."""

LOOMAX = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}"
)
"""For Loomax's own byte-level BPE tokenizers (whose only special token is EOS, also used as
BOS): a role header line, the content, EOS after each assistant turn, so that generation stops
there."""

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen and many open models write it."""

SHIPPED = {"loomax": LOOMAX, "chatml": CHATML}
"""The shipped templates by name."""
