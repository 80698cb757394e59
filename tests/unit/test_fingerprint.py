import pytest

from memrad.reuse.fingerprint import (EDGE, chain, derive_openers, derive_reply_header, edge_hash, segments,
                                     shared_segments)
from tiny import STYLES, build_tokenizer

CONVERSATION = [
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": "<think>the user wants ls</think>README.md and setup.py are there."},
    {"role": "user", "content": "open README.md"},
]


@pytest.mark.parametrize("style", sorted(STYLES))
def test_message_openers_are_derived_from_the_chat_template(style):
    tokenizer = build_tokenizer(style)
    openers = derive_openers(tokenizer)
    assert set(tokenizer.convert_ids_to_tokens(sorted(openers))) == STYLES[style][4]


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_reply_header_is_the_templates_generation_prompt(style):
    tokenizer = build_tokenizer(style)
    found = derive_reply_header(tokenizer)
    probe = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True)["input_ids"]
    without = tokenizer.apply_chat_template(probe, tokenize=True)["input_ids"]
    if style == "mistral":  # [INST] templates write no header before a reply: grid cuts only
        assert found == () and with_prompt == without
        return
    assert found == tuple(with_prompt[len(without):]) and tokenizer.added_tokens_decoder[found[0]].special
    # every rendered reply and the generation prompt start with it
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    starts = [i for i in range(len(ids)) if tuple(ids[i:i + len(found)]) == found]
    assert len(starts) == 2 and starts[-1] + len(found) == len(ids)


@pytest.mark.parametrize("style", ["chatml", "llama3", "gemma"])
def test_one_segment_per_rendered_message(style):
    tokenizer = build_tokenizer(style)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    segs = segments(ids, derive_openers(tokenizer))
    assert len(segs) == len(CONVERSATION) + 1  # + the generation prompt
    assert segs[0].start == 0 and segs[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    decoded = [tokenizer.decode(ids[s.start:s.end]) for s in segs]
    assert "list the files" in decoded[0] and "README.md and setup.py" in decoded[1]


def test_mistral_splits_instruction_and_reply():
    tokenizer = build_tokenizer("mistral")
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = [tokenizer.decode(ids[s.start:s.end]) for s in segments(ids, derive_openers(tokenizer))]
    assert len(decoded) == 4
    assert decoded[1].startswith("[/INST]") and "README.md and setup.py" in decoded[1]


def render_ids(tokenizer, conversation):
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_deleting_inside_a_message_keeps_its_hash_when_the_edges_stay():
    tokenizer = build_tokenizer("chatml")
    openers = derive_openers(tokenizer)
    padded = [dict(m) for m in CONVERSATION]
    padded[1]["content"] = "Sure thing, here it goes. <think>the user wants ls, so I list</think> README.md and setup.py are there."
    compacted = [dict(m) for m in padded]
    compacted[1]["content"] = "Sure thing, here it goes.  README.md and setup.py are there."
    a, b = chain(render_ids(tokenizer, padded), openers), chain(render_ids(tokenizer, compacted), openers)
    assert a[1] == b[1] and a == b
    assert shared_segments(a, b) == 4


def test_changing_a_message_edge_changes_its_hash_and_cuts_the_shared_run():
    tokenizer = build_tokenizer("chatml")
    openers = derive_openers(tokenizer)
    edited = [dict(m) for m in CONVERSATION]
    edited[1]["content"] = "README.md only."
    a, b = chain(render_ids(tokenizer, CONVERSATION), openers), chain(render_ids(tokenizer, edited), openers)
    assert a[0] == b[0] and a[1] != b[1]
    assert shared_segments(a, b) == 1


def test_the_hash_reads_only_the_edges():
    left, right = list(range(EDGE)), list(range(100, 100 + EDGE))
    assert edge_hash(left + [1, 2, 3] + right) == edge_hash(left + [9] * 50 + right)
    assert edge_hash(left + [1] + right) != edge_hash(left + [1] + right[:-1] + [7])
    assert edge_hash([1, 2]) != edge_hash([2, 1])


def test_a_prompt_without_control_tokens_has_no_fingerprint():
    tokenizer = build_tokenizer("chatml")
    ids = tokenizer("def add(a, b): return a + b", add_special_tokens=False)["input_ids"]
    assert chain(ids, derive_openers(tokenizer)) == ()


def test_a_template_with_no_control_tokens_yields_no_openers():
    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert derive_openers(tokenizer) == frozenset()
