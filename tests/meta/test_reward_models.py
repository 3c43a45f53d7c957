"""Hugging Face reward models (meta/reward_models.py): tiny random models of each kind, built
here with transformers and saved to tmp_path, scored by decodekit (on its engine, and
through transformers) against transformers' own forward, per step and per sequence."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from decodekit.meta.reward_models import RewardFormat, RewardModel
from decodekit.meta.rewards import load_reward_model
from decodekit.models.registry import ASSETS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOLERANCE = 1e-5
PROMPT = "Compute: 12+3*4="
STEPS = ["3*4=12", "12+12=24", "Answer: 24"]


def tiny_config(family: str, **extra):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    return cls(vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, **extra)


def save(model, path):
    """The model with the arith model's character tokenizer (37 tokens)."""
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "arith" / name, path / name)
    return path


@pytest.fixture(scope="module")
def orm_dir(tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_config("llama", num_labels=1)).eval()
    return model, save(model, tmp_path_factory.mktemp("orm"))


@pytest.fixture(scope="module")
def token_prm_dir(tmp_path_factory):
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(tiny_config("qwen2", num_labels=2)).eval()
    return model, save(model, tmp_path_factory.mktemp("token-prm"))


@pytest.fixture(scope="module")
def lm_prm_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    model = LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False)).eval()
    return model, save(model, tmp_path_factory.mktemp("lm-prm"))


def expected_sequence(model, ids: list[int]) -> float:
    """transformers' own ORM score of a whole sequence: the pooled logit."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def expected_steps(model, ids: list[int], positions: list[int], plus_minus=None) -> list[float]:
    """transformers' per-position scores: P(label 1) of a token classifier, or p(+)/(p(+)+p(-))."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # [T, L or V]
    if plus_minus is not None:
        plus, minus = plus_minus
        return [(logits[p].softmax(-1)[plus] / (logits[p].softmax(-1)[[plus, minus]].sum())).item()
                for p in positions]
    return logits[positions].softmax(-1)[:, 1].tolist()


@pytest.mark.parametrize("native", [True, False])
def test_orm_equals_transformers_per_sequence(orm_dir, native):
    model, path = orm_dir
    orm = load_reward_model(path, native=native)
    assert orm.head == "sequence_classification" and orm.score_kind == "logit" and orm.native is native
    ids, positions, _ = orm.encode(PROMPT, STEPS)
    got = orm.score_segments(PROMPT, STEPS)
    # each segment's score is the ORM's score of the text up to its end
    want = [expected_sequence(model, ids[: p + 1]) for p in positions]
    assert got == pytest.approx(want, abs=TOLERANCE)
    whole = orm.score_segments(PROMPT, ["\n".join(STEPS)])
    assert whole[0] == pytest.approx(expected_sequence(model, orm.encode(PROMPT, ["\n".join(STEPS)])[0]),
                                     abs=TOLERANCE)


@pytest.mark.parametrize("native", [True, False])
def test_token_classification_prm_equals_transformers_per_step(token_prm_dir, native):
    model, path = token_prm_dir
    prm = RewardModel(path, RewardFormat(separator=":"), native=native)
    assert prm.head == "token_classification" and prm.score_kind == "probability"
    ids, positions, _ = prm.encode(PROMPT, STEPS)
    assert [ids[p] for p in positions] == [16] * 3  # read at each step's separator ":"
    assert prm.score_segments(PROMPT, STEPS) == pytest.approx(expected_steps(model, ids, positions),
                                                              abs=TOLERANCE)


@pytest.mark.parametrize("native", [True, False])
def test_causal_lm_prm_equals_transformers_per_step(lm_prm_dir, native):
    model, path = lm_prm_dir
    prm = load_reward_model(path, native=native)
    assert prm.head == "causal_lm" and prm.score_kind == "probability"
    ids, positions, _ = prm.encode(PROMPT, STEPS)  # no separator: each step's own last token
    assert positions == [len(prm.prompt_ids(PROMPT)) + 5, len(ids) - 11, len(ids) - 1]
    want = expected_steps(model, ids, positions, plus_minus=(12, 13))  # "+", "-"
    assert prm.score_segments(PROMPT, STEPS) == pytest.approx(want, abs=TOLERANCE)


