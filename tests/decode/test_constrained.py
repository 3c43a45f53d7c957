import json
import re

import pytest
import torch
from json_schemas import SCHEMAS

import decodekit as dk
from decodekit.decode.constrained import Choices, Grammar, GrammarMask, JsonSchema, Regex

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def lm(tiny_llama_dir, tiny_lm):
    """The tiny random Llama of conftest with room for 512 positions (same tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decodekit.models.hf import HFModelLM

    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    return HFModelLM(LlamaForCausalLM(config), tiny_lm.tokenizer, "tiny-512")


GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=120)
SAMPLE = dk.SamplingParams(temperature=1.0, max_new_tokens=120, n=2)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_against_its_schema(lm, index):
    schema = SCHEMAS[index]
    constraint = JsonSchema(schema)
    outputs = dk.generate(lm, "ROMEO:", GREEDY, constraint=constraint)
    outputs += dk.generate(lm, "ROMEO:", SAMPLE.replace(seed=index), constraint=constraint)
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("pattern", [r"[a-z]{3,5}@[a-z]{2,4}\.com", r"(ab|cd)+x", r"-?[0-9]{1,3}\.[0-9]{2}",
                                     r"ROMEO|JULIET", r"[A-Z][a-z]{0,6}( [a-z]{1,5}){1,3}\."])
def test_regex_outputs_match(lm, pattern):
    constraint = Regex(pattern)
    outputs = dk.generate(lm, "JULIET:", GREEDY.replace(max_new_tokens=60), constraint=constraint)
    outputs += dk.generate(lm, "JULIET:", SAMPLE.replace(max_new_tokens=60, seed=3, n=3),
                           constraint=constraint)
    outputs += dk.beam_search(lm, "JULIET:", dk.SamplingParams(max_new_tokens=60, n=2), num_beams=2,
                              constraint=constraint)
    for c in outputs:
        assert c.finish_reason == "stop" or c.stop_reason in lm.eos_token_ids
        assert re.fullmatch(pattern, c.text), c.text


def reduce_sums(text: str) -> str:
    """Rewrite (d+d) -> 0 until nothing changes: a sentence of the sum grammar reduces to one digit."""
    while True:
        reduced = re.sub(r"\([0-9]\+[0-9]\)", "0", text)
        if reduced == text:
            return text
        text = reduced


SUMS = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]/\n'
SENTENCE = 'start: name " " verb "."\nname: "Romeo" | "Juliet"\nverb: "sighs" | "loves " name\n'


def test_grammar_outputs_parse(lm):
    sums = dk.generate(lm, "ROMEO:", GREEDY.replace(max_new_tokens=80), constraint=Grammar(SUMS))
    sums += dk.generate(lm, "ROMEO:", SAMPLE.replace(max_new_tokens=80, seed=1, n=4),
                        constraint=Grammar(SUMS))
    for c in sums:
        assert c.finish_reason == "stop"
        assert re.fullmatch("[0-9]", reduce_sums(c.text)), c.text
    sentence = re.compile(r"(Romeo|Juliet) (sighs|loves (Romeo|Juliet))\.")
    outputs = dk.generate(lm, "ROMEO:", SAMPLE.replace(seed=2, n=4), constraint=Grammar(SENTENCE))
    outputs += dk.beam_search(lm, "ROMEO:", dk.SamplingParams(max_new_tokens=30, n=3), num_beams=3,
                              constraint=Grammar(SENTENCE))
    for c in outputs:
        assert c.finish_reason == "stop" and sentence.fullmatch(c.text), c.text


def test_choices_with_every_strategy(lm):
    options = ["Romeo", "Juliet", "Tybalt", "the nurse"]
    constraint = Choices(options)
    outputs = dk.generate(lm, "Who? ", GREEDY, constraint=constraint)
    outputs += dk.generate(lm, "Who? ", SAMPLE.replace(n=6, seed=0), constraint=constraint)
    outputs += dk.beam_search(lm, "Who? ", dk.SamplingParams(max_new_tokens=20, n=3), num_beams=3,
                              constraint=constraint)
    assert all(c.text in options and c.finish_reason == "stop" for c in outputs)
    assert len({c.text for c in outputs}) > 1


def test_mask_composes_with_sampling_adapters(lm):
    schema = SCHEMAS[25]  # nested object
    params = dk.SamplingParams(max_new_tokens=120, n=3, seed=5, temperature=0.7, top_k=5, top_p=0.9,
                               repetition_penalty=1.3, min_p=0.05)
    for c in dk.generate(lm, "ROMEO:", params, constraint=JsonSchema(schema)):
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    beams = dk.beam_search(lm, "ROMEO:", dk.SamplingParams(max_new_tokens=120, n=2,
                                                           no_repeat_ngram_size=0), num_beams=2,
                           constraint=JsonSchema(schema))
    for c in beams:
        jsonschema.validate(json.loads(c.text), schema)


def test_distribution_is_renormalised_over_allowed_tokens(lm):
    constraint = Regex(r"[0-9]{2}")
    [c] = dk.generate(lm, "ROMEO:", dk.SamplingParams(max_new_tokens=5, seed=0), constraint=constraint)
    allowed = GrammarMask(lm, constraint, 1).allowed()[0]  # [V]
    logits = lm.forward(torch.tensor([lm.encode("ROMEO:")]), lm.new_cache(1))[0, -1]
    raw = torch.log_softmax(logits, -1)
    first = c.token_ids[0]
    assert allowed[first]
    assert c.logprobs[0] == pytest.approx(float(raw[first]), abs=1e-5)
    expected = float(raw[first] - torch.logsumexp(raw[allowed], -1))
    assert c.processed_logprobs[0] == pytest.approx(expected, abs=1e-5)


def test_eos_is_allowed_only_when_the_grammar_accepts(lm):
    eos = lm.eos_token_ids[0]
    digit = lm.tokenizer.convert_tokens_to_ids("5")
    mask = GrammarMask(lm, Regex("[0-9]+"), 1)
    assert not mask.allowed()[0, eos]
    mask.accept(torch.tensor([digit]))
    assert mask.allowed()[0, eos] and mask.allowed()[0, digit]
    assert not mask.is_complete(0)  # more digits may follow


def test_a_complete_grammar_stops_without_eos(lm):
    for c in dk.generate(lm, "ROMEO:", SAMPLE.replace(n=3, seed=0), constraint=Choices(["JULIET: O"])):
        assert c.text == "JULIET: O" and c.finish_reason == "stop" and c.stop_reason is None
        assert not set(c.token_ids) & set(lm.eos_token_ids)
        assert lm.decode(c.token_ids) == "JULIET: O"


def test_rows_fork_their_matchers(lm):
    mask = GrammarMask(lm, Choices(["ab", "cd"]), 1)
    a, c = (lm.tokenizer.convert_tokens_to_ids(t) for t in ("a", "c"))
    mask.select_rows([0, 0])
    mask.accept(torch.tensor([a, c]))  # each copy follows its own choice
    b, d = (lm.tokenizer.convert_tokens_to_ids(t) for t in ("b", "d"))
    allowed = mask.allowed()
    assert allowed[0, b] and not allowed[0, d] and allowed[1, d] and not allowed[1, b]
    assert mask.completes(0, b) and not mask.is_complete(0)  # completes() does not advance


def test_running_out_of_tokens_ends_with_length(lm):
    [c] = dk.generate(lm, "ROMEO:", dk.SamplingParams(max_new_tokens=5, seed=1),
                      constraint=Regex("[a-z]{40}"))
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert re.fullmatch("[a-z]*", c.text)  # an unfinished prefix of a valid output
    [b] = dk.beam_search(lm, "ROMEO:", dk.SamplingParams(max_new_tokens=5), num_beams=2,
                         constraint=Regex("[a-z]{40}"))
    assert b.finish_reason == "length" and re.fullmatch("[a-z]*", b.text)


def test_stream_concatenates_to_the_constrained_text(lm):
    params = dk.SamplingParams(max_new_tokens=120, seed=9)
    constraint = JsonSchema(SCHEMAS[26])
    [c] = dk.generate(lm, "ROMEO:", params, constraint=constraint)
    assert "".join(dk.stream(lm, "ROMEO:", params, constraint=constraint)) == c.text


@pytest.mark.parametrize("make, match", [
    (lambda: JsonSchema({"type": "strin"}), "invalid JSON schema"),
    (lambda: JsonSchema('{"type": "object",'), "not valid JSON"),
    (lambda: JsonSchema({"type": "integer", "minimum": 5, "maximum": 3}), "invalid JSON schema"),
    (lambda: JsonSchema(["a"]), "must be a dict"),
    (lambda: Regex("a(b"), "invalid regex"),
    (lambda: Regex("[z-a]"), "invalid regex"),
    (lambda: Grammar("start: foo"), "invalid Lark grammar"),
    (lambda: Grammar('start: "a" ("b"'), "invalid Lark grammar"),
    (lambda: Grammar('start "a"'), "invalid Lark grammar"),
    (lambda: Grammar(""), "non-empty"),
    (lambda: Choices([]), "at least one"),
    (lambda: Choices(["a", ""]), "non-empty string"),
    (lambda: Choices("abc"), "list of strings"),
])
def test_bad_constraints_fail_when_made(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bad_combinations_fail_before_generation(lm, toy_lm):
    regex = Regex("[0-9]")
    with pytest.raises(ValueError, match="heal"):
        dk.generate(lm, "ROMEO:", GREEDY, constraint=regex, heal=True)
    with pytest.raises(ValueError, match="ignore_eos"):
        dk.generate(lm, "ROMEO:", GREEDY.replace(ignore_eos=True), constraint=regex)
    with pytest.raises(TypeError, match="tokenizer"):
        dk.generate(toy_lm, [[1, 2]], GREEDY, constraint=regex)
    with pytest.raises(TypeError, match="constraint must be"):
        dk.generate(lm, "ROMEO:", GREEDY, constraint={"type": "object"})


def test_constraint_on_the_default_backend(tiny_lm):
    """The same masks on the model `load_model` gives (NativeLM; the engine when it runs it)."""
    schema = SCHEMAS[29]  # anyOf of two objects
    outputs = dk.generate(tiny_lm, "ROMEO:", dk.SamplingParams(max_new_tokens=60, n=3, seed=4),
                          constraint=JsonSchema(schema))
    for c in outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    batch = dk.generate(tiny_lm, ["a", "JULIET: O"], dk.SamplingParams(max_new_tokens=20, n=2, seed=1),
                        constraint=Choices(["Romeo", "Tybalt"]))
    assert all(c.text in ("Romeo", "Tybalt") for cs in batch for c in cs)
