"""Offline tokenizers in the tool formats of three template families (written for these
tests after each family's documented format; no download):

    qwen3     ChatML; tools in the system turn inside <tools>; calls <tool_call> JSON;
              results <tool_response> in a user turn; reasoning <think>…</think>
    llama31   Llama-3.1 JSON tool calling: tools listed in the first user turn; a call is
              the reply {"name", "parameters"}; results in an `ipython` turn
    mistral   [AVAILABLE_TOOLS] before the last [INST]; calls [TOOL_CALLS][{…}]; results
              [TOOL_RESULTS]…[/TOOL_RESULTS]; [TOOL_CALLS] is a special token
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tiny import CORPUS

NL = "{{ '\\n' }}"
QWEN3 = (
    "{% if tools %}<|im_start|>system" + NL + "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    + NL + NL + "{% endif %}# Tools" + NL + NL + "<tools>{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}"
    + NL + "</tools>" + NL + NL + "Call a function as <tool_call>" + NL
    + "{\"name\": <function-name>, \"arguments\": <args-json-object>}" + NL + "</tool_call><|im_end|>" + NL
    + "{% elif messages[0].role == 'system' %}<|im_start|>system" + NL + "{{ messages[0].content }}<|im_end|>" + NL
    + "{% endif %}{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user" + NL + "{{ m.content }}"
    "<|im_end|>" + NL + "{% elif m.role == 'assistant' %}<|im_start|>assistant" + NL
    + "{% if m.reasoning_content %}<think>" + NL + "{{ m.reasoning_content }}" + NL + "</think>" + NL + NL
    + "{% endif %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}"
    + NL + "{% endif %}<tool_call>" + NL + "{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}" + NL + "</tool_call>{% endfor %}<|im_end|>" + NL
    + "{% elif m.role == 'tool' %}<|im_start|>user" + NL + "<tool_response>" + NL + "{{ m.content }}" + NL
    + "</tool_response><|im_end|>" + NL + "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>"
    "assistant" + NL + "{% if enable_thinking %}<think>" + NL + "{% endif %}{% endif %}"
)
LLAMA31 = (
    "{{ bos_token }}{% for m in messages %}"
    "{%- if m.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Respond with a JSON function call {\"name\": function name, \"parameters\": arguments}.\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{ {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}"
    "<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
FAMILIES = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, QWEN3),
    "llama31": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
                "<|eot_id|>", "<|begin_of_text|>", LLAMA31),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>", "<s>", MISTRAL),
}


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    specials, eos, bos, template = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=specials[0],
                                   additional_special_tokens=[s for s in specials if s not in (eos, bos, specials[0])])
    fast.chat_template = template
    return fast