def test_engine_batch_shares_prefixes_and_matches_transformers(token_prm_dir):
    """A tree's rounds: siblings extend a scored parent, so each computes only its new step;
    the scores equal transformers' whole-path forward."""
    model, path = token_prm_dir
    prm = RewardModel(path, RewardFormat(separator=":"))
    scorer = prm.scorer
    root = [(PROMPT, [step]) for step in ("3*4=12", "12+3=15", "3*4=11", "12*4=48")]
    children = [(PROMPT, ["3*4=12", step]) for step in ("12+12=24", "12+12=25", "Answer: 24")]
    for items in (root, children):
        before = scorer.tokens_computed
        got = prm.score_batch(items)
        computed = scorer.tokens_computed - before
        for (prompt, steps), scores in zip(items, got):
            ids, positions, _ = prm.encode(prompt, steps)
            assert scores == pytest.approx(expected_steps(model, ids, positions), abs=TOLERANCE)
        new_tokens = sum(len(prm.encode(p, s[-1:])[0]) - len(prm.prompt_ids(p)) for p, s in items)
        # the shared prefix (the prompt, then the parent's path) once, then each item's new step
        shared = len(prm.encode(*items[0][:1], items[0][1][:-1])[0])
        assert computed <= new_tokens + shared
    assert scorer.tokens_scored > 2 * scorer.tokens_computed


def test_concurrent_calls_batch_and_agree(orm_dir):
    import threading

    _, path = orm_dir
    orm = load_reward_model(path)
    texts = [f"{a}+{b}={a + b}" for a in range(1, 5) for b in range(1, 4)]
    alone = [orm.score_segments(PROMPT, [t])[0] for t in texts]
    results: dict[int, float] = {}

    def score(i):
        [results[i]] = orm.score_segments("Compute: 7*7=", [texts[i]])

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = [orm.score_segments("Compute: 7*7=", [t])[0] for t in texts]
    assert [results[i] for i in range(len(texts))] == pytest.approx(again, abs=TOLERANCE)
    assert alone != again  # the prompt matters: the scores are not a function of the text alone


def test_segments_edge_cases(orm_dir):
    _, path = orm_dir
    orm = load_reward_model(path)
    assert orm.score_segments(PROMPT, []) == []
    assert orm.score_batch([(PROMPT, []), (PROMPT, ["1"])])[0] == []
    with pytest.raises(ValueError, match="no tokens"):
        orm.score_segments(PROMPT, [""])


def write_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_errors_name_the_problem(tmp_path, orm_dir, lm_prm_dir, token_prm_dir):
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither probe.json nor config.json"):
        load_reward_model(tmp_path / "empty")
    qa = copy_dir(orm_dir[1], tmp_path / "qa")
    write_config(qa, architectures=["LlamaForQuestionAnswering"])
    with pytest.raises(ValueError, match="unknown reward head 'LlamaForQuestionAnswering'"):
        load_reward_model(qa)
    three = copy_dir(orm_dir[1], tmp_path / "three")
    write_config(three, id2label={"0": "a", "1": "b", "2": "c"})
    with pytest.raises(ValueError, match="num_labels=3"):
        load_reward_model(three)
    with pytest.raises(ValueError, match="separator '<extra_0>' is not a token"):
        RewardModel(token_prm_dir[1], RewardFormat(separator="<extra_0>"))
    with pytest.raises(ValueError, match="plus 'ab' must be one token"):
        RewardModel(lm_prm_dir[1], RewardFormat(plus="ab"))
    with pytest.raises(ValueError, match="no chat template"):
        RewardModel(orm_dir[1], RewardFormat(chat_template=True)).score_segments(PROMPT, ["1"])
    with pytest.raises(ValueError, match="plus and minus must differ"):
        RewardFormat(plus="+", minus="+")
    nohead = copy_dir(orm_dir[1], tmp_path / "nohead")
    from safetensors.torch import load_file, save_file

    state = load_file(nohead / "model.safetensors")
    save_file({k: v for k, v in state.items() if k.startswith("model.")}, nohead / "model.safetensors")
    with pytest.raises(ValueError, match="no score or classifier weights"):
        load_reward_model(nohead)


def arith_prm(model):
    """A batched arith PRM over a RewardModel (meta/tasks/arith.py `load_prm`'s segments)."""
    from decodekit.meta.tasks.arith import DELIMITER, format_prompt

    def batch(items):
        return model.score_batch([(format_prompt(q), [s.strip() + DELIMITER for s in steps])
                                  for q, steps in items])

    batch.score_kind = model.score_kind
    return batch


def test_tree_search_on_the_engine_equals_transformers_and_computes_less():
    """REBASE with the embedded token-classification PRM: the same tree, the same answer, with
    the engine scoring on far fewer reward-model tokens than whole paths."""
    import decodekit as dk
    from decodekit.meta import LocalGenerator, tree_search
    from decodekit.meta.tasks.arith import extract_answer, format_prompt, generate_problems

    policy = dk.load_model("arith")
    prompt = format_prompt(generate_problems(1, seed=3)[0])
    params = dk.SamplingParams(max_new_tokens=24, seed=1)
    results = {}
    for native in (True, False):
        model = load_reward_model("arith-hf-prm", native=native)
        trace: list = []
        result = tree_search(LocalGenerator(policy), prompt, arith_prm(model), n=8, method="rebase",
                             params=params, prm_kind="batch", extract=extract_answer, trace=trace)
        results[native] = (result, trace, model.scorer)
    (engine, engine_trace, scorer), (plain, plain_trace, _) = results[True], results[False]
    assert engine.answer == plain.answer and len(engine_trace) == len(plain_trace)
    for (_, a), (_, b) in zip(engine_trace, plain_trace):
        assert a.steps == b.steps and a.scores == pytest.approx(b.scores, abs=TOLERANCE)
    assert scorer.tokens_scored > 3 * scorer.tokens_computed


def test_an_orm_as_blockwise_cd_value():
    """BlockwiseCD's value (token ids of the completion so far -> values) from a logit ORM."""
    import decodekit as dk
    from decodekit.align import BlockwiseCD
    from decodekit.meta import LocalGenerator
    from decodekit.meta.tasks.arith import format_prompt, generate_problems, load_orm

    policy = dk.load_model("arith")
    problem = generate_problems(1, seed=8)[0]
    orm = load_orm("arith-hf-orm")
    seen = []

    def value(candidates):
        texts = [policy.decode(c) for c in candidates]
        seen.extend(texts)
        return orm.score_many(problem.question, texts)

    blocks = BlockwiseCD(LocalGenerator(policy), value, k=3, m=8)
    [[sample]] = blocks.generate([format_prompt(problem)], 1, dk.SamplingParams(max_new_tokens=32, seed=2))
    assert sample.text and len(seen) >= 3
    assert sample.text.startswith(max(seen[:3], key=lambda t: orm(problem.question, t)))


def test_eval_arith_takes_hugging_face_reward_models(capsys):
    from decodekit.cli import main

    main(["eval", "arith", "--strategies", "weighted-orm,beam-prm", "--orm", "arith-hf-orm",
          "--prm", "arith-hf-prm", "--n", "2", "--problems", "2", "--seeds", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert {row["strategy"] for row in report["rows"]} == {"weighted-orm", "beam-prm"}


def test_an_item_longer_than_the_context_is_named(orm_dir):
    orm = load_reward_model(orm_dir[1])
    with pytest.raises(ValueError, match="longer than the reward model's context"):
        orm.score_segments(PROMPT, ["1" * 300])


def test_qwen_process_reward_model_head_and_chat_template(tmp_path, token_prm_dir):
    """A `Qwen2ForProcessRewardModel` (Qwen2.5-Math-PRM's layout: `score` is Linear-ReLU-Linear)
    with a chat template: its default separator must be a token, and its scores equal the
    transformers body's final states through the same MLP."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    path = copy_dir(token_prm_dir[1], tmp_path / "qwen-prm")
    write_config(path, architectures=["Qwen2ForProcessRewardModel"])
    state = {k: v for k, v in load_file(path / "model.safetensors").items() if k.startswith("model.")}
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    state.update({f"score.{k}": v.detach().clone() for k, v in mlp.state_dict().items()})
    save_file(state, path / "model.safetensors")
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                                         "{% if add_generation_prompt %}Answer: {% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="separator '<extra_0>' is not a token"):
        load_reward_model(path)  # the model card's default, which this tokenizer lacks
    prm = RewardModel(path, RewardFormat(separator=":", chat_template=True, system="Compute"))
    assert prm.head == "token_classification" and prm.score_kind == "probability"
    ids, positions, _ = prm.encode("1+2*3=", STEPS)
    prompt = prm.tokenizer.decode(ids[: len(prm.prompt_ids("1+2*3="))])
    assert prompt == "Compute\n1+2*3=\nAnswer: "  # system, user turn, generation prompt
    body = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        states = body(input_ids=torch.tensor([ids])).last_hidden_state[0, positions]
        want = mlp(states).double().softmax(-1)[:, 1].tolist()
    assert prm.score_segments("1+2*3=", STEPS) == pytest.approx(want, abs=TOLERANCE)
